"""The stores: the same suite against SQLite and a real PostgreSQL (schema versions, cache key
uniqueness, persistence across instances, threads and processes, the newest-first list), then
what is particular to each: databases of the earlier SQLAlchemy store and SQLite URLs;
PostgreSQL URLs, timeouts and the lazy driver import."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from api_testlib import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from api.settings import ApiSettings, database_url
from api.store import PlanIdConflictError, PlanStore, StoreUnavailableError, open_store, url_scheme
from api.store_postgres import MIGRATIONS as PG_MIGRATIONS
from api.store_postgres import PostgresStore, hide_password, parse_postgres_url
from api.store_sqlite import MIGRATIONS, SqliteStore, parse_sqlite_url

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


def _put(store: PlanStore, n: int, sha: str | None = None, *, model: str = "m") -> str:
    sha = sha or hashlib.sha256(str(n).encode()).hexdigest()
    store.put(sha[:24], sha, model=model, request_json=f'{{"n": {n}}}', plan_json=f'{{"plan": {n}}}', solve_s=0.5)
    return sha


def _migrations(url: str) -> int:
    return len(PG_MIGRATIONS) if url_scheme(url).startswith("postgres") else len(MIGRATIONS)


def _execute(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement on the database behind the store (not through it)."""
    if url_scheme(url).startswith("postgres"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            cur = pg.execute(sql.replace("?", "%s"), params)
            return list(cur.fetchall()) if cur.description else []
    conn = sqlite3.connect(parse_sqlite_url(url).database)
    try:
        rows = list(conn.execute(sql, params))
        conn.commit()
        return rows
    finally:
        conn.close()


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


# --------------------------------------------------------------------------- both backends


def test_open_store_picks_the_backend(store_url: str) -> None:
    store = open_store(store_url)
    assert isinstance(store, PostgresStore if store_url.startswith("postgres") else SqliteStore)
    assert isinstance(store, PlanStore)


def test_migrate_is_idempotent(store_url: str) -> None:
    store = open_store(store_url)
    n = _migrations(store_url)
    assert store.schema_versions() == []
    assert store.migrate() == n
    assert store.migrate() == n
    assert store.schema_versions() == list(range(1, n + 1))
    assert [v for (v,) in _execute(store_url, "SELECT version FROM pipeplan_schema ORDER BY version")] == list(
        range(1, n + 1)
    )
    store.close()


def test_survives_a_new_instance(store_url: str) -> None:
    first = open_store(store_url)
    first.migrate()
    sha = _put(first, 7)
    first.close()
    second = open_store(store_url)
    second.migrate()
    got = second.get(sha[:24])
    assert got is not None and got.plan_json == '{"plan": 7}' and got.request_sha256 == sha
    assert got.request_json == '{"n": 7}' and got.solve_s == 0.5 and got.model == "m"
    assert second.get_by_request(sha) == got
    assert got.created_at.tzinfo is not None and got.created_at.utcoffset() == dt.timedelta(0)
    assert abs((dt.datetime.now(dt.timezone.utc) - got.created_at).total_seconds()) < 60
    assert second.count() == 1
    second.close()


def test_put_returns_what_get_reads(store_url: str) -> None:
    store = open_store(store_url)
    store.migrate()
    put = store.put("x" * 24, "b" * 64, model="m" * 300, request_json="{}", plan_json="[1]", solve_s=1.25)
    assert store.get("x" * 24) == put
    assert put.model == "m" * 256  # cut to the column's size
    assert _execute(store_url, "SELECT model FROM plans") == [("m" * 256,)]
    store.close()


def test_json_text_comes_back_byte_for_byte(store_url: str) -> None:
    """The same JSON in and out on both backends: text columns, not a re-serialized document."""
    store = open_store(store_url)
    store.migrate()
    plan = json.dumps({"model": "gpt <b>&'\"", "x": [1.5, 1e-300, "\u00e9\u4e2d\U0001f600"], "nul": "a\u0000b"},
                      ensure_ascii=False)
    request = '{"b": 1,  "a": [ 2 ]}'  # odd spacing and key order are kept
    put = store.put("j" * 24, "j" * 64, model="gpt \u4e2d <b>", request_json=request, plan_json=plan, solve_s=0.0)
    got = store.get("j" * 24)
    assert got == put and got.plan_json == plan and got.request_json == request and got.model == "gpt \u4e2d <b>"
    store.close()


def test_duplicate_request_returns_the_stored_row(store_url: str) -> None:
    store = open_store(store_url)
    store.migrate()
    sha = _put(store, 1)
    again = store.put(sha[:24], sha, model="m", request_json="{}", plan_json='{"other": 1}', solve_s=0.1)
    assert again.plan_json == '{"plan": 1}'
    other_id = store.put("q" * 24, sha, model="m", request_json="{}", plan_json='{"other": 2}', solve_s=0.1)
    assert other_id == again  # the request hash keys the cache, whatever id the caller made up
    assert store.count() == 1
    store.close()


def test_same_id_for_another_request_is_an_error(store_url: str) -> None:
    store = open_store(store_url)
    store.migrate()
    sha = _put(store, 1)
    with pytest.raises(PlanIdConflictError, match=f"{sha[:24]!r}.*derive ids from the request hash"):
        store.put(sha[:24], "c" * 64, model="m", request_json="{}", plan_json="{}", solve_s=0.1)
    assert store.count() == 1
    store.close()


def test_newer_database_is_refused(store_url: str) -> None:
    store = open_store(store_url)
    store.migrate()
    newer = _migrations(store_url) + 1
    _execute(store_url, "INSERT INTO pipeplan_schema VALUES (?, '2030-01-01 00:00:00.000000')", (newer,))
    with pytest.raises(RuntimeError, match=f"schema version {newer}.*upgrade pipeplan"):
        store.migrate()
    store.close()


def test_recent_is_newest_first_and_filters_by_model(store_url: str) -> None:
    store = open_store(store_url)
    store.migrate()
    assert store.recent() == [] and store.models() == []
    shas = []
    for n in range(5):
        shas.append(_put(store, n, model="llama" if n % 2 else "gpt"))
        time.sleep(0.002)  # distinct timestamps
    assert [p.request_sha256 for p in store.recent()] == shas[::-1]
    assert [p.request_sha256 for p in store.recent(limit=2)] == shas[:2:-1][:2]
    assert [p.request_sha256 for p in store.recent(model="llama")] == [shas[3], shas[1]]
    assert store.recent(model="nope") == []
    assert store.models() == ["gpt", "llama"]
    store.close()


@pytest.mark.parametrize("url_kind", ["file", "memory", "postgresql"])
def test_threads_share_a_store(tmp_path: Path, url_kind: str, request: pytest.FixtureRequest) -> None:
    """As the app uses it: many pool threads putting and reading at once, some the same request."""
    if url_kind == "postgresql":
        url = request.getfixturevalue("postgres_url")
    else:
        url = database_url(str(tmp_path / "t.db")) if url_kind == "file" else "sqlite://"
    store = open_store(url)
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


def test_store_works_after_close(store_url: str) -> None:
    store = open_store(store_url)
    store.migrate()
    sha = _put(store, 5)
    store.close()
    assert store.get(sha[:24]) is not None
    store.close()


_RACE = """
import sys, time
from api.store import open_store, url_scheme
import api.store_postgres, api.store_sqlite
backend = api.store_postgres if url_scheme(sys.argv[1]).startswith("postgres") else api.store_sqlite
def slow_step(conn):
    time.sleep(0.3)
    conn.execute("CREATE TABLE race_step (x INTEGER)")  # not idempotent: fails if run twice
backend.MIGRATIONS = backend.MIGRATIONS + (slow_step,)
store = open_store(sys.argv[1])
while time.time() < float(sys.argv[2]):
    time.sleep(0.001)
print(store.migrate())
store.close()
"""


def test_processes_migrate_one_database_at_once(store_url: str) -> None:
    """Replicas starting together: the steps run once (an advisory lock on PostgreSQL, one
    ``BEGIN IMMEDIATE`` writer on SQLite), and every process sees the new version."""
    n = _migrations(store_url)
    go = str(time.time() + 2.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACE, store_url, go], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in results]
    assert [out.strip() for out, _ in results] == [str(n + 1)] * 4
    versions = [v for (v,) in _execute(store_url, "SELECT version FROM pipeplan_schema ORDER BY version")]
    assert versions == list(range(1, n + 2))


