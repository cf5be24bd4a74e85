"""Benchmark of the planning service: latency, throughput, load, durability and hostile input.

Starts ``pipeplan serve`` (uvicorn, the real solver, a fresh SQLite file) on free loopback
ports only, and measures:

* ``latency``: for a 128-layer GPT profile (``profiler.synth.synth_transformer``) on
  8 x h100-80g, uncached latency (p50/p99) of distinct requests against the same solve called
  in-process (the ratio is the service's overhead); cached latency against ``GET /healthz``
  (the HTTP + framework floor); cached throughput at 1, 8 and 32 concurrent clients;
* ``load``: 50 concurrent clients x 10 distinct plans each (the 8-layer example profile,
  each one solved): p50/p99 latency and errors (goal: 0), against one client alone;
* ``durability``: clients keep posting distinct plans while the server is SIGKILLed, three
  times; after each restart every plan that got a 201 must still be served, identical, and
  the database must pass ``PRAGMA integrity_check`` (goal: 0 plans lost);
* ``backends``: the load above (50 clients x 10 distinct plans, each solved) on SQLite, on
  PostgreSQL (a throw-away server started here on loopback, as the tests start it), and on
  two replicas sharing that PostgreSQL (clients alternate between them): plans/s and p99;
* ``pages``: ``GET /plans/{id}`` (the HTML page) for a 1,024-layer plan on 8 stages (goal:
  < 300 ms), the list, and the page's charts (first draw, then kept), timed on loopback;
* ``hostile``: rejection latency of hostile bodies (a 10^9-device cluster, NaN, a global
  batch of 10^18, a 16 MiB body of 75,000 layers, 100,000-deep nesting) and ``/healthz``
  latency, probed from another process, while they are handled, against an idle server.

Run from the repository root::

    python benchmarks/service.py                     # all of it, a few minutes on 2 cores
    python benchmarks/service.py --quick             # fewer samples
    python benchmarks/service.py --only load,hostile # some sections
    python benchmarks/service.py --only backends,pages --quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
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


class Server:
    """``pipeplan serve`` on a free loopback port, on ``db``; :meth:`kill` is a SIGKILL."""

    def __init__(self, db: Path | str, log: Path, **env: str) -> None:
        self.db, self.log, self.env = db, log, env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        env.update(self.env)
        env.pop("PIPEPLAN_API_TOKEN", None)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeplan", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 "--db", str(self.db), "--log-level", "warning"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the server did not start:\n" + self.log.read_text())
            time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def latency_section(args: argparse.Namespace, tmp: Path) -> None:
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
    with Server(tmp / "latency.db", tmp / "latency.log") as server:
        url = server.url
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

    rows = [
        ("POST /v1/plans uncached", uncached, "solve() in-process", direct),
        ("POST /v1/plans cached", cached, "GET /healthz", health),
    ]
    print(f"== latency: 128-layer GPT ({len(cached_payload) / 1e3:.0f} kB request) on 8 x h100-80g, "
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
    print(f"\n(uncached medians: service {statistics.median(uncached):.0f} ms vs direct {statistics.median(direct):.0f} ms)\n")


# --------------------------------------------------------------------------- load


def tiny_body(tag: str, time_limit_s: float) -> dict[str, Any]:
    """A distinct request (the tag is in the metadata) for the 8-layer example profile on 4 devices."""
    profile = json.loads((ROOT / "examples" / "profiles" / "tiny.json").read_text())
    profile["metadata"] = {"bench": tag}
    return {
        "profile": profile,
        "cluster": {"devices": 4, "memory": "16GiB"},
        "training": {"global_batch_size": 32},
        "options": {"time_limit_s": time_limit_s},
    }


def _client_run(url: str, tags: list[str], time_limit_s: float, barrier: threading.Barrier | None) -> tuple[list[float], list[str]]:
    latencies: list[float] = []
    errors: list[str] = []
    with httpx.Client(base_url=url, timeout=300) as c:
        c.get("/healthz")
        if barrier is not None:
            barrier.wait()
        for tag in tags:
            start = time.perf_counter()
            try:
                r = c.post("/v1/plans", json=tiny_body(tag, time_limit_s))
                if r.status_code != 201:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as err:
                errors.append(f"{type(err).__name__}: {err}")
            latencies.append((time.perf_counter() - start) * 1e3)
    return latencies, errors


def load_section(args: argparse.Namespace, tmp: Path) -> None:
    clients, per_client = (20, 5) if args.quick else (50, 10)
    limit = 0.5
    with Server(tmp / "load.db", tmp / "load.log") as server:
        _client_run(server.url, ["warm-up"], limit, None)  # the workers import OR-Tools
        alone, alone_errors = _client_run(server.url, [f"alone-{i}" for i in range(per_client)], limit, None)
        barrier = threading.Barrier(clients + 1)
        results: list[tuple[list[float], list[str]]] = []
        lock = threading.Lock()

        def run(c: int) -> None:
            out = _client_run(server.url, [f"c{c}-{i}" for i in range(per_client)], limit, barrier)
            with lock:
                results.append(out)

        threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    latencies = [x for lat, _ in results for x in lat]
    errors = [e for _, errs in results for e in errs]
    print(f"== load: {clients} concurrent clients x {per_client} distinct plans each (8-layer profile, 4 devices, "
          f"solved each, time limit {limit:g} s, 2 solver workers), {os.cpu_count()} CPUs\n")
    print(f"{'measure':<28} {'n':>5} {'errors':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'plans/s':>8}")
    for name, values, errs, secs in (
        ("1 client alone (baseline)", alone, alone_errors, sum(alone) / 1e3),
        (f"{clients} concurrent clients", latencies, errors, elapsed),
    ):
        print(f"{name:<28} {len(values):>5} {len(errs):>7} {percentile(values, 0.5):>9.0f} {percentile(values, 0.99):>9.0f} "
              f"{max(values):>9.0f} {len(values) / secs:>8.1f}")
    print(f"\nthroughput under load vs alone: {len(latencies) / elapsed / (len(alone) / (sum(alone) / 1e3)):.2f}x "
          f"(goal: 0 errors; got {len(errors)})")
    for e in errors[:5]:
        print("  error:", e)
    print()


# --------------------------------------------------------------------------- durability


def durability_section(args: argparse.Namespace, tmp: Path) -> None:
    rounds = 2 if args.quick else 3
    db = tmp / "durable.db"
    created: dict[str, dict[str, Any]] = {}  # id -> plan, for every 201 received
    lock = threading.Lock()
    rows = []
    for r in range(rounds):
        server = Server(db, tmp / "durable.log").start()
        stop = threading.Event()

        def writer(w: int, url: str = server.url, round_: int = r, stop: threading.Event = stop) -> None:
            i = 0
            with httpx.Client(base_url=url, timeout=30) as c:
                while not stop.is_set():
                    try:
                        resp = c.post("/v1/plans", json=tiny_body(f"r{round_}-w{w}-{i}", 0.2))
                    except httpx.HTTPError:
                        return  # the server is gone
                    if resp.status_code == 201:
                        with lock:
                            created[resp.json()["id"]] = resp.json()["plan"]
                    i += 1

        before = len(created)
        threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(created) - before < (15 if args.quick else 40) and time.monotonic() < deadline:
            time.sleep(0.05)
        server.kill()  # SIGKILL in the middle of the writes
        stop.set()
        for t in threads:
            t.join()
        with sqlite3.connect(db) as conn:
            integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
            rows_in_db = conn.execute("SELECT count(*) FROM plans").fetchone()[0]
        with Server(db, tmp / "durable.log") as again, httpx.Client(base_url=again.url, timeout=30) as c:
            lost = changed = 0
            for plan_id, plan in list(created.items()):
                got = c.get(f"/v1/plans/{plan_id}")
                if got.status_code != 200:
                    lost += 1
                elif got.json()["plan"] != plan:
                    changed += 1
        rows.append((r + 1, len(created) - before, len(created), rows_in_db, integrity, lost, changed))
    print(f"== durability: 8 clients post distinct plans; the server is SIGKILLed mid-writes, restarted, "
          f"and asked for every plan that got a 201 ({rounds} rounds, one database)\n")
    print(f"{'round':>5} {'201s this round':>16} {'201s in all':>12} {'rows in db':>11} {'integrity_check':>16} {'lost':>5} {'changed':>8}")
    for row in rows:
        print(f"{row[0]:>5} {row[1]:>16} {row[2]:>12} {row[3]:>11} {row[4]:>16} {row[5]:>5} {row[6]:>8}")
    print(f"\nplans lost after kills: {sum(r[5] for r in rows)} (goal 0)\n")


# --------------------------------------------------------------------------- hostile input

_PROBE = r"""
import http.client, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
out = open(sys.argv[2], "w", buffering=1)
while True:
    start = time.perf_counter()
    conn.request("GET", "/healthz")
    response = conn.getresponse()
    response.read()
    out.write(f"{response.status} {(time.perf_counter() - start) * 1e3:.3f}\n")
    time.sleep(0.02)
