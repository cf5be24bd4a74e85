"""How ``pipeplan run`` starts torchrun (no torch needed to build the command): where the hosts
meet (:class:`Rendezvous`), the ``torch.distributed.run`` command line (:func:`torchrun_argv`),
and the environment and logging around it (:func:`child_environment`, :func:`quiet_torchrun`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

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
def child_environment(threads: int | None, verbose: bool) -> Iterator[None]:
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
def quiet_torchrun(verbose: bool) -> Iterator[None]:
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
