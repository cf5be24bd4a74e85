"""Launch the ranks of a plan with ``torch.distributed.run`` (torchrun) and diagnose failures.

One host by default (``--standalone`` rendezvous on a free port); several hosts with the
usual static rendezvous flags (``nnodes``, ``node_rank``, ``master_addr``, ``master_port``),
run once per host.  Every rank is ``python -m runtime.worker``; torchrun's agent stops all
ranks as soon as one fails.  Afterwards the launcher reads the per-rank status files,
names the rank and cause, and makes sure none of the processes it started survives.

Its parts: :mod:`runtime.launch_command` (the rendezvous, torchrun's command line, the ranks'
environment) and :mod:`runtime.launch_failure` (the failed job's error, the lost host, the
processes left behind); here :func:`launch`.  Every name stays importable from here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence

from runtime.faults import JobFailedError
from runtime.launch_command import REPO_ROOT as REPO_ROOT
from runtime.launch_command import SHUTDOWN_TIMEOUT_S as SHUTDOWN_TIMEOUT_S
from runtime.launch_command import Rendezvous as Rendezvous
from runtime.launch_command import child_environment, quiet_torchrun
from runtime.launch_command import torchrun_argv as torchrun_argv
from runtime.launch_failure import job_failure, reap
from runtime.launch_failure import lost_nodes as lost_nodes


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
    :class:`JobFailedError` naming the rank(s) and cause, or :class:`CheckFailedError`
    (:func:`runtime.launch_failure.job_failure`).
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
    with child_environment(threads, verbose), quiet_torchrun(verbose):
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
            reap(run_dir, world_size)
    if not failed:
        return
    raise job_failure(run_dir, world_size, exit_codes, timeout_s=timeout_s, nproc_per_node=nproc,
                      rendezvous=rendezvous, stage_of=stage_of, elapsed_s=time.monotonic() - started)  # fmt: skip
