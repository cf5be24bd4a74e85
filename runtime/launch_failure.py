"""What ``pipeplan run`` says when a job failed (:func:`job_failure`): the ``--check`` verdict
from the report, else every rank's status file diagnosed, a lost host named
(:func:`lost_nodes`); and the processes it must not leave behind (:func:`reap`)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from planner.errors import PipeplanError
from runtime.faults import CheckFailedError, JobFailedError, diagnose, read_statuses
from runtime.launch_command import Rendezvous
from runtime.report import check_failed_message, load_report


def job_failure(
    run_dir: str,
    world_size: int,
    exit_codes: Mapping[int, int],
    *,
    timeout_s: float,
    nproc_per_node: int,
    rendezvous: Rendezvous,
    stage_of: Mapping[int, str] | None,
    elapsed_s: float,
) -> PipeplanError:
    """The error of a failed job: :class:`CheckFailedError` when ``--check`` failed, else a
    :class:`JobFailedError` naming the rank(s) and cause (the lost node first, when another
    host's ranks are to blame)."""
    report_file = Path(run_dir, "report.json")
    if report_file.exists():
        check = load_report(report_file.read_bytes(), source=str(report_file)).check
        if check is not None and not check.passed:
            return CheckFailedError(check_failed_message(check))
    statuses = read_statuses(run_dir, world_size)
    message, culprits = diagnose(statuses, dict(exit_codes), world_size=world_size, timeout_s=timeout_s,
                                 stage_of=stage_of)  # fmt: skip
    lost = lost_nodes(culprits, statuses, nproc_per_node=nproc_per_node, rendezvous=rendezvous)
    if lost:  # the lost ranks' own status files are on their host: drop the guess about them
        remote = [r for r in culprits if r not in statuses]
        kept = [
            line
            for line in message.splitlines()
            if not any(line.startswith(f"rank {r} ") and "stopped responding" in line for r in remote)
        ]
        message = "\n".join([lost, *kept])
    return JobFailedError(f"the job failed after {elapsed_s:.1f} s and was stopped:\n{message}", ranks=culprits)


def lost_nodes(
    culprits: Sequence[int], statuses: Mapping[int, Any], *, nproc_per_node: int, rendezvous: Rendezvous
) -> str:
    """With several hosts, the line naming the other node(s) whose ranks this host blames but
    never heard from (their status files live on their own host): the node was lost (its
    ``pipeplan run`` or the host ended).  Empty when every culprit is a rank of this host."""
    if rendezvous.nnodes == 1:
        return ""
    mine = range(rendezvous.node_rank * nproc_per_node, (rendezvous.node_rank + 1) * nproc_per_node)
    remote = sorted(r for r in culprits if r not in mine and r not in statuses)
    if not remote:
        return ""
    nodes: dict[int, list[int]] = {}
    for r in remote:
        nodes.setdefault(r // nproc_per_node, []).append(r)
    return "\n".join(
        f"lost node {node} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}): its ranks stopped "
        f"answering this host's ranks (node {node}'s pipeplan run, or the host, ended); this node stopped too"
        for node, ranks in nodes.items()
    )


def reap(run_dir: str, world_size: int) -> None:
    """Kill any worker this job started that is still alive (torchrun should have)."""
    for status in read_statuses(run_dir, world_size).values():
        if status.pid and status.pid != os.getpid() and alive(status.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(status.pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is gone for our purposes
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True
