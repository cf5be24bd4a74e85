"""``pipeplan serve``: the planning service (FastAPI under uvicorn)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the planning service (HTTP API)",
        description="Serve POST /v1/plans, /v1/estimate, /v1/presets and /healthz (OpenAPI at /docs). "
        "Settings come from PIPEPLAN_* environment variables (PIPEPLAN_API_TOKEN, "
        "PIPEPLAN_MAX_TIME_LIMIT_S, PIPEPLAN_MAX_BODY_BYTES, PIPEPLAN_MAX_LAYERS, PIPEPLAN_MAX_DEVICES, "
        "PIPEPLAN_SOLVER_WORKERS, ...); the flags below override them.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (default 1)")
    p.add_argument("--db", help="where plans are stored: a SQLite file or sqlite:/// URL, or a PostgreSQL URL "
                   "postgresql://user@host/db that several replicas share (pip install -e '.[postgres]'); "
                   "default: PIPEPLAN_DB or sqlite:///pipeplan-plans.db")
    p.add_argument("--solver-workers", type=int, help="solves that run at once per server process")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")
    p.set_defaults(func=run)


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, plus the JSON access lines of ``pipeplan.access`` on stdout."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
            "json": {"format": "%(message)s"},
        },
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"},
            "access": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "pipeplan.api": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "pipeplan.access": {"handlers": ["access"], "level": level.upper(), "propagate": False},
            # the PostgreSQL pool says why a connection failed (the 503s say that it did)
            "psycopg.pool": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
        },
    }


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from api.settings import ApiSettings
    from planner.errors import InputError

    if args.workers < 1:
        raise InputError(f"--workers {args.workers}: give 1 or more worker processes")
    if not 0 < args.port < 65536:
        raise InputError(f"--port {args.port}: give a TCP port between 1 and 65535")
    # Settings reach every uvicorn worker process through the environment.
    if args.db is not None:
        os.environ["PIPEPLAN_DB"] = args.db
    if args.solver_workers is not None:
        os.environ["PIPEPLAN_SOLVER_WORKERS"] = str(args.solver_workers)
    try:
        settings = ApiSettings()
    except ValueError as err:
        raise InputError(f"invalid server settings (PIPEPLAN_* environment): {err}") from None
    _check_database(settings.db)
    if args.host not in LOOPBACK and settings.api_token is None:
        print(
            f"warning: serving on {args.host} without PIPEPLAN_API_TOKEN: anyone who can reach this "
            "address can use the service",
            file=sys.stderr,
        )
    print(
        f"pipeplan planning service on http://{args.host}:{args.port} (docs at /docs, plan pages at "
        f"/plans), plans in {_shown(settings.db)}, auth {'on' if settings.api_token else 'off'}",
        file=sys.stderr,
    )
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        access_log=False,
        log_config=log_config(args.log_level),
        log_level=args.log_level,
    )
    return 0


def _shown(url: str) -> str:
    from api.store_postgres import hide_password

    return hide_password(url)


def _check_database(url: str) -> None:
    """Open (and create or migrate) the store once here, so a bad path, an unreachable
    PostgreSQL or a missing driver is a clear error before uvicorn starts."""
    import sqlite3

    from api.store import StoreUnavailableError, open_store, url_scheme
    from planner.errors import InputError

    postgres = url_scheme(url).startswith("postgres")
    try:
        store = open_store(url)
        try:
            store.migrate()
        finally:
            store.close()
    except StoreUnavailableError as err:  # its message names the database (password hidden) and the fix
        raise InputError(f"cannot open the plan database: {err}") from None
    except (sqlite3.Error, OSError, RuntimeError, ValueError) as err:
        detail = str(err).splitlines()[0]
        if postgres:
            from api.store_postgres import hide_password

            raise InputError(
                f"cannot open the plan database {hide_password(url)}: {detail}: check the URL, that "
                "PostgreSQL runs and the user may create tables, or choose another with --db URL"
            ) from None
        raise InputError(
            f"cannot open the plan database {url}: {detail}: check that its folder exists and is "
            "writable, or choose another with --db PATH"
        ) from None
