"""Against a real ``pipeplan serve`` (uvicorn) process on a loopback port, through the client."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_testlib import ROOT, LiveServer, free_port, variant

from api.client import ServiceError, fetch_plan, remote_plan
from planner.errors import InfeasibleError, InputError
from planner.schema import Cluster, Plan, PlanOptions, Profile, TrainingSetup


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("live")
    s = LiveServer(tmp / "plans.db", tmp / "server.log")
    s.start()
    yield s
    s.stop()


def _parts(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "profile": Profile.model_validate(body["profile"]),
        "cluster": Cluster.model_validate(body["cluster"]),
        "training": TrainingSetup.model_validate(body["training"]),
        "options": PlanOptions.model_validate(body["options"]),
    }


def test_round_trip_through_the_client(server: LiveServer, plan_body: dict[str, Any]) -> None:
    plan_id, plan = remote_plan(server.url, **_parts(plan_body))
    assert isinstance(plan, Plan)
    assert plan.profile_sha256 == Profile.model_validate(plan_body["profile"]).sha256()
    assert fetch_plan(f"{server.url}/v1/plans/{plan_id}") == plan
    assert fetch_plan(f"{server.url}/v1/plans/{plan_id}/") == plan
    again_id, again = remote_plan(server.url + "/", **_parts(plan_body))
    assert (again_id, again) == (plan_id, plan)


def test_client_errors_are_clear(server: LiveServer, plan_body: dict[str, Any]) -> None:
    with pytest.raises(ServiceError, match="not found") as err:
        fetch_plan(f"{server.url}/v1/plans/0000")
    assert err.value.status == 404
    bad = copy.deepcopy(plan_body)
    bad["cluster"] = {"devices": 2, "memory": "1MiB"}
    with pytest.raises(InfeasibleError, match="add devices") as inf:
        remote_plan(server.url, **_parts(bad))
    assert inf.value.details["limit_bytes"] < inf.value.details["memory_bytes"]
    with pytest.raises(InputError, match="not a plan URL"):
        fetch_plan(f"{server.url}/v1/presets")
    with pytest.raises(InputError, match="not a server URL"):
        remote_plan("127.0.0.1:8000", **_parts(plan_body))


def test_unreachable_server_message(plan_body: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServiceError, match=r"cannot reach the planning service at .*: is `pipeplan serve` running\?"):
        remote_plan(url, **_parts(plan_body))
    with pytest.raises(ServiceError, match="cannot reach"):
        fetch_plan(f"{url}/v1/plans/abc")


def test_restart_persistence_and_auth(
    live_server_factory: Callable[..., LiveServer], plan_body: dict[str, Any], tmp_path: Path
) -> None:
    db = tmp_path / "persist.db"
    first = live_server_factory(db=db)
    r = httpx.post(f"{first.url}/v1/plans", json=plan_body, timeout=60)
    assert r.status_code == 201
    plan_id = r.json()["id"]
    first.stop()

    second = live_server_factory(db=db, PIPEPLAN_API_TOKEN="s3cret")
    assert httpx.get(f"{second.url}/healthz").status_code == 200
    assert httpx.get(f"{second.url}/v1/plans/{plan_id}").status_code == 401
    with pytest.raises(ServiceError, match="refused the token.*PIPEPLAN_API_TOKEN") as err:
        fetch_plan(f"{second.url}/v1/plans/{plan_id}", token="wrong")
    assert err.value.status == 401
    with pytest.raises(ServiceError, match="needs a token"):
        fetch_plan(f"{second.url}/v1/plans/{plan_id}")
    got = fetch_plan(f"{second.url}/v1/plans/{plan_id}", token="s3cret")
    assert got == Plan.model_validate(r.json()["plan"])
    again = httpx.post(
        f"{second.url}/v1/plans", json=plan_body, headers={"Authorization": "Bearer s3cret"}, timeout=60
    )
    assert again.status_code == 200 and again.json()["cached"] is True and again.json()["id"] == plan_id


def test_50_concurrent_clients(server: LiveServer, plan_body: dict[str, Any]) -> None:
    """50 clients x 10 requests: cached plans, new solves, fetches and presets, all succeed."""
    bodies = [variant(plan_body, i) for i in range(5)]
    errors: list[str] = []
    codes: list[int] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for j in range(10):
                kind = (i + j) % 4
                if kind == 3:
                    r = c.get("/v1/presets")
                else:
                    r = c.post("/v1/plans", json=bodies[(i * 10 + j) % len(bodies)])
                    if r.status_code in (200, 201):
                        r = c.get(f"/v1/plans/{r.json()['id']}")
                with lock:
                    codes.append(r.status_code)
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(codes) == 500
    assert time.perf_counter() - start < 120


def test_healthz_during_a_long_solve(live_server_factory: Callable[..., LiveServer], plan_body: dict[str, Any]) -> None:
    """A 2.5 s solve that holds the GIL runs in the solver process: /healthz never waits for it
    (each answer well under the solve's 2.5 s; 100 ms on a quiet machine, a loaded 2-core CI
    host has taken 180 ms)."""
    server = live_server_factory(PIPEPLAN_SOLVER="api_fake_solver:busy_solve")
    body = copy.deepcopy(plan_body)
    body["options"] = {"time_limit_s": 2.5}
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(httpx.post(f"{server.url}/v1/plans", json=body, timeout=60).status_code))
    t.start()
    latencies = []
    with httpx.Client(base_url=server.url) as c:
        c.get("/healthz")
        while t.is_alive():
            start = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    t.join()
    assert result == [201]
    assert len(latencies) >= 10, latencies
    assert max(latencies) < 1.0, latencies


def test_structured_access_log(server: LiveServer) -> None:
    httpx.get(f"{server.url}/v1/presets", headers={"X-Request-ID": "req-77"})
    deadline = time.monotonic() + 10
    mine: list[dict[str, Any]] = []
    while not mine and time.monotonic() < deadline:
        lines = [json.loads(x) for x in server.log.read_text().splitlines() if x.startswith("{")]
        mine = [x for x in lines if x["request_id"] == "req-77"]
        time.sleep(0.05)
    assert mine and mine[0]["path"] == "/v1/presets" and mine[0]["status"] == 200
    assert mine[0]["method"] == "GET" and mine[0]["duration_ms"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "error: --port 70000"),
        (["--db", "/nonexistent-dir/x/plans.db"], "error: cannot open the plan database"),
        (["--db", f"postgresql://ann:pw@127.0.0.1:{free_port()}/plans?pool_timeout=0.5"],
         "error: cannot open the plan database: the plan database postgresql://ann:***@127.0.0.1:"),
        (["--db", "postgresql://u@h/db?pool_max=many"], "error: invalid server settings"),  # names pool_max
        (["--db", "mysql://u@h/db"], "error: invalid server settings"),  # SQLite or PostgreSQL only
    ],
)
def test_serve_bad_flags_are_clear(flags: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipeplan", "serve", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    # psycopg's pool logs why each connection attempt failed before the error line
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and errors[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and ":pw@" not in proc.stderr


def test_several_uvicorn_workers_share_the_database(
    live_server_factory: Callable[..., LiveServer], plan_body: dict[str, Any]
) -> None:
    """Two worker processes migrate one fresh database at once, then agree on stored plans."""
    server = live_server_factory("--workers", "2", "--solver-workers", "1")
    ids = set()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for _ in range(6):  # new connections land on either worker
            r = c.post("/v1/plans", json=plan_body, headers={"Connection": "close"})
            assert r.status_code in (200, 201), r.text
            ids.add(r.json()["id"])
            assert c.get(f"/v1/plans/{r.json()['id']}", headers={"Connection": "close"}).status_code == 200
    assert len(ids) == 1
