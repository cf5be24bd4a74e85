"""Stored plans in PostgreSQL, through psycopg 3 and a psycopg_pool connection pool.

For several server replicas on one database (``--db postgresql://user@host/db``).  The rows
and the JSON text are the ones :mod:`api.store_sqlite` keeps (text columns, not ``jsonb``, so
a plan comes back byte for byte as it went in).

* The schema is versioned in ``pipeplan_schema``; :meth:`PostgresStore.migrate` applies the
  steps of :data:`MIGRATIONS` the database has not seen yet in one transaction that first
  takes a transaction-scoped advisory lock: replicas starting at once run the steps once, in turn.
* Identical requests: one ``INSERT ... ON CONFLICT (request_sha256) DO NOTHING RETURNING``
  statement; of concurrent identical posts, on any replicas, exactly one row is written.
* Every connection has a connect timeout and a statement timeout, and a caller waits at most
  the pool timeout for a connection: with the database down or restarting, calls fail with
  :class:`api.store.StoreUnavailableError` (503) within seconds instead of hanging.  Pooled
  connections are checked before use, so the first requests after a restart succeed.

psycopg is imported when the first connection is made, never at import: SQLite users need
no driver.  Pool and timeout options ride in the URL's query (``pool_max=20``,
``pool_timeout=3``, ``statement_timeout=10``, in seconds); other options go to libpq.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from api.store import (
    POSTGRES_SCHEMES,
    PlanIdConflictError,
    PlanStore,
    StoredPlan,
    StoreUnavailableError,
)

if TYPE_CHECKING:
    from psycopg import Connection
    from psycopg_pool import ConnectionPool

INSTALL_HINT = "install the PostgreSQL driver with pip install -e '.[postgres]' (psycopg and psycopg-pool)"

#: key of the advisory lock the migration holds (any fixed 64-bit number; "pipeplan" in ASCII)
MIGRATION_LOCK = 0x7069706570_6C616E

_PLAN_COLUMNS = "id, request_sha256, created_at, request_json, plan_json, solve_s, model"
_OPTIONS = {
    "pool_min": (int, 1, 0, 1000),
    "pool_max": (int, 10, 1, 1000),
    "pool_timeout": (float, 3.0, 0.01, 3600.0),
    "statement_timeout": (float, 30.0, 0.01, 86400.0),
}


@dataclass(frozen=True)
class PostgresTarget:
    """What the pool gets for a database URL."""

    conninfo: str  # a libpq URL (password included)
    display: str  # the URL with the password hidden, for messages and logs
    pool_min: int
    pool_max: int
    pool_timeout_s: float
    statement_timeout_s: float


def _bad_url(url: str, why: str) -> ValueError:
    return ValueError(
        f"unsupported database URL {hide_password(url)!r}: {why}: give a PostgreSQL URL such as "
        "postgresql://user@host:5432/db (options: pool_max, pool_timeout, statement_timeout in "
        "seconds, and libpq's, e.g. connect_timeout or sslmode)"
    )


def hide_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()


def parse_postgres_url(url: str) -> PostgresTarget:
    """Check a PostgreSQL URL and split off pipeplan's pool options (no driver needed)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise _bad_url(url, str(err)) from None
    if parts.scheme.lower() not in POSTGRES_SCHEMES:
        raise _bad_url(url, f"the scheme {parts.scheme!r} is not one of {', '.join(POSTGRES_SCHEMES)}")
    if port == 0:
        raise _bad_url(url, "port 0")
    database = unquote(parts.path.lstrip("/"))
    if "/" in database:
        raise _bad_url(url, f"{database!r} is not a database name")
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    values: dict[str, Any] = {}
    for key, (kind, default, low, high) in _OPTIONS.items():
        raw = options.pop(key, None)
        if raw is None:
            values[key] = default
            continue
        try:
            value = kind(raw)
        except ValueError:
            raise _bad_url(url, f"{key}={raw!r} is not a number") from None
        if not low <= value <= high:
            raise _bad_url(url, f"{key}={raw!r} is not between {low} and {high}")
        values[key] = value
    if values["pool_min"] > values["pool_max"]:
        raise _bad_url(url, f"pool_min={values['pool_min']} is above pool_max={values['pool_max']}")
    options.setdefault("connect_timeout", str(max(1, round(values["pool_timeout"]))))
    options.setdefault("application_name", "pipeplan")
    conninfo = parts._replace(scheme="postgresql", query=urlencode(options, quote_via=quote)).geturl()
    return PostgresTarget(
        conninfo=conninfo,
        display=hide_password(url),
        pool_min=values["pool_min"],
        pool_max=values["pool_max"],
        pool_timeout_s=values["pool_timeout"],
        statement_timeout_s=values["statement_timeout"],
    )


