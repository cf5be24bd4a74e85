"""`plan --server URL` prints the same plan as local planning, and server errors are clear messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_testlib import ROOT, LiveServer

TINY = str(ROOT / "examples" / "profiles" / "tiny.json")
ARGS = [TINY, "--devices", "4", "--memory", "64MiB", "--batch-size", "16", "--time-limit", "2"]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("cli-server")
    s = LiveServer(tmp / "plans.db", tmp / "server.log", PIPEPLAN_SOLVER="planner.solver:solve")
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _plan(*extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PIPEPLAN_API_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "pipeplan", "plan", *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )


def _without_wall_time(plan: dict) -> dict:  # type: ignore[type-arg]
    plan = dict(plan)
    plan["solver"] = {k: v for k, v in plan["solver"].items() if k != "wall_time_s"}
    return plan


def test_remote_plan_equals_local_plan(real_server: LiveServer) -> None:
    local = _plan(*ARGS, "--json")
    remote = _plan(*ARGS, "--json", "--server", real_server.url)
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    assert _without_wall_time(json.loads(remote.stdout)) == _without_wall_time(json.loads(local.stdout))


def test_remote_table_has_the_same_lines(real_server: LiveServer) -> None:
    local = _plan(*ARGS)
    remote = _plan(*ARGS, "--server", real_server.url)
    assert remote.returncode == 0, remote.stderr

    def stable(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("solver:")]

    assert stable(remote.stdout) == stable(local.stdout)
    assert "vs baseline uniform" in remote.stdout


def test_remote_infeasible_exits_2_with_numbers(real_server: LiveServer) -> None:
    proc = _plan(TINY, "--devices", "2", "--memory", "40MiB", "--batch-size", "16", "--server", real_server.url)
    assert proc.returncode == 2
    assert "no plan fits" in proc.stderr and "MiB" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    proc = _plan(*ARGS, "--server", "http://127.0.0.1:9")
    assert proc.returncode == 1
    assert "cannot reach the planning service" in proc.stderr
    assert "Traceback" not in proc.stderr
