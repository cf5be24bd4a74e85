"""Stored plans: SQLAlchemy 2 over SQLite (or any SQLAlchemy URL).

One row per distinct request: the canonical request JSON, its SHA-256 (the cache key,
unique), and the plan JSON.  The schema is versioned in ``pipeplan_schema``; on start
:meth:`PlanStore.migrate` applies the steps the database has not seen yet.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    DateTime,
    Engine,
    Float,
    Integer,
    String,
    Text,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import StaticPool


class Base(DeclarativeBase):
    pass


class SchemaVersion(Base):
    __tablename__ = "pipeplan_schema"

    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    applied_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class PlanRow(Base):
    __tablename__ = "plans"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    request_sha256: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    model: Mapped[str] = mapped_column(String(256))
    request_json: Mapped[str] = mapped_column(Text)
    plan_json: Mapped[str] = mapped_column(Text)
    solve_s: Mapped[float] = mapped_column(Float, default=0.0)


@dataclass(frozen=True)
class StoredPlan:
    id: str
    request_sha256: str
    created_at: dt.datetime
    request_json: str
    plan_json: str
    solve_s: float


def _stored(row: PlanRow) -> StoredPlan:
    created = row.created_at
    if created.tzinfo is None:  # SQLite drops the zone; everything is written in UTC
        created = created.replace(tzinfo=dt.timezone.utc)
    return StoredPlan(row.id, row.request_sha256, created, row.request_json, row.plan_json, row.solve_s)


def _create_v1(engine: Engine) -> None:
    PlanRow.__table__.create(engine, checkfirst=True)  # type: ignore[attr-defined]


#: ordered schema steps; step i brings the database to version i + 1.  Append, never edit.
MIGRATIONS: tuple[Callable[[Engine], None], ...] = (_create_v1,)


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL, a busy timeout and thread sharing."""
    kwargs: dict[str, Any] = {}
    is_sqlite = url.startswith("sqlite")
    if is_sqlite:
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        if url in ("sqlite://", "sqlite:///:memory:"):
            kwargs["poolclass"] = StaticPool
    engine = create_engine(url, **kwargs)
    if is_sqlite:

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

    return engine


class PlanStore:
    """Plans by id and by request hash.  Thread-safe (a session per call)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)

    def migrate(self) -> int:
        """Create or upgrade the schema; return the version now in the database.

        Safe when several server processes start on one database at once: every step is
        idempotent, and a step that loses a race is retried after re-reading the version.
        """
        for attempt in range(10):
            try:
                return self._migrate_once()
            except (OperationalError, IntegrityError):
                if attempt == 9:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _migrate_once(self) -> int:
        SchemaVersion.__table__.create(self.engine, checkfirst=True)  # type: ignore[attr-defined]
        with Session(self.engine) as session:
            current = session.scalar(select(func.max(SchemaVersion.version))) or 0
        if current > len(MIGRATIONS):
            raise RuntimeError(
                f"the database {self.url} has schema version {current} but this pipeplan knows up to "
                f"{len(MIGRATIONS)}: upgrade pipeplan or point PIPEPLAN_DB at another database"
            )
        for version in range(current + 1, len(MIGRATIONS) + 1):
            MIGRATIONS[version - 1](self.engine)
            with Session(self.engine) as session, session.begin():
                session.add(SchemaVersion(version=version, applied_at=dt.datetime.now(dt.timezone.utc)))
        return len(MIGRATIONS)

    def get(self, plan_id: str) -> StoredPlan | None:
        with Session(self.engine) as session:
            row = session.get(PlanRow, plan_id)
            return _stored(row) if row is not None else None

    def get_by_request(self, request_sha256: str) -> StoredPlan | None:
        with Session(self.engine) as session:
            row = session.scalar(select(PlanRow).where(PlanRow.request_sha256 == request_sha256))
            return _stored(row) if row is not None else None

    def put(
        self, plan_id: str, request_sha256: str, *, model: str, request_json: str, plan_json: str, solve_s: float
    ) -> StoredPlan:
        """Store a plan; when the request is already stored (a race), return the stored one."""
        row = PlanRow(
            id=plan_id,
            request_sha256=request_sha256,
            created_at=dt.datetime.now(dt.timezone.utc),
            model=model[:256],
            request_json=request_json,
            plan_json=plan_json,
            solve_s=solve_s,
        )
        try:
            with Session(self.engine) as session, session.begin():
                session.add(row)
        except IntegrityError:
            existing = self.get_by_request(request_sha256)
            if existing is None:
                raise
            return existing
        stored = self.get(plan_id)
        assert stored is not None
        return stored

    def count(self) -> int:
        with Session(self.engine) as session:
            return int(session.scalar(select(func.count()).select_from(PlanRow)) or 0)

    def close(self) -> None:
        self.engine.dispose()
