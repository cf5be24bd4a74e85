"""The SQLite store: schema versions, cache key uniqueness, persistence across instances,
databases of the earlier SQLAlchemy store, URLs, threads and processes."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from api_testlib import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from api.settings import ApiSettings, database_url
from api.store import MIGRATIONS, PlanStore, parse_database_url

# What the SQLAlchemy store (api/store.py up to commit d0a3bcf) created, verbatim from sqlite_master.
OLD_DDL = (
    "CREATE TABLE pipeplan_schema (\n\tversion INTEGER NOT NULL, \n\tapplied_at DATETIME NOT NULL, \n\t"
    "PRIMARY KEY (version)\n)",
    "CREATE TABLE plans (\n\tid VARCHAR(64) NOT NULL, \n\trequest_sha256 VARCHAR(64) NOT NULL, \n\t"
    "created_at DATETIME NOT NULL, \n\tmodel VARCHAR(256) NOT NULL, \n\trequest_json TEXT NOT NULL, \n\t"
    "plan_json TEXT NOT NULL, \n\tsolve_s FLOAT NOT NULL, \n\tPRIMARY KEY (id)\n)",
    "CREATE UNIQUE INDEX ix_plans_request_sha256 ON plans (request_sha256)",
)
OLD_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}$")  # SQLAlchemy's SQLite DATETIME text


def _put(store: PlanStore, n: int, sha: str | None = None) -> str:
    sha = sha or hashlib.sha256(str(n).encode()).hexdigest()
    store.put(sha[:24], sha, model="m", request_json=f'{{"n": {n}}}', plan_json=f'{{"plan": {n}}}', solve_s=0.5)
    return sha


def _old_database(path: Path) -> str:
    """A database as the SQLAlchemy store left it: schema version 1 and one plan."""
    conn = sqlite3.connect(path)
    for ddl in OLD_DDL:
        conn.execute(ddl)
    conn.execute("INSERT INTO pipeplan_schema VALUES (1, '2026-12-02 12:25:09.470524')")
    conn.execute(
        "INSERT INTO plans VALUES (?, ?, ?, ?, ?, ?, ?)",
        ("a" * 24, "a" * 64, "2026-12-02 12:25:09.473996", "m", '{"old": 1}', '{"plan": "old"}', 0.25),
    )
    conn.execute("PRAGMA journal_mode=WAL")
    conn.commit()
    conn.close()
    return database_url(str(path))


def _columns(conn: sqlite3.Connection, table: str) -> list[tuple[object, ...]]:
    return [tuple(r) for r in conn.execute(f"PRAGMA table_info({table})")]


def test_migrate_is_idempotent(tmp_path: Path) -> None:
    store = PlanStore(database_url(str(tmp_path / "p.db")))
    assert store.schema_versions() == []
    assert store.migrate() == len(MIGRATIONS)
    assert store.migrate() == len(MIGRATIONS)
    assert store.schema_versions() == list(range(1, len(MIGRATIONS) + 1))
    conn = sqlite3.connect(tmp_path / "p.db")
    assert [v for (v,) in conn.execute("SELECT version FROM pipeplan_schema")] == list(range(1, len(MIGRATIONS) + 1))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


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
    assert got.request_json == '{"n": 7}' and got.solve_s == 0.5
    assert second.get_by_request(sha) == got
    assert got.created_at.tzinfo is not None
    assert abs((dt.datetime.now(dt.timezone.utc) - got.created_at).total_seconds()) < 60
    assert second.count() == 1


def test_put_returns_what_get_reads(tmp_path: Path) -> None:
    store = PlanStore(database_url(str(tmp_path / "p.db")))
    store.migrate()
    put = store.put("x" * 24, "b" * 64, model="m" * 300, request_json="{}", plan_json="[1]", solve_s=1.25)
    assert store.get("x" * 24) == put
    conn = sqlite3.connect(tmp_path / "p.db")
    model, created = conn.execute("SELECT model, created_at FROM plans").fetchone()
    conn.close()
    assert model == "m" * 256  # truncated to the column's size
    assert OLD_TIMESTAMP.match(created), created  # the text the SQLAlchemy store wrote and reads


def test_duplicate_request_returns_the_stored_row(tmp_path: Path) -> None:
    store = PlanStore(database_url(str(tmp_path / "p.db")))
    store.migrate()
    sha = _put(store, 1)
    again = store.put(sha[:24], sha, model="m", request_json="{}", plan_json='{"other": 1}', solve_s=0.1)
    assert again.plan_json == '{"plan": 1}'
    assert store.count() == 1


def test_same_id_for_another_request_is_an_error(tmp_path: Path) -> None:
    store = PlanStore(database_url(str(tmp_path / "p.db")))
    store.migrate()
    sha = _put(store, 1)
    with pytest.raises(sqlite3.IntegrityError):
        store.put(sha[:24], "c" * 64, model="m", request_json="{}", plan_json="{}", solve_s=0.1)
    assert store.count() == 1


def test_newer_database_is_refused(tmp_path: Path) -> None:
    url = database_url(str(tmp_path / "p.db"))
    PlanStore(url).migrate()
    conn = sqlite3.connect(tmp_path / "p.db")
    conn.execute("INSERT INTO pipeplan_schema VALUES (?, '2030-01-01 00:00:00.000000')", (len(MIGRATIONS) + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match=f"schema version {len(MIGRATIONS) + 1}.*upgrade pipeplan"):
        PlanStore(url).migrate()


def test_database_of_the_sqlalchemy_store_opens(tmp_path: Path) -> None:
    url = _old_database(tmp_path / "old.db")
    store = PlanStore(url)
    assert store.migrate() == len(MIGRATIONS)
    assert store.schema_versions() == list(range(1, len(MIGRATIONS) + 1))
    old = store.get("a" * 24)
    assert old is not None and old.plan_json == '{"plan": "old"}' and old.solve_s == 0.25
    assert old.created_at == dt.datetime(2026, 12, 2, 12, 25, 9, 473996, tzinfo=dt.timezone.utc)
    assert store.get_by_request("a" * 64) == old
    sha = _put(store, 3)
    assert store.get_by_request(sha) is not None and store.count() == 2
    again = store.put("z" * 24, "a" * 64, model="m", request_json="{}", plan_json="{}", solve_s=0.0)
    assert again == old  # the old unique index still keys the cache
    store.close()
    conn = sqlite3.connect(tmp_path / "old.db")
    names = sorted(n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"))
    conn.close()
    assert names == ["ix_plans_request_sha256", "pipeplan_schema", "plans"]


def test_new_schema_matches_the_sqlalchemy_one(tmp_path: Path) -> None:
    """Same tables, columns (name, type, not-null, key) and unique index, so either store reads
    the other's databases."""
    _old_database(tmp_path / "old.db")
    PlanStore(database_url(str(tmp_path / "new.db"))).migrate()
    old, new = sqlite3.connect(tmp_path / "old.db"), sqlite3.connect(tmp_path / "new.db")
    for table in ("pipeplan_schema", "plans"):
        assert _columns(new, table) == _columns(old, table)
    for conn in (old, new):
        assert [tuple(r)[1:3] for r in conn.execute("PRAGMA index_list(plans)") if r[1].startswith("ix_")] == [
            ("ix_plans_request_sha256", 1)
        ]
        conn.close()


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
        assert store.get_by_request(sha) == got
    assert store.get("missing") is None
    assert store.get_by_request("0" * 64) is None


