"""Fixtures for the service tests: apps on a temporary database, live uvicorn servers, a
PostgreSQL server of their own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from api_testlib import LiveServer
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pg_testlib import PostgresServer, find_postgres

from api.app import create_app
from api.settings import ApiSettings
from api.solving import SolveFn, SolverPool


@pytest.fixture()
def plan_body(tiny_profile_dict: dict[str, Any]) -> dict[str, Any]:
    """A cheap request: the 8-layer example profile on 4 x 16 GiB devices."""
    return {
        "profile": tiny_profile_dict,
        "cluster": {"devices": 4, "memory": "16GiB"},
        "training": {"global_batch_size": 8},
        "options": {"time_limit_s": 1.0},
    }


@pytest.fixture()
def make_app(tmp_path: Path) -> Callable[..., FastAPI]:
    """``make_app(solver, workers=2, mode="thread", **settings)``: an app on a temporary database.

    ``mode="process"`` needs the solver as ``"api_fake_solver:<name>"``."""

    def build(
        solver: SolveFn | str | None = None,
        *,
        workers: int = 2,
        max_pending: int = 64,
        mode: str = "thread",
        **settings: Any,
    ) -> FastAPI:
        import api_fake_solver

        settings.setdefault("db", str(tmp_path / "plans.db"))
        settings.setdefault("solver_mode", "process" if mode == "process" else "thread")  # the reading pool's too
        s = ApiSettings(**settings)
        pool = SolverPool(
            workers=workers,
            mode="process" if mode == "process" else "thread",
            max_pending=max_pending,
            solver=solver or api_fake_solver.solve,
            grace_s=s.solve_grace_s,
        )
        return create_app(s, solver=pool)

    return build


@pytest.fixture()
def client(make_app: Callable[..., FastAPI]) -> Iterator[TestClient]:
    with TestClient(make_app()) as c:
        yield c


@pytest.fixture()
def live_server_factory(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """``live_server_factory(*serve_flags, db=, **env)`` starts a server; all stop at teardown."""
    servers: list[LiveServer] = []

    def start(*args: str, db: Path | None = None, **env: str) -> LiveServer:
        server = LiveServer(db or tmp_path / "live.db", tmp_path / f"server{len(servers)}.log", *args, **env)
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture()
def live_server(live_server_factory: Callable[..., LiveServer]) -> LiveServer:
    return live_server_factory()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server on loopback for this test process (skips where none is installed)."""
    bindir, why = find_postgres()
    if bindir is None:
        pytest.skip(why)
    server = PostgresServer(bindir)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture()
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a new, empty database on :func:`postgres_server`."""
    return postgres_server.new_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database of each backend: the store tests run against both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'plans.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url
