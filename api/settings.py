"""Server settings, read from ``PIPEPLAN_*`` environment variables by pydantic-settings.

Nothing is read at import time: :func:`api.app.create_app` builds an :class:`ApiSettings`
when it is not given one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.store import check_database_url
from planner.limits import (
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_TIME_LIMIT_S,
)

DEFAULT_DB = "sqlite:///pipeplan-plans.db"


def database_url(value: str) -> str:
    """A database URL from a URL (``sqlite:///plans.db``, ``postgresql://user@host/db``) or a
    plain SQLite file path (``plans.db`` -> ``sqlite:///plans.db``).

    Raises ``ValueError`` (naming the value and the accepted forms) for other databases."""
    value = value.strip()
    if not value:
        raise ValueError("the database is empty: give a path such as plans.db or a URL such as sqlite:///plans.db")
    if "://" in value:
        check_database_url(value)
        return value
    if value == ":memory:":
        return "sqlite://"
    path = str(Path(value).expanduser()).replace("%", "%25").replace("?", "%3F")
    return f"sqlite:///{path}"


class ApiSettings(BaseSettings):
    """Settings of the planning service (environment: ``PIPEPLAN_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="PIPEPLAN_", extra="ignore", frozen=True)

    api_token: SecretStr | None = Field(
        default=None,
        description="when set, every endpoint but /healthz needs 'Authorization: Bearer <token>'",
    )
    db: str = Field(
        default=DEFAULT_DB,
        description="SQLite file path or URL (sqlite:///plans.db, sqlite:// for memory), or a PostgreSQL URL "
        "(postgresql://user@host/db, for several replicas; pip install -e '.[postgres]') where plans and "
        "their requests are stored",
    )
    max_time_limit_s: float = Field(
        default=60.0, gt=0, le=MAX_TIME_LIMIT_S, description="cap on the solver time limit a request may ask for"
    )
    max_body_bytes: int = Field(default=16 * 2**20, ge=1024, description="larger request bodies get 413")
    max_layers: int = Field(
        default=4096, ge=1, le=MAX_LAYERS, description="profiles with more layers get 422"
    )
    max_devices: int = Field(
        default=4096, ge=1, le=MAX_DEVICES, description="clusters with more devices get 422"
    )
    max_microbatches: int = Field(
        default=1024,
        ge=1,
        le=MAX_MICROBATCHES,
        description="micro-batches per step a request may fix (estimate, options)",
    )
    max_global_batch: int = Field(
        default=MAX_GLOBAL_BATCH, ge=1, le=MAX_GLOBAL_BATCH, description="larger global batch sizes get 422"
    )
    solver_workers: int = Field(default=2, ge=1, description="solves that run at the same time")
    reader_workers: int = Field(
        default=2,
        ge=1,
        description="request bodies parsed and validated at the same time (in worker processes in "
        "'process' mode, so a large body never stalls the event loop)",
    )
    solver_mode: Literal["process", "thread"] = Field(
        default="process",
        description="'process': solves (and request reading) run in worker processes (isolated, "
        "off the GIL, stopped when they overrun); 'thread': in threads of this process",
    )
    solver: str = Field(
        default="planner.solver:solve",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="the solve function as 'module:function' (server configuration)",
    )
    max_pending_solves: int = Field(
        default=64, ge=1, description="solves queued or running at once; more get 503"
    )
    solve_grace_s: float = Field(
        default=30.0, gt=0, description="time past a solve's limit before the request gets 504"
    )
    public_docs: bool = Field(
        default=False, description="serve /docs and /openapi.json without the token"
    )

    @field_validator("db")
    @classmethod
    def _db_url(cls, value: str) -> str:
        return database_url(value)

    @field_validator("api_token")
    @classmethod
    def _empty_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value():
            return None
        return value