@pytest.mark.parametrize("url_kind", ["file", "memory"])
def test_threads_share_a_store(tmp_path: Path, url_kind: str) -> None:
    """As the app uses it: many pool threads putting and reading at once, some the same request."""
    store = PlanStore(database_url(str(tmp_path / "t.db")) if url_kind == "file" else "sqlite://")
    store.migrate()
    errors: list[BaseException] = []
    same: list[str] = []
    start = threading.Barrier(8)

    def work(t: int) -> None:
        try:
            start.wait()
            for i in range(15):
                sha = _put(store, t * 1000 + i)
                got = store.get(sha[:24])
                assert got is not None and got.plan_json == f'{{"plan": {t * 1000 + i}}}'
            shared = store.put("s" * 24, "s" * 64, model="m", request_json="{}", plan_json=f'"t{t}"', solve_s=0)
            same.append(shared.plan_json)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert store.count() == 8 * 15 + 1
    assert len(same) == 8 and len(set(same)) == 1  # every thread got the one stored row
    store.close()


def test_store_works_after_close(tmp_path: Path) -> None:
    store = PlanStore(database_url(str(tmp_path / "p.db")))
    store.migrate()
    sha = _put(store, 5)
    store.close()
    assert store.get(sha[:24]) is not None
    store.close()


