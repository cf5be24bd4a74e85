"""Helpers of the service tests (a uniquely named module: ``conftest`` names clash across
test folders)."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from api.solving import SolveFn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def variant(body: dict[str, Any], i: int) -> dict[str, Any]:
    """A distinct request (different global batch size)."""
    out = copy.deepcopy(body)
    out["training"]["global_batch_size"] = 8 * (i + 1)
    return out


class Recorder:
    """Wraps a solve function and records what it was asked (thread mode)."""

    def __init__(self, fn: SolveFn) -> None:
        self.fn = fn
        self.calls: list[Any] = []

    def __call__(self, profile: Any, cluster: Any, training: Any, options: Any) -> Any:
        self.calls.append(options)
        return self.fn(profile, cluster, training, options)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LiveServer:
    """``python -m pipeplan serve`` in a subprocess on a free loopback port."""

    def __init__(self, db: Path | str, log: Path, *args: str, **env: str) -> None:
        self.args = args
        self.db = db
        self.log = log
        self.env = env
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout_s: float = 30.0) -> None:
        self.port = free_port()
        env = dict(os.environ)
        env.update(
            {
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
                "PIPEPLAN_SOLVER": "api_fake_solver:solve",
                "PIPEPLAN_SOLVER_WORKERS": "2",
                "OMP_NUM_THREADS": "1",
            }
        )
        env.pop("PIPEPLAN_API_TOKEN", None)
        env.update(self.env)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeplan", "serve", "--port", str(self.port), "--db", str(self.db), *self.args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not answer /healthz within {timeout_s} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.proc = None



_PROBE = r"""
import http.client, sys, time, urllib.parse
url = urllib.parse.urlsplit(sys.argv[1])
out = open(sys.argv[2], "w", buffering=1)
conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
while True:
    start = time.perf_counter()
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        response.read()
        status = response.status
    except (OSError, http.client.HTTPException):
        conn.close()
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        status = 0
    out.write(f"{status} {time.perf_counter() - start:.6f}\n")
    time.sleep(0.02)
"""


class HealthProbe:
    """``GET /healthz`` every 20 ms from a process of its own (so the test's own work, e.g.
    sending a 16 MB body, cannot delay it), on one kept-alive connection.

    ``with HealthProbe(url, path) as probe: ...`` then ``probe.samples()`` -> ``[(status, s)]``."""

    def __init__(self, url: str, out: Path) -> None:
        self.url = url
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> HealthProbe:
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, self.url, str(self.out)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(self.samples()) < 2:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def samples(self) -> list[tuple[int, float]]:
        if not self.out.exists():
            return []
        out = []
        for line in self.out.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:  # the last line may be half written
                out.append((int(parts[0]), float(parts[1])))
        return out
