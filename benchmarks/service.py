"""Benchmark of the planning service: ``POST /v1/plans`` latency and throughput.

Starts ``pipeplan serve`` (uvicorn, the real solver, a fresh SQLite file) on a free loopback
port and measures, for a 128-layer GPT profile (``profiler.synth.synth_transformer``) on
8 x h100-80g:

* uncached latency (p50/p99): distinct requests, each solved, against the same solve called
  in-process (``planner.solver.solve``) -- the ratio is the service's overhead;
* cached latency (p50/p99): an identical request, answered from the store, against
  ``GET /healthz`` (the HTTP + framework floor);
* cached throughput at 1, 8 and 32 concurrent clients, against 1 client.

Run from the repository root::

    python benchmarks/service.py            # about a minute on 2 cores
    python benchmarks/service.py --quick    # fewer samples
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.schema import Cluster, PlanOptions, Profile, TrainingSetup  # noqa: E402
from profiler.synth import synth_transformer  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def make_profile() -> Profile:
    # 126 blocks + embedding + LM head = 128 layers (a ~25B-parameter GPT)
    return synth_transformer(layers=126, hidden=4096, heads=32, seq=2048, vocab=50257, device_type="h100-80g")


def body(profile: Profile, i: int, time_limit_s: float) -> dict[str, Any]:
    """Request ``i``: the same model and cluster; the metadata makes it a distinct request."""
    return {
        "profile": profile.model_copy(update={"metadata": {"bench_request": i}}).model_dump(mode="json"),
        "cluster": {"devices": 8, "device_type": "h100-80g"},
        "training": {"global_batch_size": 64},
        "options": {"time_limit_s": time_limit_s},
    }


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def throughput(url: str, payload: bytes, clients: int, per_client: int) -> tuple[float, list[float]]:
    latencies: list[float] = []
    failures: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def run() -> None:
        with httpx.Client(base_url=url, timeout=60, headers={"content-type": "application/json"}) as c:
            c.get("/healthz")
            barrier.wait()
            for _ in range(per_client):
                ms = timed(lambda: failures.append(0) if c.post("/v1/plans", content=payload).status_code == 200 else failures.append(1))
                with lock:
                    latencies.append(ms)

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if any(failures):
        raise RuntimeError(f"{sum(failures)} of {len(failures)} cached requests failed")
    return clients * per_client / elapsed, latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--time-limit", type=float, default=2.0, help="solver time limit per request (s)")
    args = parser.parse_args()
    n_uncached = 3 if args.quick else 6
    n_cached = 100 if args.quick else 300
    per_client = 10 if args.quick else 25

    profile = make_profile()
    from planner.solver import solve

    def direct_solve(i: int) -> float:
        b = body(profile, -2 - i, args.time_limit)
        parts = (
            Profile.model_validate(b["profile"]),
            Cluster.model_validate(b["cluster"]),
            TrainingSetup.model_validate(b["training"]),
            PlanOptions.model_validate(b["options"]),
        )
        return timed(lambda: solve(*parts))

    direct_solve(-1)  # warms OR-Tools up, like the server's warm-up solve below
    direct: list[float] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        env.pop("PIPEPLAN_API_TOKEN", None)
        log = open(Path(tmp) / "server.log", "wb")
        server = subprocess.Popen(
            [sys.executable, "-m", "pipeplan", "serve", "--port", str(port), "--db", f"{tmp}/plans.db",
             "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not start:\n" + (Path(tmp) / "server.log").read_text())
                time.sleep(0.1)
            with httpx.Client(base_url=url, timeout=300) as c:
                # warm the solver worker (first solve imports OR-Tools in the worker process)
                assert c.post("/v1/plans", json=body(profile, 10_000, args.time_limit)).status_code == 201
                uncached = []
                for i in range(n_uncached):  # interleaved, so both see the same machine load
                    b = body(profile, i, args.time_limit)
                    uncached.append(timed(lambda b=b: _expect(c.post("/v1/plans", json=b), 201)))
                    direct.append(direct_solve(i))
                cached_payload = httpx.Request("POST", url, json=body(profile, 0, args.time_limit)).read()
                headers = {"content-type": "application/json"}
                health = [timed(lambda: _expect(c.get("/healthz"), 200)) for _ in range(n_cached)]
                cached = [
                    timed(lambda: _expect(c.post("/v1/plans", content=cached_payload, headers=headers), 200))
                    for _ in range(n_cached)
                ]
            rates = {n: throughput(url, cached_payload, n, per_client) for n in (1, 8, 32)}
        finally:
            server.terminate()
            server.wait(timeout=30)
            log.close()

    rows = [
        ("POST /v1/plans uncached", uncached, "solve() in-process", direct),
        ("POST /v1/plans cached", cached, "GET /healthz", health),
    ]
    print(f"128-layer GPT ({len(cached_payload) / 1e3:.0f} kB request) on 8 x h100-80g, "
          f"solver time limit {args.time_limit:g} s, {os.cpu_count()} CPUs\n")
    print(f"{'measure':<26} {'n':>4} {'p50 ms':>9} {'p99 ms':>9}   {'baseline':<20} {'p50 ms':>9} {'p99 ms':>9} {'ratio p50':>9}")
    for name, values, base_name, base in rows:
        print(
            f"{name:<26} {len(values):>4} {percentile(values, 0.5):>9.1f} {percentile(values, 0.99):>9.1f}   "
            f"{base_name:<20} {percentile(base, 0.5):>9.1f} {percentile(base, 0.99):>9.1f} "
            f"{percentile(values, 0.5) / percentile(base, 0.5):>9.2f}"
        )
    print()
    print(f"{'cached throughput':<26} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'vs 1 client':>12}")
    one = rates[1][0]
    for n, (rate, lat) in rates.items():
        print(f"{f'{n} concurrent clients':<26} {rate:>9.0f} {percentile(lat, 0.5):>9.1f} {percentile(lat, 0.99):>9.1f} {rate / one:>12.2f}")
    print(f"\n(uncached medians: service {statistics.median(uncached):.0f} ms vs direct {statistics.median(direct):.0f} ms)")
    return 0


def _expect(response: httpx.Response, status: int) -> None:
    if response.status_code != status:
        raise RuntimeError(f"expected {status}, got {response.status_code}: {response.text[:300]}")


if __name__ == "__main__":
    sys.exit(main())