_RACE = """
import sys, time
import api.store as s
def slow_step(conn):
    time.sleep(0.3)
    conn.execute("CREATE TABLE race_step (x INTEGER)")  # not idempotent: fails if run twice
s.MIGRATIONS = s.MIGRATIONS + (slow_step,)
while time.time() < float(sys.argv[2]):
    time.sleep(0.001)
print(s.PlanStore(sys.argv[1]).migrate())
"""


def test_processes_migrate_one_database_at_once(tmp_path: Path) -> None:
    url = database_url(str(tmp_path / "race.db"))
    go = str(time.time() + 2.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACE, url, go], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in results]
    assert [out.strip() for out, _ in results] == [str(len(MIGRATIONS) + 1)] * 4
    conn = sqlite3.connect(tmp_path / "race.db")
    versions = [v for (v,) in conn.execute("SELECT version FROM pipeplan_schema ORDER BY version")]
    conn.close()
    assert versions == list(range(1, len(MIGRATIONS) + 2))


def test_missing_folder_is_an_sqlite_error(tmp_path: Path) -> None:
    store = PlanStore(database_url(str(tmp_path / "no" / "such" / "p.db")))
    start = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        store.migrate()
    assert time.monotonic() - start < 5  # not retried like a busy database


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("plans.db", "sqlite:///plans.db"),
        ("sqlite:////abs/p.db", "sqlite:////abs/p.db"),
        (":memory:", "sqlite://"),
        ("/tmp/a%b?c.db", "sqlite:////tmp/a%25b%3Fc.db"),
    ],
)
def test_database_url(given: str, url: str) -> None:
    assert database_url(given) == url


def test_database_url_keeps_odd_paths(tmp_path: Path) -> None:
    path = tmp_path / "we?ird %41 name.db"
    store = PlanStore(database_url(str(path)))
    store.migrate()
    assert path.exists()
    store.close()


def test_empty_database_url_is_refused() -> None:
    with pytest.raises(ValueError, match="give a path"):
        database_url("  ")


@pytest.mark.parametrize(
    ("url", "database", "memory", "uri", "timeout"),
    [
        ("sqlite://", ":memory:", True, False, 30.0),
        ("sqlite:///:memory:", ":memory:", True, False, 30.0),
        ("sqlite:////abs/p.db", "/abs/p.db", False, False, 30.0),
        ("sqlite+pysqlite:////abs/p.db?timeout=5", "/abs/p.db", False, False, 5.0),
        ("sqlite:////abs/a%20b.db", "/abs/a b.db", False, False, 30.0),
        ("sqlite:///file:/abs/p.db?uri=true&mode=rwc&cache=shared", "file:/abs/p.db?cache=shared&mode=rwc",
         False, True, 30.0),
        ("sqlite:///file:mem1?mode=memory&uri=true", "file:mem1?mode=memory", True, True, 30.0),
    ],
)
def test_parse_database_url(url: str, database: str, memory: bool, uri: bool, timeout: float) -> None:
    target = parse_database_url(url)
    assert (target.database, target.memory, target.uri, target.timeout_s) == (database, memory, uri, timeout)


def test_relative_url_is_resolved_when_the_store_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_database_url("sqlite:///sub/p.db").database == str(tmp_path / "sub" / "p.db")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://user@db/plans", "SQLite only"),
        ("mysql+pymysql://h/p", "SQLite only"),
        ("sqlite://host/p.db", "no host"),
        ("sqlite:///p.db?foo=1", "unknown option"),
        ("sqlite:///p.db?timeout=soon", "not a number"),
        ("sqlite:///p.db?timeout=-1", "between 0"),
        ("sqlite:///p.db?uri=maybe", "not true or false"),
    ],
)
def test_bad_database_urls_are_clear(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_database_url(url)
    assert repr(url) in str(err.value) and "sqlite:///plans.db" in str(err.value)
    with pytest.raises(ValueError, match=message):
        ApiSettings(db=url)


def test_importing_the_app_does_not_import_sqlalchemy(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from api.app import create_app\n"
        "from api.settings import ApiSettings\n"
        f"create_app(ApiSettings(db={str(tmp_path / 'i.db')!r}))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'torch')))\n"
        "print('sqlite3' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True"]
