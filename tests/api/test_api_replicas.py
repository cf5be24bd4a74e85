"""Two ``pipeplan serve`` replicas on one PostgreSQL (started by the tests, on loopback): a plan
stored by one is served by the other, 50 clients over both get no error, concurrent identical
requests store one plan, a replica SIGKILLed mid-write loses no acknowledged plan, and a
PostgreSQL restart is survived (503 with the reason during the outage, none hangs)."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_testlib import LiveServer, variant
from pg_testlib import PostgresServer

from api.store import open_store

pytestmark = pytest.mark.slow

#: no request may take longer than this (a hang fails the test instead of stalling it)
NO_HANG_S = 30.0
#: how soon after PostgreSQL is back a replica serves again (its pool reconnects with back-off)
RECONNECT_S = 30.0


@pytest.fixture()
def replicas(
    tmp_path: Path, postgres_url: str
) -> Iterator[Callable[..., tuple[LiveServer, LiveServer]]]:
    """``replicas(**env)``: two servers on one new database; both stop at teardown."""
    started: list[LiveServer] = []

    def start(**env: str) -> tuple[LiveServer, LiveServer]:
        # a short pool timeout: requests during a database outage answer 503 within about 1 s
        url = f"{postgres_url}?pool_timeout=1"
        pair = []
        for i in range(2):
            server = LiveServer(url, tmp_path / f"replica{i}.log", **env)
            started.append(server)
            pair.append(server)
        threads = [threading.Thread(target=s.start) for s in pair]  # both migrate at once
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in pair:
            if not s.port or s.proc is None:
                raise RuntimeError(f"a replica did not start: {s.log.read_text()}")
        return pair[0], pair[1]

    yield start
    for server in started:
        server.stop()


def _rows(url: str) -> int:
    store = open_store(url)
    try:
        return store.count()
    finally:
        store.close()


def test_a_plan_stored_by_one_replica_is_served_by_the_other(
    replicas: Callable[..., tuple[LiveServer, LiveServer]], plan_body: dict[str, Any], postgres_url: str
) -> None:
    a, b = replicas()
    with httpx.Client(timeout=NO_HANG_S) as c:
        created = c.post(f"{a.url}/v1/plans", json=plan_body)
        assert created.status_code == 201, created.text
        plan_id = created.json()["id"]
        served = c.get(f"{b.url}/v1/plans/{plan_id}")
        assert served.status_code == 200
        assert served.json()["plan"] == created.json()["plan"]
        assert served.json()["created_at"] == created.json()["created_at"]
        again = c.post(f"{b.url}/v1/plans", json=plan_body)  # the other replica's cache is the database
        assert again.status_code == 200 and again.json()["cached"] and again.json()["id"] == plan_id
        page = c.get(f"{b.url}/plans/{plan_id}")
        assert page.status_code == 200 and plan_id in page.text
    assert _rows(postgres_url) == 1


def test_50_clients_over_both_replicas(
    replicas: Callable[..., tuple[LiveServer, LiveServer]], plan_body: dict[str, Any], postgres_url: str
) -> None:
    """50 clients x 10 plans (50 distinct requests), each posted to one replica and read back
    from the other: no error, and one row per distinct request."""
    a, b = replicas()
    bodies = [variant(plan_body, i) for i in range(50)]
    errors: list[str] = []
    done: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        with httpx.Client(timeout=NO_HANG_S) as c:
            for j in range(10):
                first, second = (a, b) if (i + j) % 2 else (b, a)
                r = c.post(f"{first.url}/v1/plans", json=bodies[(i * 7 + j) % len(bodies)])
                if r.status_code in (200, 201):
                    r = c.get(f"{second.url}/v1/plans/{r.json()['id']}")
                with lock:
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    else:
                        done.append(r.json()["id"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(done) == 500
    assert _rows(postgres_url) == len(set(done)) == 50


def test_16_identical_requests_store_one_plan(
    replicas: Callable[..., tuple[LiveServer, LiveServer]], plan_body: dict[str, Any], postgres_url: str
) -> None:
    """Both replicas solve the same request at once (a slow solver), both insert: one row, and
    every client gets that row."""
    a, b = replicas(PIPEPLAN_SOLVER="api_fake_solver:slow_solve")
    body = dict(plan_body, options={"time_limit_s": 0.5})
    start = threading.Barrier(16)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def post(i: int) -> None:
        server = a if i % 2 else b
        with httpx.Client(timeout=NO_HANG_S) as c:
            start.wait()
            r = c.post(f"{server.url}/v1/plans", json=body)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in results)[-1] <= 201, [r.text for r in results]
    assert len({r.json()["id"] for r in results}) == 1
    assert len({json.dumps(r.json()["plan"], sort_keys=True) for r in results}) == 1
    assert len({r.json()["created_at"] for r in results}) == 1  # all of them the stored row
    assert _rows(postgres_url) == 1


def test_sigkill_of_a_replica_mid_write_loses_no_acknowledged_plan(
    replicas: Callable[..., tuple[LiveServer, LiveServer]], plan_body: dict[str, Any], postgres_url: str
) -> None:
    a, b = replicas()
    acknowledged: dict[str, dict[str, Any]] = {}
    stop = threading.Event()
    lock = threading.Lock()

    def writer(w: int) -> None:
        i = 0
        with httpx.Client(timeout=NO_HANG_S) as c:
            while not stop.is_set():
                body = variant(plan_body, 1000 * w + i)
                i += 1
                try:
                    r = c.post(f"{a.url}/v1/plans", json=body)
                except httpx.HTTPError:
                    continue  # not acknowledged: the replica died under it
                if r.status_code == 201:
                    with lock:
                        acknowledged[r.json()["id"]] = r.json()["plan"]

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120  # a guard against a hang, not a performance check
    while True:  # kill once some plans are in and writes are in flight
        with lock:
            if len(acknowledged) >= 8:
                break
        if time.monotonic() > deadline:
            stop.set()
            pytest.fail(f"only {len(acknowledged)} plans acknowledged in 120 s:\n{a.log.read_text()[-2000:]}")
        time.sleep(0.01)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(timeout=NO_HANG_S)
    stop.set()
    for t in threads:
        t.join()
    with httpx.Client(base_url=b.url, timeout=NO_HANG_S) as c:
        for plan_id, plan in acknowledged.items():
            r = c.get(f"/v1/plans/{plan_id}")
            assert r.status_code == 200, plan_id
            assert r.json()["plan"] == plan
        assert c.post("/v1/plans", json=variant(plan_body, 99_999)).status_code == 201  # B still writes
    assert _rows(postgres_url) >= len(acknowledged) + 1
    store = open_store(postgres_url)
    try:  # every stored row is whole: its plan parses, its id is its request hash's prefix
        for stored in store.recent(limit=10_000):
            assert json.loads(stored.plan_json)["model"] and stored.request_sha256.startswith(stored.id)
    finally:
        store.close()


def test_a_postgres_restart_is_survived(
    replicas: Callable[..., tuple[LiveServer, LiveServer]],
    plan_body: dict[str, Any],
    postgres_server: PostgresServer,
) -> None:
    a, b = replicas()
    with httpx.Client(timeout=NO_HANG_S) as c:
        before = c.post(f"{a.url}/v1/plans", json=plan_body)
        assert before.status_code == 201
        plan_id = before.json()["id"]
        postgres_server.stop()
        try:
            for server in (a, b):
                for r in (
                    c.get(f"{server.url}/v1/plans/{plan_id}"),
                    c.post(f"{server.url}/v1/plans", json=variant(plan_body, 5)),
                    c.get(f"{server.url}/plans"),
                ):
                    assert r.status_code == 503, r.text
                    assert r.headers["retry-after"] == "5"
                    assert "plan database" in r.json()["message"] and "unavailable" in r.json()["message"]
                assert c.get(f"{server.url}/healthz").status_code == 200  # the process itself is fine
        finally:
            postgres_server.start()
        for server in (a, b):  # the pools reconnect: within seconds of the restart, requests succeed
            # (each answer in the meantime a quick 503 with Retry-After, as a client retries; a
            # pool backs off between reconnection attempts, so the very first request may be early)
            deadline = time.monotonic() + RECONNECT_S
            while True:
                r = c.get(f"{server.url}/v1/plans/{plan_id}")
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
                time.sleep(0.5)
            assert r.status_code == 200, r.text
        after = c.post(f"{b.url}/v1/plans", json=variant(plan_body, 6))
        assert after.status_code == 201, after.text
        assert c.get(f"{a.url}/v1/plans/{after.json()['id']}").status_code == 200