def _create_v1(conn: Connection[Any]) -> None:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS plans ("
        " id VARCHAR(64) NOT NULL,"
        " request_sha256 VARCHAR(64) NOT NULL,"
        " created_at TIMESTAMP WITH TIME ZONE NOT NULL,"
        " model VARCHAR(256) NOT NULL,"
        " request_json TEXT NOT NULL,"
        " plan_json TEXT NOT NULL,"
        " solve_s DOUBLE PRECISION NOT NULL,"
        " PRIMARY KEY (id))"
    )
    conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS ix_plans_request_sha256 ON plans (request_sha256)")
    conn.execute("CREATE INDEX IF NOT EXISTS ix_plans_created_at ON plans (created_at DESC)")


#: ordered schema steps; step i brings the database to version i + 1.  Append, never edit.
#: Each runs inside the migration's transaction (PostgreSQL's DDL is transactional).
MIGRATIONS: tuple[Callable[[Connection[Any]], None], ...] = (_create_v1,)


def _text(value: str) -> str:
    """PostgreSQL text holds no NUL character and only valid UTF-8."""
    return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def _stored(row: tuple[Any, ...]) -> StoredPlan:
    plan_id, sha, created, request_json, plan_json, solve_s, model = row
    return StoredPlan(
        plan_id, sha, created.astimezone(dt.timezone.utc), request_json, plan_json, float(solve_s), model
    )


