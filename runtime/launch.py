"""Launch the ranks of a plan with ``torch.distributed.run`` (torchrun) and diagnose failures.

One host by default (``--standalone`` rendezvous on a free port); several hosts with the
usual static rendezvous flags (``nnodes``, ``node_rank``, ``master_addr``, ``master_port``),
run once per host.  Every rank is ``python -m runtime.worker``; torchrun's agent stops all
ranks as soon as one fails.  Afterwards the launcher reads the per-rank status files,
names the rank and cause, and makes sure none of the processes it started survives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.faults import CheckFailedError, JobFailedError, diagnose, read_statuses
from runtime.report import check_failed_message, load_report

#: seconds between SIGTERM and SIGKILL when the agent stops the ranks
SHUTDOWN_TIMEOUT_S = 5

REPO_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True)
class Rendezvous:
    """Where the hosts of a job meet.  The default is one host, a free local port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def torchrun_args(self) -> list[str]:
        if self.nnodes == 1 and self.master_addr is None:
            return ["--standalone", "--nnodes", "1"]
        args = ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--rdzv-backend", "static"]
        args += ["--master-addr", self.master_addr or "127.0.0.1", "--master-port", str(self.master_port or 29500)]
        return args


def torchrun_argv(
    worker_args: Sequence[str],
    *,
    nproc_per_node: int,
    rendezvous: Rendezvous,
) -> list[str]:
    """The ``torch.distributed.run`` command line running ``runtime.worker`` with ``worker_args``."""
    return [
        *rendezvous.torchrun_args(),
        "--nproc-per-node",
        str(nproc_per_node),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "--module",
        "runtime.worker",
        *worker_args,
    ]


@contextlib.contextmanager
def _child_environment(threads: int | None, verbose: bool) -> Iterator[None]:
    """Workers find this package and run with ``threads`` intra-op threads; restored after."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS", "PIPEPLAN_VERBOSE")}
    try:
        if verbose:
            os.environ["PIPEPLAN_VERBOSE"] = "1"
        paths = [REPO_ROOT, *[p for p in (saved["PYTHONPATH"] or "").split(os.pathsep) if p]]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)
        elif saved["OMP_NUM_THREADS"] is None:
            os.environ["OMP_NUM_THREADS"] = "1"
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_torchrun(verbose: bool) -> Iterator[None]:
    """torchrun logs every failure at length; we print our own diagnosis instead."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
    # torch sets levels on some of these loggers itself: quieten every one, not just the parents
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes)] + list(prefixes)
    levels = {n: logging.getLogger(n).level for n in names}
    try:
        if not verbose:
            for n in names:
                logging.getLogger(n).setLevel(logging.CRITICAL)
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


def launch(
    worker_args: Sequence[str],
    *,
    world_size: int,
    run_dir: str,
    timeout_s: float,
    nproc_per_node: int | None = None,
    rendezvous: Rendezvous | None = None,
    threads: int | None = None,
    stage_of: Mapping[int, str] | None = None,
    verbose: bool = False,
) -> None:
    """Run the job; return when every local rank finished, else raise a :class:`PipeplanError`.

    ``worker_args`` are ``runtime.worker`` flags (``--run-dir`` is added).  Raises
    :class:`JobFailedError` naming the rank(s) and cause, or :class:`CheckFailedError`.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    rendezvous = rendezvous or Rendezvous()
    nproc = nproc_per_node or world_size // rendezvous.nnodes
    argv = torchrun_argv([*worker_args, "--run-dir", run_dir], nproc_per_node=nproc, rendezvous=rendezvous)
    exit_codes: dict[int, int] = {}
    failed = False
    started = time.monotonic()
    with _child_environment(threads, verbose), _quiet_torchrun(verbose):
        try:
            torchrun.run(torchrun.parse_args(argv))  # type: ignore[no-untyped-call]
        except ChildFailedError as err:
            failed = True
            exit_codes = {int(r): int(f.exitcode) for r, f in err.failures.items()}
        except SignalException as err:
            raise JobFailedError(
                f"pipeplan run received {err.sigval.name} and stopped every rank of this host"
            ) from None
        finally:
            sys.stdout.flush()
            _reap(run_dir, world_size)
    if not failed:
        return
    report_file = Path(run_dir, "report.json")
    if report_file.exists():
        check = load_report(report_file.read_bytes(), source=str(report_file)).check
        if check is not None and not check.passed:
            raise CheckFailedError(check_failed_message(check))
    statuses = read_statuses(run_dir, world_size)
    message, culprits = diagnose(statuses, exit_codes, world_size=world_size, timeout_s=timeout_s, stage_of=stage_of)
    lost = lost_nodes(culprits, statuses, nproc_per_node=nproc, rendezvous=rendezvous)
    if lost:  # the lost ranks' own status files are on their host: drop the guess about them
        remote = [r for r in culprits if r not in statuses]
        kept = [
            line
            for line in message.splitlines()
            if not any(line.startswith(f"rank {r} ") and "stopped responding" in line for r in remote)
        ]
        message = "\n".join([lost, *kept])
    elapsed = time.monotonic() - started
    raise JobFailedError(f"the job failed after {elapsed:.1f} s and was stopped:\n{message}", ranks=culprits)


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


def _reap(run_dir: str, world_size: int) -> None:
    """Kill any worker this job started that is still alive (torchrun should have)."""
    for status in read_statuses(run_dir, world_size).values():
        if status.pid and status.pid != os.getpid() and _alive(status.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(status.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
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
