"""Stored plans in SQLite, through the standard library's :mod:`sqlite3` (the default store).

One row per distinct request: the canonical request JSON, its SHA-256 (the cache key,
unique), and the plan JSON.  The schema is versioned in ``pipeplan_schema``; on start
:meth:`SqliteStore.migrate` applies, in one ``BEGIN IMMEDIATE`` transaction, the steps of
:data:`MIGRATIONS` the database has not seen yet.

Tables, columns and the timestamp text format are the ones the earlier SQLAlchemy store
wrote, so its databases open here unchanged.
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

from api.store import SQLITE_SCHEMES, PlanIdConflictError, PlanStore, StoredPlan

#: how long a connection waits for another writer's lock before failing
DEFAULT_TIMEOUT_S = 30.0

#: idle connections kept for reuse (the app calls the store from a thread pool)
MAX_IDLE_CONNECTIONS = 16

#: the text form of timestamps (UTC, no zone), as SQLAlchemy's SQLite ``DATETIME`` writes it
_TIMESTAMP = "%Y-%m-%d %H:%M:%S.%f"

_PLAN_COLUMNS = "id, request_sha256, created_at, request_json, plan_json, solve_s, model"


@dataclass(frozen=True)
class DatabaseTarget:
    """What :func:`sqlite3.connect` gets for a database URL."""

    database: str
    uri: bool
    memory: bool
    timeout_s: float


def _bad_url(url: str, why: str) -> ValueError:
    return ValueError(
        f"unsupported database URL {url!r}: {why}: give a SQLite file path such as plans.db, "
        "a URL such as sqlite:///plans.db (relative) or sqlite:////abs/plans.db, sqlite:// for memory, "
        "or a PostgreSQL URL such as postgresql://user@host/db"
    )


def _flag(url: str, key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise _bad_url(url, f"{key}={value!r} is not true or false")


def parse_sqlite_url(url: str) -> DatabaseTarget:
    """Read a SQLite URL the way SQLAlchemy did: ``sqlite://`` and ``sqlite:///:memory:`` are
    memory, ``sqlite:///rel.db`` is relative to the working directory (resolved now),
    ``sqlite:////abs.db`` absolute; the path is percent-decoded.  Query options: ``timeout``
    (seconds) and ``uri=true`` (the path is a SQLite ``file:`` URI; other options join it)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SQLITE_SCHEMES:
        raise _bad_url(url, "pipeplan stores plans in SQLite or PostgreSQL only")
    path, _, query = rest.partition("?")
    if path and not path.startswith("/"):
        raise _bad_url(url, f"a SQLite URL has no host ({path.split('/')[0]!r})")
    database = unquote(path[1:])
    options = dict(parse_qsl(query, keep_blank_values=True))
    uri = _flag(url, "uri", options.pop("uri")) if "uri" in options else False
    timeout_s = DEFAULT_TIMEOUT_S
    if "timeout" in options:
        raw = options.pop("timeout")
        try:
            timeout_s = float(raw)
        except ValueError:
            raise _bad_url(url, f"timeout={raw!r} is not a number of seconds") from None
        if not 0 <= timeout_s < 10**6:
            raise _bad_url(url, f"timeout={raw!r} is not between 0 and 1e6 seconds")
    if uri:
        if not database:
            raise _bad_url(url, "uri=true needs a file: URI after sqlite:///")
        memory = database in (":memory:", "file::memory:") or options.get("mode") == "memory"
        if options:
            database += "?" + "&".join(f"{key}={options[key]}" for key in sorted(options))
        return DatabaseTarget(database, True, memory, timeout_s)
    if options:
        raise _bad_url(url, f"unknown option(s) {', '.join(sorted(options))} (add uri=true for SQLite URI options)")
    if database in ("", ":memory:"):
        return DatabaseTarget(":memory:", False, True, timeout_s)
    return DatabaseTarget(os.path.abspath(database), False, False, timeout_s)


def _timestamp(value: dt.datetime) -> str:
    return value.astimezone(dt.timezone.utc).strftime(_TIMESTAMP)


