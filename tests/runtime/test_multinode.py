"""Several hosts: two ``pipeplan run`` agents on this machine, ``--nnodes 2 --node-rank R``,
static rendezvous on 127.0.0.1 (one rank each: a K = 2 plan)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.launch import Rendezvous, lost_nodes
from tests.runtime.helpers import (
    ROOT,
    make_plan,
    processes_mentioning,
    structure_profile,
    write_plan,
)
from tests.runtime.mesh_job import free_port


def _agents(tmp_path: Path, model: str, *extra: str) -> list[subprocess.Popen[str]]:
    plan = write_plan(make_plan(structure_profile("examples.gpt:tiny"), [(0, 3), (3, 6)], microbatches=2), tmp_path / "plan.json")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pipeplan", "run", "--plan", str(plan), "--model", model, "--nnodes", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]  # fmt: skip
    return [
        subprocess.Popen(
            [*cmd, "--node-rank", str(r)], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )
        for r in (0, 1)
    ]


def _finish(p: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"agent still running after {timeout} s:\n{out}\n{err}")
    return p.returncode, out + err


@pytest.mark.slow
def test_two_agents_run_a_k2_plan_with_check(tmp_path: Path) -> None:
    agents = _agents(tmp_path, "examples.gpt:tiny", "--steps", "2", "--check", "--timeout", "60")
    (code0, out0), (code1, out1) = (_finish(p, 240) for p in agents)
    assert code0 == 0, out0
    assert code1 == 0, out1
    assert "2 rank(s)" in out0 and "check PASSED" in out0, out0
    assert "check PASSED" not in out1  # the report and the check are rank 0's, on node 0


@pytest.mark.slow
def test_a_killed_node_ends_the_other_naming_it(tmp_path: Path) -> None:
    # a model file of its own, so that this job's workers can be told from any other's
    job = tmp_path / "killed_node_job.py"
    job.write_text("from examples.gpt import tiny as gpt\n")
    timeout = 15
    agents = _agents(tmp_path, f"{job}:gpt", "--steps", "100000", "--timeout", str(timeout))
    deadline = time.monotonic() + 180
    while _training_step(str(job)) < 1 and time.monotonic() < deadline:  # both ranks past start-up
        time.sleep(0.5)
    assert _training_step(str(job)) >= 1, "the job did not start training"
    # node 1 goes down: its agent and its rank at once (torchrun starts the rank in a session of
    # its own, so it is found by its environment)
    os.killpg(agents[1].pid, signal.SIGKILL)
    for pid in _pids_of_rank(str(job), 1):
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    code0, out0 = _finish(agents[0], 3 * timeout + 30)
    elapsed = time.monotonic() - t0
    agents[1].communicate()
    print(f"node 0 ended {elapsed:.1f} s after node 1 was killed:\n{out0}")
    assert code0 == 1, out0
    assert "lost node 1 (rank 1)" in out0, out0
    assert elapsed < 3 * timeout + 30
    assert not processes_mentioning(str(job)), "a process of the job survived"


def _training_step(marker: str) -> int:
    """The step rank 0 of the job is in (-1 before training), from its status file."""
    from runtime.faults import read_statuses

    for pid in _pids_of_rank(marker, 0):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--run-dir" in cmd:
            run_dir = cmd[cmd.index(b"--run-dir") + 1].decode()
            status = read_statuses(run_dir, 2).get(0)
            if status is not None and status.state == "running" and status.step is not None:
                return int(status.step)
    return -1


def _pids_of_rank(marker: str, rank: int) -> list[int]:
    pids = []
    for line in processes_mentioning(marker):
        pid = int(line.split(":", 1)[0])
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            pids.append(pid)
    return pids


def test_lost_nodes_names_remote_culprits_only() -> None:
    two = Rendezvous(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=1)
    assert lost_nodes([1], {}, nproc_per_node=1, rendezvous=two).startswith("lost node 1 (rank 1)")
    assert lost_nodes([2, 3], {}, nproc_per_node=2, rendezvous=two).startswith("lost node 1 (ranks 2, 3)")
    assert lost_nodes([0], {}, nproc_per_node=1, rendezvous=two) == ""  # a rank of this host
    assert lost_nodes([1], {}, nproc_per_node=1, rendezvous=Rendezvous()) == ""
