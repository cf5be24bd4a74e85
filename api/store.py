"""Stored plans: the store interface, and :func:`open_store`, which picks the backend by URL.

Two backends keep the same rows and the same JSON text:

* :class:`api.store_sqlite.SqliteStore` (``sqlite:///plans.db``, or a plain path): the
  default, standard library only, one machine (several processes share one file);
* :class:`api.store_postgres.PostgresStore` (``postgresql://user@host/db``): several
  server replicas on one database.  psycopg is imported only when such a URL is used
  (``pip install -e '.[postgres]'``).

One row per distinct request: the canonical request JSON, its SHA-256 (the cache key,
unique), the model name and the plan JSON.  Each backend versions its schema in
``pipeplan_schema`` and migrates it when the server starts, safely when several start at once.
"""

from __future__ import annotations

import abc
import datetime as dt
from dataclasses import dataclass

#: URL schemes of the SQLite backend
SQLITE_SCHEMES = ("sqlite", "sqlite+pysqlite")
#: URL schemes of the PostgreSQL backend
POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")


@dataclass(frozen=True)
class StoredPlan:
    id: str
    request_sha256: str
    created_at: dt.datetime
    request_json: str
    plan_json: str
    solve_s: float
    model: str = ""


class StoreUnavailableError(Exception):
    """The database cannot be reached now (down, restarting, or every connection busy past the
    pool's timeout); the service answers 503 with ``Retry-After``."""


class PlanIdConflictError(Exception):
    """A plan id already stored for another request (ids are request-hash prefixes: only a
    caller that makes up ids can cause it)."""

    def __init__(self, plan_id: str, request_sha256: str, detail: str) -> None:
        super().__init__(
            f"plan id {plan_id!r} is already stored for another request than {request_sha256}: "
            f"derive ids from the request hash ({detail})"
        )


class PlanStore(abc.ABC):
    """Plans by id and by request hash.  Thread-safe; several processes may share a database."""

    url: str

    @abc.abstractmethod
    def migrate(self) -> int:
        """Create or upgrade the schema; return the version now in the database."""

    @abc.abstractmethod
    def schema_versions(self) -> list[int]:
        """The schema versions recorded in the database, in order (empty before :meth:`migrate`)."""

    @abc.abstractmethod
    def get(self, plan_id: str) -> StoredPlan | None: ...

    @abc.abstractmethod
    def get_by_request(self, request_sha256: str) -> StoredPlan | None: ...

    @abc.abstractmethod
    def put(
        self, plan_id: str, request_sha256: str, *, model: str, request_json: str, plan_json: str, solve_s: float
    ) -> StoredPlan:
        """Store a plan in one atomic statement; when the request is already stored (a race,
        also across processes), return the stored row instead.  The model name is cut to 256
        characters.  :class:`PlanIdConflictError` when ``plan_id`` holds another request."""

    @abc.abstractmethod
    def recent(self, *, limit: int = 50, model: str | None = None) -> list[StoredPlan]:
        """The newest plans first (of ``model`` only, when given), at most ``limit``."""

    @abc.abstractmethod
    def models(self) -> list[str]:
        """The distinct model names stored, sorted."""

    @abc.abstractmethod
    def count(self) -> int: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Close pooled connections; the store still works afterwards, on new connections."""


def url_scheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def check_database_url(url: str) -> None:
    """Raise ``ValueError`` (naming the URL and the accepted forms) unless a backend takes it.
    Imports no database driver."""
    if url_scheme(url) in POSTGRES_SCHEMES:
        from api.store_postgres import parse_postgres_url

        parse_postgres_url(url)
    else:
        from api.store_sqlite import parse_sqlite_url

        parse_sqlite_url(url)


def open_store(url: str) -> PlanStore:
    """The store for a database URL: PostgreSQL for ``postgresql://``, SQLite otherwise.
    Nothing is connected until the first call."""
    if url_scheme(url) in POSTGRES_SCHEMES:
        from api.store_postgres import PostgresStore

        return PostgresStore(url)
    from api.store_sqlite import SqliteStore

    return SqliteStore(url)