# --------------------------------------------------------------------------- SQLite


def test_sqlite_is_in_wal_mode(tmp_path: Path) -> None:
    SqliteStore(database_url(str(tmp_path / "p.db"))).migrate()
    conn = sqlite3.connect(tmp_path / "p.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_sqlite_timestamps_are_the_sqlalchemy_text(tmp_path: Path) -> None:
    store = SqliteStore(database_url(str(tmp_path / "p.db")))
    store.migrate()
    _put(store, 1)
    conn = sqlite3.connect(tmp_path / "p.db")
    (created,) = conn.execute("SELECT created_at FROM plans").fetchone()
    conn.close()
    assert OLD_TIMESTAMP.match(created), created  # the text the SQLAlchemy store wrote and reads


def test_database_of_the_sqlalchemy_store_opens(tmp_path: Path) -> None:
    url = _old_database(tmp_path / "old.db")
    store = SqliteStore(url)
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
    SqliteStore(database_url(str(tmp_path / "new.db"))).migrate()
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
    store = SqliteStore("sqlite://")
    store.migrate()
    shas = {v: _put(store, v) for v in values}
    assert store.count() == len(set(values))
    for v, sha in shas.items():
        got = store.get(sha[:24])
        assert got is not None and got.plan_json == f'{{"plan": {v}}}'
        assert store.get_by_request(sha) == got
    assert store.get("missing") is None
    assert store.get_by_request("0" * 64) is None


def test_missing_folder_is_an_sqlite_error(tmp_path: Path) -> None:
    store = SqliteStore(database_url(str(tmp_path / "no" / "such" / "p.db")))
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
    store = SqliteStore(database_url(str(path)))
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
    target = parse_sqlite_url(url)
    assert (target.database, target.memory, target.uri, target.timeout_s) == (database, memory, uri, timeout)


def test_relative_url_is_resolved_when_the_store_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_sqlite_url("sqlite:///sub/p.db").database == str(tmp_path / "sub" / "p.db")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql+pymysql://h/p", "SQLite or PostgreSQL only"),
        ("sqlite://host/p.db", "no host"),
        ("sqlite:///p.db?foo=1", "unknown option"),
        ("sqlite:///p.db?timeout=soon", "not a number"),
        ("sqlite:///p.db?timeout=-1", "between 0"),
        ("sqlite:///p.db?uri=maybe", "not true or false"),
    ],
)
def test_bad_database_urls_are_clear(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_sqlite_url(url)
    assert repr(url) in str(err.value) and "sqlite:///plans.db" in str(err.value)
    assert "postgresql://user@host/db" in str(err.value)
    with pytest.raises(ValueError, match=message):
        ApiSettings(db=url)


def test_importing_the_app_does_not_import_sqlalchemy_nor_psycopg(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from api.app import create_app\n"
        "from api.settings import ApiSettings\n"
        f"create_app(ApiSettings(db={str(tmp_path / 'i.db')!r}))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'torch', 'psycopg', 'psycopg_pool')))\n"
        "print('sqlite3' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True"]


# --------------------------------------------------------------------------- PostgreSQL


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://u@h:99999/db", "Port out of range"),
        ("postgresql://u@h/db/extra", "not a database name"),
        ("postgresql://u@h/db?pool_max=lots", "pool_max='lots' is not a number"),
        ("postgresql://u@h/db?pool_timeout=0", "between"),
        ("postgresql://u@h/db?pool_min=5&pool_max=2", "above pool_max"),
    ],
)
def test_bad_postgres_urls_are_clear(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_postgres_url(url)
    assert "postgresql://user@host:5432/db" in str(err.value)
    with pytest.raises(ValueError, match=message):
        ApiSettings(db=url)


def test_postgres_url_options_and_hidden_password() -> None:
    target = parse_postgres_url("postgres://ann:s3cret@db.example:6432/plans?pool_max=4&sslmode=require")
    assert target.pool_max == 4 and target.pool_timeout_s == 3.0
    assert target.conninfo.startswith("postgresql://ann:s3cret@db.example:6432/plans?")
    assert "sslmode=require" in target.conninfo and "pool_max" not in target.conninfo
    assert "connect_timeout=3" in target.conninfo
    assert "s3cret" not in target.display and "ann:***@db.example:6432" in target.display
    assert hide_password("postgresql://u@h/db") == "postgresql://u@h/db"
    assert ApiSettings(db="postgresql://u@h/db").db == "postgresql://u@h/db"


def test_postgres_down_is_unavailable_quickly() -> None:
    """No server on the port: a clear StoreUnavailableError after the pool timeout, no hang."""
    from api_testlib import free_port

    store = open_store(f"postgresql://postgres:pw@127.0.0.1:{free_port()}/none?pool_timeout=0.5")
    with pytest.raises(StoreUnavailableError, match="unavailable.*check that PostgreSQL is running") as err:
        store.get("x")
    assert "pw" not in str(err.value)
    store.close()


def test_missing_driver_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['psycopg'] = sys.modules['psycopg_pool'] = None  # as if not installed\n"
        "from api.store import open_store\n"
        "store = open_store('postgresql://u@127.0.0.1:1/db')\n"
        "try:\n"
        "    store.migrate()\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "is PostgreSQL" in proc.stdout and "pip install -e '.[postgres]'" in proc.stdout