def _parse_timestamp(value: str) -> dt.datetime:
    parsed = dt.datetime.fromisoformat(value)
    if parsed.tzinfo is None:  # stored without a zone; everything is written in UTC
        return parsed.replace(tzinfo=dt.timezone.utc)
    return parsed.astimezone(dt.timezone.utc)


def _stored(row: tuple[str, str, str, str, str, float, str]) -> StoredPlan:
    plan_id, sha, created, request_json, plan_json, solve_s, model = row
    return StoredPlan(plan_id, sha, _parse_timestamp(created), request_json, plan_json, float(solve_s), model)


def _create_schema_table(conn: sqlite3.Connection) -> None:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS pipeplan_schema ("
        " version INTEGER NOT NULL,"
        " applied_at DATETIME NOT NULL,"
        " PRIMARY KEY (version))"
    )


def _create_v1(conn: sqlite3.Connection) -> None:
    conn.execute(
        "CREATE TABLE IF NOT EXISTS plans ("
        " id VARCHAR(64) NOT NULL,"
        " request_sha256 VARCHAR(64) NOT NULL,"
        " created_at DATETIME NOT NULL,"
        " model VARCHAR(256) NOT NULL,"
        " request_json TEXT NOT NULL,"
        " plan_json TEXT NOT NULL,"
        " solve_s FLOAT NOT NULL,"
        " PRIMARY KEY (id))"
    )
    conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS ix_plans_request_sha256 ON plans (request_sha256)")


#: ordered schema steps; step i brings the database to version i + 1.  Append, never edit.
#: Each runs inside the migration's transaction: plain ``execute`` calls, no commit, no
#: ``executescript`` (it commits).
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_create_v1,)


def _is_busy(err: sqlite3.OperationalError) -> bool:
    text = str(err).lower()
    return "locked" in text or "busy" in text