class PostgresStore(PlanStore):
    """Plans by id and by request hash, in PostgreSQL (see the module doc).

    Thread-safe (a connection pool); after a fork the child opens a pool of its own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.target = parse_postgres_url(url)
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._pid = os.getpid()

    def _driver(self) -> ModuleType:
        """psycopg, imported now (the first database call), with the fix when it is missing."""
        try:
            import psycopg
            import psycopg_pool  # noqa: F401  (the pool's package: checked here, used below)
        except ImportError as err:
            raise RuntimeError(
                f"the plan database {self.target.display} is PostgreSQL, but {err}: {INSTALL_HINT}"
            ) from None
        return psycopg

    def _get_pool(self) -> ConnectionPool[Any]:
        self._driver()
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's connections are not ours
                self._pid = os.getpid()
                self._pool = None
            if self._pool is None:
                from psycopg_pool import ConnectionPool

                t = self.target
                self._pool = ConnectionPool(
                    t.conninfo,
                    min_size=min(t.pool_min, t.pool_max),
                    max_size=t.pool_max,
                    timeout=t.pool_timeout_s,
                    reconnect_timeout=max(60.0, 10 * t.pool_timeout_s),
                    check=ConnectionPool.check_connection,
                    kwargs={
                        "autocommit": True,
                        "options": f"-c statement_timeout={int(t.statement_timeout_s * 1000)} -c timezone=UTC",
                    },
                    name="pipeplan",
                    open=False,
                )
                self._pool.open(wait=False)
            return self._pool

    @contextmanager
    def _connection(self) -> Iterator[Connection[Any]]:
        pool = self._get_pool()
        psycopg = self._driver()
        try:
            with pool.connection() as conn:
                yield conn
        except psycopg.OperationalError as err:  # down, restarting, timed out (PoolTimeout too)
            detail = " ".join(str(err).split()) or type(err).__name__
            raise StoreUnavailableError(
                f"the plan database {self.target.display} is unavailable ({detail}): check that "
                "PostgreSQL is running and reachable, then retry"
            ) from err

    def migrate(self) -> int:
        """Create or upgrade the schema; return the version now in the database.

        Safe when several replicas start at once: all steps run in one transaction that first
        takes the advisory lock :data:`MIGRATION_LOCK` (released at commit), so one replica
        migrates while the others wait, then find the new version and do nothing."""
        with self._connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS pipeplan_schema ("
                " version INTEGER NOT NULL,"
                " applied_at TIMESTAMP WITH TIME ZONE NOT NULL,"
                " PRIMARY KEY (version))"
            )
            row = conn.execute("SELECT max(version) FROM pipeplan_schema").fetchone()
            current = int(row[0] or 0) if row is not None else 0
            if current > len(MIGRATIONS):
                raise RuntimeError(
                    f"the database {self.target.display} has schema version {current} but this pipeplan "
                    f"knows up to {len(MIGRATIONS)}: upgrade pipeplan or point PIPEPLAN_DB at another database"
                )
            for version in range(current + 1, len(MIGRATIONS) + 1):
                MIGRATIONS[version - 1](conn)
                conn.execute(
                    "INSERT INTO pipeplan_schema (version, applied_at) VALUES (%s, clock_timestamp())", (version,)
                )
        return len(MIGRATIONS)

    def schema_versions(self) -> list[int]:
        with self._connection() as conn:
            exists = conn.execute("SELECT to_regclass('pipeplan_schema')").fetchone()
            if exists is None or exists[0] is None:
                return []
            return [int(v) for (v,) in conn.execute("SELECT version FROM pipeplan_schema ORDER BY version")]

    def get(self, plan_id: str) -> StoredPlan | None:
        with self._connection() as conn:
            row = conn.execute(f"SELECT {_PLAN_COLUMNS} FROM plans WHERE id = %s", (_text(plan_id),)).fetchone()
        return _stored(row) if row is not None else None

    def get_by_request(self, request_sha256: str) -> StoredPlan | None:
        with self._connection() as conn:
            row = conn.execute(
                f"SELECT {_PLAN_COLUMNS} FROM plans WHERE request_sha256 = %s", (_text(request_sha256),)
            ).fetchone()
        return _stored(row) if row is not None else None

    def put(
        self, plan_id: str, request_sha256: str, *, model: str, request_json: str, plan_json: str, solve_s: float
    ) -> StoredPlan:
        psycopg = self._driver()
        try:
            with self._connection() as conn:
                row = conn.execute(
                    "INSERT INTO plans (id, request_sha256, created_at, model, request_json, plan_json, solve_s)"
                    " VALUES (%s, %s, date_trunc('microseconds', clock_timestamp()), %s, %s, %s, %s)"
                    f" ON CONFLICT (request_sha256) DO NOTHING RETURNING {_PLAN_COLUMNS}",
                    (
                        _text(plan_id),
                        _text(request_sha256),
                        _text(model)[:256],
                        request_json,  # canonical JSON: control characters are escaped
                        plan_json,
                        float(solve_s),
                    ),
                ).fetchone()
        except psycopg.errors.UniqueViolation as err:
            raise PlanIdConflictError(plan_id, request_sha256, " ".join(str(err).split())) from err
        if row is not None:
            return _stored(row)
        # another caller stored this request first; its row is committed (ON CONFLICT waited for it)
        existing = self.get_by_request(request_sha256)
        if existing is None:
            raise RuntimeError(f"the plan of request {request_sha256} vanished from {self.target.display}")
        return existing

    def recent(self, *, limit: int = 50, model: str | None = None) -> list[StoredPlan]:
        with self._connection() as conn:
            if model:
                rows = conn.execute(
                    f"SELECT {_PLAN_COLUMNS} FROM plans WHERE model = %s ORDER BY created_at DESC, id LIMIT %s",
                    (_text(model), limit),
                ).fetchall()
            else:
                rows = conn.execute(
                    f"SELECT {_PLAN_COLUMNS} FROM plans ORDER BY created_at DESC, id LIMIT %s", (limit,)
                ).fetchall()
        return [_stored(row) for row in rows]

    def models(self) -> list[str]:
        with self._connection() as conn:
            return [m for (m,) in conn.execute("SELECT DISTINCT model FROM plans ORDER BY model")]

    def count(self) -> int:
        with self._connection() as conn:
            row = conn.execute("SELECT count(*) FROM plans").fetchone()
        return int(row[0]) if row is not None else 0

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            mine = self._pid == os.getpid()
        if pool is not None and mine:
            pool.close(timeout=5.0)