"""


def _probe_ms(path: Path) -> list[float]:
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "200":
            out.append(float(parts[1]))
    return out


def hostile_bodies() -> dict[str, bytes]:
    base = tiny_body("hostile", 1.0)
    def with_(**parts: Any) -> bytes:
        return json.dumps({**base, **parts}).encode()
    layer = base["profile"]["layers"][1]
    many = dict(base["profile"], layers=[dict(layer, name=f"l{i}") for i in range(75_000)])
    big = json.dumps({**base, "profile": many}).encode()
    big = big[:-1] + b" " * (16 * 2**20 - len(big)) + b"}"  # exactly the default byte limit
    return {
        "10^9-device cluster": with_(cluster={"devices": 10**9, "memory": "80GiB"}),
        "NaN in a profile": json.dumps(base).replace('"forward_ms": [', '"forward_ms": [NaN, ', 1).encode(),
        "global batch 10^18": with_(training={"global_batch_size": 10**18}),
        "16 MiB, 75,000 layers": big,
        "100,000-deep nesting": b"[" * 100_000 + b"]" * 100_000,
    }


def hostile_section(args: argparse.Namespace, tmp: Path) -> None:
    repeats = 5 if args.quick else 20
    bodies = hostile_bodies()
    with Server(tmp / "hostile.db", tmp / "hostile.log") as server:
        idle_file, busy_file = tmp / "idle.txt", tmp / "busy.txt"
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, str(server.port), str(idle_file)])
        time.sleep(3 if args.quick else 6)
        probe.kill()
        probe.wait()
        probe = subprocess.Popen([sys.executable, "-c", _PROBE, str(server.port), str(busy_file)])
        time.sleep(0.5)
        results: dict[str, tuple[list[float], set[int]]] = {}
        headers = {"content-type": "application/json"}
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for name, raw in bodies.items():
                times, codes = [], set()
                for _ in range(repeats if len(raw) < 2**20 else max(3, repeats // 4)):
                    start = time.perf_counter()
                    r = c.post("/v1/plans", content=raw, headers=headers)
                    times.append((time.perf_counter() - start) * 1e3)
                    codes.add(r.status_code)
                results[name] = (times, codes)
        probe.kill()
        probe.wait()
    idle, busy = _probe_ms(idle_file), _probe_ms(busy_file)
    print(f"== hostile input: each body sent {repeats} times (the 16 MiB one {max(3, repeats // 4)}), one after "
          f"another; /healthz probed every 20 ms from another process, {os.cpu_count()} CPUs\n")
    print(f"{'body':<28} {'status':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for name, (times, codes) in results.items():
        print(f"{name:<28} {','.join(map(str, sorted(codes))):>7} {percentile(times, 0.5):>9.1f} "
              f"{percentile(times, 0.99):>9.1f} {max(times):>9.1f}")
    print()
    print(f"{'GET /healthz':<28} {'n':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for name, values in (("idle server (baseline)", idle), ("under the hostile bodies", busy)):
        print(f"{name:<28} {len(values):>7} {percentile(values, 0.5):>9.1f} {percentile(values, 0.99):>9.1f} {max(values):>9.1f}")
    print(f"\nhealth p99 under attack vs idle: {percentile(busy, 0.99) / percentile(idle, 0.99):.2f}x (goal: max < 100 ms)\n")


# --------------------------------------------------------------------------- backends


def _load_run(urls: list[str], clients: int, per_client: int, limit: float, tag: str) -> tuple[list[float], list[str], float]:
    """``clients`` threads post ``per_client`` distinct plans each, client c to ``urls[c % len]``."""
    for url in urls:
        _client_run(url, [f"{tag}-warm-up-{url}"], limit, None)  # the workers import OR-Tools
    barrier = threading.Barrier(clients + 1)
    results: list[tuple[list[float], list[str]]] = []
    lock = threading.Lock()

    def run(c: int) -> None:
        out = _client_run(urls[c % len(urls)], [f"{tag}-c{c}-{i}" for i in range(per_client)], limit, barrier)
        with lock:
            results.append(out)

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return [x for lat, _ in results for x in lat], [e for _, errs in results for e in errs], elapsed


def _postgres(tmp: Path) -> Any:
    """A throw-away PostgreSQL on loopback (tests/api/pg_testlib.py), or None and why not."""
    sys.path.insert(0, str(ROOT / "tests" / "api"))
    from pg_testlib import PostgresServer, find_postgres

    bindir, why = find_postgres()
    if bindir is None:
        print(f"   (no PostgreSQL column: {why})")
        return None
    server = PostgresServer(bindir)
    server.init()
    server.start()
    return server


def backends_section(args: argparse.Namespace, tmp: Path) -> None:
    clients, per_client = (20, 5) if args.quick else (50, 10)
    limit = 0.5
    rows: list[tuple[str, int, list[float], list[str], float]] = []
    with Server(tmp / "backends.db", tmp / "backends-sqlite.log") as server:
        rows.append(("SQLite", 1, *_load_run([server.url], clients, per_client, limit, "sqlite")))
    pg = _postgres(tmp)
    if pg is not None:
        try:
            url = pg.new_database()
            with Server(url, tmp / "backends-pg.log") as server:
                rows.append(("PostgreSQL", 1, *_load_run([server.url], clients, per_client, limit, "pg1")))
            url = pg.new_database()
            with Server(url, tmp / "backends-pg-a.log") as a, Server(url, tmp / "backends-pg-b.log") as b:
                rows.append(("PostgreSQL", 2, *_load_run([a.url, b.url], clients, per_client, limit, "pg2")))
        finally:
            pg.remove()
    print(f"== backends: {clients} concurrent clients x {per_client} distinct plans each (8-layer profile, 4 devices, "
          f"solved each, time limit {limit:g} s, 2 solver workers per server), {os.cpu_count()} CPUs\n")
    print(f"{'database':<12} {'servers':>7} {'n':>5} {'errors':>7} {'p50 ms':>9} {'p99 ms':>9} {'plans/s':>8}")
    for name, servers, latencies, errors, elapsed in rows:
        print(f"{name:<12} {servers:>7} {len(latencies):>5} {len(errors):>7} {percentile(latencies, 0.5):>9.0f} "
              f"{percentile(latencies, 0.99):>9.0f} {len(latencies) / elapsed:>8.1f}")
        for e in errors[:3]:
            print("  error:", e)
    print("\n(replicas on one machine share its CPUs: on 2 cores two replicas add database round trips, not solvers)\n")


# --------------------------------------------------------------------------- pages


def pages_section(args: argparse.Namespace, tmp: Path) -> None:
    n = 10 if args.quick else 30
    profile = synth_transformer(layers=1022, hidden=1024, heads=16, seq=1024, vocab=32000, device_type="h100-80g")
    request = {
        "profile": profile.model_dump(mode="json"),
        "cluster": {"devices": 8, "device_type": "h100-80g"},
        "training": {"global_batch_size": 64},
        "options": {"time_limit_s": 5.0, "stages": 8, "num_microbatches": 64, "schedule": "1f1b"},
    }
    rows = []
    # the tests' stand-in solver (an even split priced by the real cost model): a real 1,024-layer
    # plan in a second, where the search would take minutes on a busy 2-core machine
    fake = {"PIPEPLAN_SOLVER": "api_fake_solver:solve",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "api")])}
    with Server(tmp / "pages.db", tmp / "pages.log", **fake) as server, httpx.Client(base_url=server.url, timeout=300) as c:
        r = c.post("/v1/plans", json=request)
        _expect(r, 201)
        plan = r.json()["plan"]
        plan_id = r.json()["id"]
        for i in range(20):  # a list of 21 plans
            _expect(c.post("/v1/plans", json=tiny_body(f"pages-{i}", 0.5)), 201)
        first = {kind: timed(lambda k=kind: _expect(c.get(f"/plans/{plan_id}/{k}.svg"), 200)) for kind in ("gantt", "memory")}
        for name, path in (("/plans/{id} (page)", f"/plans/{plan_id}"), ("/plans (list, 21 plans)", "/plans"),
                           ("/plans/{id}/gantt.svg (kept)", f"/plans/{plan_id}/gantt.svg")):
            _expect(c.get(path), 200)
            samples = [timed(lambda p=path: _expect(c.get(p), 200)) for _ in range(n)]
            rows.append((name, samples))
    print(f"== pages: a {plan['num_layers']}-layer plan on {len(plan['stages'])} stages "
          f"(P={plan['pipeline_degree']}, M={plan['num_microbatches']}), loopback round trips, {os.cpu_count()} CPUs\n")
    print(f"{'request':<32} {'n':>4} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for name, samples in rows:
        print(f"{name:<32} {len(samples):>4} {percentile(samples, 0.5):>9.1f} {percentile(samples, 0.99):>9.1f} {max(samples):>9.1f}")
    print(f"first draw: gantt.svg {first['gantt']:.0f} ms, memory.svg {first['memory']:.0f} ms "
          "(the page embeds both as objects: the browser loads them after the page)")
    print(f"goal: /plans/{{id}} < 300 ms; got p99 {percentile(rows[0][1], 0.99):.1f} ms\n")


SECTIONS = {
    "latency": latency_section,
    "load": load_section,
    "durability": durability_section,
    "backends": backends_section,
    "pages": pages_section,
    "hostile": hostile_section,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--time-limit", type=float, default=2.0, help="solver time limit per request (s), latency section")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections ({', '.join(SECTIONS)})")
    args = parser.parse_args()
    chosen = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            SECTIONS[name](args, Path(tmp))
    return 0


def _expect(response: httpx.Response, status: int) -> None:
    if response.status_code != status:
        raise RuntimeError(f"expected {status}, got {response.status_code}: {response.text[:300]}")


if __name__ == "__main__":
    sys.exit(main())