class SqliteStore(PlanStore):
    """Plans by id and by request hash, in SQLite.

    Thread-safe: each call takes a connection from a small pool (one caller at a time per
    connection); an in-memory database is one connection shared under a lock.  Several
    processes may use one database file (WAL, busy timeout)."""

    def __init__(self, url: str, *, max_idle: int = MAX_IDLE_CONNECTIONS) -> None:
        self.url = url
        self.target = parse_sqlite_url(url)
        self._max_idle = max_idle
        self._lock = threading.RLock()
        self._idle: list[sqlite3.Connection] = []
        self._shared: sqlite3.Connection | None = None
        self._generation = 0
        self._pid = os.getpid()

    def _open(self) -> sqlite3.Connection:
        t = self.target
        conn = sqlite3.connect(
            t.database, timeout=t.timeout_s, isolation_level=None, check_same_thread=False, uri=t.uri
        )
        try:
            conn.execute(f"PRAGMA busy_timeout={int(t.timeout_s * 1000)}")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            conn.close()
            raise
        return conn

    def _forked(self) -> bool:
        """After a fork, connections of the parent are dropped (never used nor closed here)."""
        if os.getpid() == self._pid:
            return False
        self._pid = os.getpid()
        self._idle = []
        self._shared = None
        self._generation += 1
        return True

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        if self.target.memory:
            with self._lock:
                self._forked()
                if self._shared is None:
                    self._shared = self._open()
                yield self._shared
            return
        with self._lock:
            self._forked()
            conn = self._idle.pop() if self._idle else None
            generation = self._generation
        if conn is None:
            conn = self._open()
        keep = False
        try:
            yield conn
            keep = not conn.in_transaction
        finally:
            if keep:
                with self._lock:
                    if generation == self._generation and len(self._idle) < self._max_idle:
                        self._idle.append(conn)
                    else:
                        keep = False
            if not keep:
                conn.close()

    def migrate(self) -> int:
        """Create or upgrade the schema; return the version now in the database.

        Safe when several server processes start on one database at once: the check and all
        steps run in one ``BEGIN IMMEDIATE`` transaction (one writer at a time; the others
        wait for the lock, then see the new version), and a lock lost anyway is retried."""
        for attempt in range(10):
            try:
                return self._migrate_once()
            except sqlite3.OperationalError as err:
                if attempt == 9 or not _is_busy(err):
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _migrate_once(self) -> int:
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                _create_schema_table(conn)
                current = conn.execute("SELECT max(version) FROM pipeplan_schema").fetchone()[0] or 0
                if current > len(MIGRATIONS):
                    raise RuntimeError(
                        f"the database {self.url} has schema version {current} but this pipeplan knows up "
                        f"to {len(MIGRATIONS)}: upgrade pipeplan or point PIPEPLAN_DB at another database"
                    )
                for version in range(current + 1, len(MIGRATIONS) + 1):
                    MIGRATIONS[version - 1](conn)
                    conn.execute(
                        "INSERT INTO pipeplan_schema (version, applied_at) VALUES (?, ?)",
                        (version, _timestamp(dt.datetime.now(dt.timezone.utc))),
                    )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return len(MIGRATIONS)

    def schema_versions(self) -> list[int]:
        """The schema versions recorded in the database, in order (empty before :meth:`migrate`)."""
        with self._connection() as conn:
            exists = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'pipeplan_schema'"
            ).fetchone()
            if exists is None:
                return []
            return [int(v) for (v,) in conn.execute("SELECT version FROM pipeplan_schema ORDER BY version")]

    def get(self, plan_id: str) -> StoredPlan | None:
        with self._connection() as conn:
            row = conn.execute(f"SELECT {_PLAN_COLUMNS} FROM plans WHERE id = ?", (plan_id,)).fetchone()
        return _stored(row) if row is not None else None

    def get_by_request(self, request_sha256: str) -> StoredPlan | None:
        with self._connection() as conn:
            row = conn.execute(
                f"SELECT {_PLAN_COLUMNS} FROM plans WHERE request_sha256 = ?", (request_sha256,)
            ).fetchone()
        return _stored(row) if row is not None else None

    def put(
        self, plan_id: str, request_sha256: str, *, model: str, request_json: str, plan_json: str, solve_s: float
    ) -> StoredPlan:
        """Store a plan; when the request is already stored (a race), return the stored one.

        One ``INSERT ... ON CONFLICT (request_sha256) DO NOTHING``: of concurrent identical
        requests, in any number of processes, exactly one row is written."""
        created = dt.datetime.now(dt.timezone.utc)
        stamp = _timestamp(created)
        try:
            with self._connection() as conn:
                inserted = conn.execute(
                    "INSERT INTO plans (id, request_sha256, created_at, model, request_json, plan_json, solve_s)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_sha256) DO NOTHING",
                    (plan_id, request_sha256, stamp, model[:256], request_json, plan_json, float(solve_s)),
                ).rowcount
        except sqlite3.IntegrityError as err:
            raise PlanIdConflictError(plan_id, request_sha256, str(err)) from err
        if inserted:
            return StoredPlan(
                plan_id, request_sha256, _parse_timestamp(stamp), request_json, plan_json, float(solve_s), model[:256]
            )
        existing = self.get_by_request(request_sha256)
        if existing is None:  # the row was there a moment ago: only a deleting tool removes rows
            raise RuntimeError(f"the plan of request {request_sha256} vanished from {self.url} while storing it")
        return existing

    def recent(self, *, limit: int = 50, model: str | None = None) -> list[StoredPlan]:
        with self._connection() as conn:
            if model:
                rows = conn.execute(
                    f"SELECT {_PLAN_COLUMNS} FROM plans WHERE model = ? ORDER BY created_at DESC, id LIMIT ?",
                    (model, limit),
                ).fetchall()
            else:
                rows = conn.execute(
                    f"SELECT {_PLAN_COLUMNS} FROM plans ORDER BY created_at DESC, id LIMIT ?", (limit,)
                ).fetchall()
        return [_stored(row) for row in rows]

    def models(self) -> list[str]:
        with self._connection() as conn:
            return [m for (m,) in conn.execute("SELECT DISTINCT model FROM plans ORDER BY model")]

    def count(self) -> int:
        with self._connection() as conn:
            return int(conn.execute("SELECT count(*) FROM plans").fetchone()[0])

    def close(self) -> None:
        """Close the pooled connections (ones in use close when returned); the store still
        works afterwards, on new connections (an in-memory database starts empty then)."""
        with self._lock:
            idle, self._idle = self._idle, []
            shared, self._shared = self._shared, None
            self._generation += 1
        for conn in idle:
            conn.close()
        if shared is not None:
            shared.close()
