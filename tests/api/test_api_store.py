"""The SQLite store: schema versions, cache key uniqueness, persistence across instances."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

from api.settings import database_url
from api.store import MIGRATIONS, PlanStore, SchemaVersion


def _put(store: PlanStore, n: int, sha: str | None = None) -> str:
    sha = sha or hashlib.sha256(str(n).encode()).hexdigest()
    store.put(sha[:24], sha, model="m", request_json=f'{{"n": {n}}}', plan_json=f'{{"plan": {n}}}', solve_s=0.5)
    return sha


def test_migrate_is_idempotent(tmp_path: Path) -> None:
    store = PlanStore(database_url(str(tmp_path / "p.db")))
    assert store.migrate() == len(MIGRATIONS)
    assert store.migrate() == len(MIGRATIONS)
    with Session(store.engine) as s:
        assert [v.version for v in s.query(SchemaVersion).all()] == list(range(1, len(MIGRATIONS) + 1))


def test_survives_a_new_instance(tmp_path: Path) -> None:
    url = database_url(str(tmp_path / "p.db"))
    first = PlanStore(url)
    first.migrate()
    sha = _put(first, 7)
    first.close()
    second = PlanStore(url)
    second.migrate()
    got = second.get(sha[:24])
    assert got is not None and got.plan_json == '{"plan": 7}' and got.request_sha256 == sha
    assert second.get_by_request(sha) == got
    assert got.created_at.tzinfo is not None
    assert second.count() == 1


def test_duplicate_request_returns_the_stored_row(tmp_path: Path) -> None:
    store = PlanStore(database_url(str(tmp_path / "p.db")))
    store.migrate()
    sha = _put(store, 1)
    again = store.put(sha[:24], sha, model="m", request_json="{}", plan_json='{"other": 1}', solve_s=0.1)
    assert again.plan_json == '{"plan": 1}'
    assert store.count() == 1


def test_newer_database_is_refused(tmp_path: Path) -> None:
    url = database_url(str(tmp_path / "p.db"))
    store = PlanStore(url)
    store.migrate()
    import datetime as dt

    with Session(store.engine) as s, s.begin():
        s.add(SchemaVersion(version=len(MIGRATIONS) + 1, applied_at=dt.datetime.now(dt.timezone.utc)))
    with pytest.raises(RuntimeError, match="upgrade pipeplan"):
        PlanStore(url).migrate()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=8))
def test_get_returns_what_was_put(values: list[int]) -> None:
    store = PlanStore("sqlite://")
    store.migrate()
    shas = {v: _put(store, v) for v in values}
    assert store.count() == len(set(values))
    for v, sha in shas.items():
        got = store.get(sha[:24])
        assert got is not None and got.plan_json == f'{{"plan": {v}}}'
    assert store.get("missing") is None


@pytest.mark.parametrize(
    ("given", "url"),
    [("plans.db", "sqlite:///plans.db"), ("sqlite:////abs/p.db", "sqlite:////abs/p.db"), (":memory:", "sqlite://")],
)
def test_database_url(given: str, url: str) -> None:
    assert database_url(given) == url


def test_empty_database_url_is_refused() -> None:
    with pytest.raises(ValueError, match="give a path"):
        database_url("  ")
