"""One rank of a pipelined training job: the torchrun entry module.

``pipeplan run`` launches it for you; it also runs directly under torchrun::

    torchrun --nproc-per-node 2 -m runtime.worker --plan plan.json --model examples.gpt:tiny

Each rank rebuilds the model from the entry point, splits it with the profiler's splitter
(the same code that produced the profile, so layer ``i`` of the plan is unit ``i``), checks
the plan against it, builds its ``PipelineStage`` (s) and the schedule the plan names from
``torch.distributed.pipelining``, and trains ``--steps`` steps on the entry point's data
(:mod:`runtime.data`: the ranks that use it read it, and check at every step that they
agree), else on synthetic batches.  Targets reach the last stage through the schedule's
``target=``.  With ``--dtype bf16|fp16`` the stages and the loss run under autocast with
float32 master weights (fp16: dynamic loss scaling, one decision for the whole job).  The
ranks form the plan's ``DeviceMesh`` (:mod:`runtime.mesh`: axes ``("pp", "dp_replicate",
"dp_shard", "tp")``, rank = (k * D + d) * T + t); each stage module gets tensor parallelism
(T > 1, the layers with a sharding rule), recompute (its first checkpointed layers, each under
its own checkpoint), autocast, then FSDP2 over the data axis (ZeRO 2/3); ZeRO 1 shards the
optimizer state.  Gradients are averaged over the data axis: by torch DDP's buckets during
each stage's last backward where :func:`runtime.mesh.gradient_reduction` allows it (ZeRO 0/1,
T = 1, no split backward), else by the flat all-reduce after the schedule (for what FSDP2 does
not shard), and tied parameters whose copies sit on different pipeline ranks have
their gradients summed between those ranks;
``--clip-grad-norm`` clips to the norm of that whole gradient (summed over the pipeline
ranks).  ``--checkpoint DIR [--every N]`` saves model and optimizer state with
``torch.distributed.checkpoint`` (:mod:`runtime.checkpoint`, every rank its own shards);
``--resume DIR`` continues from its newest complete checkpoint under this or another plan
(resharded on load).  Rank 0 writes the per-step
``--log``, gathers the measurements, prints the report, writes it with ``--report``, and
with ``--check`` trains the unsplit model in its own process on the same data and compares.

Where each part lives (:func:`main` starts the rank, :func:`_run` joins the process group,
:func:`_train` calls the training's parts in this order):

- :mod:`runtime.worker_args`: the flags (shared with ``pipeplan run``) and their defaults;
- :mod:`runtime.watchdog`: the thread that ends a rank making no progress;
- :mod:`runtime.worker_setup`: flags, plan and model to this rank's :class:`Job` (the checked
  training options, the device, the split model checked against the plan);
- :mod:`runtime.rank_state`: the dataclasses the steps pass on (:class:`Job`, ``RankState``,
  ``StageSet``, ``Training``, ``StepRecords``);
- :mod:`runtime.stages`: the mesh, then this rank's stages, one step per axis in a fixed order
  (split, context/expert parallelism, TP/SP, recompute, autocast, FSDP2, DDP, ``PipelineStage``;
  :mod:`runtime.stage_weights`: the weights they share and the data-parallel path,
  :mod:`runtime.stage_axes`: the steps per axis);
- :mod:`runtime.loop`: loss, schedule, optimizer, ``--resume`` and data; then the steps;
- :mod:`runtime.step`: one training step (:mod:`runtime.step_data`: its batch,
  :mod:`runtime.step_update`: its optimizer step and checkpoint), and :mod:`runtime.gradients`:
  its gradient reduction, loss scale and clipping;
- :mod:`runtime.stage_timing`: the timing hooks (actions, loss, DDP's buckets, collectives);
- :mod:`runtime.results`: every rank's measurements (:mod:`runtime.results_rank`) to rank 0, and
  rank 0's report (:mod:`runtime.report_notes`: its notes, with :mod:`runtime.report_notes_mesh`
  and :mod:`runtime.report_notes_data`; :mod:`runtime.rank_check`: ``--check``);
- :mod:`runtime.fault_injection`: ``--inject-fault``, for tests.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence

from planner.errors import PipeplanError
from runtime.fault_injection import FAULT_MODES as FAULT_MODES
from runtime.fault_injection import Fault as Fault
from runtime.faults import CheckFailedError, RankStatus, error_summary, write_status
from runtime.rank_check import check_grad_steps as check_grad_steps
from runtime.rank_check import tolerance as tolerance
from runtime.rank_state import Job, Progress
from runtime.stage_timing import fold_loss as _fold_loss  # noqa: F401 (tests import it from here)
from runtime.watchdog import EXIT_HUNG as EXIT_HUNG
from runtime.watchdog import start_watchdog
from runtime.worker_args import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from runtime.worker_args import DEFAULT_TOLERANCE as DEFAULT_TOLERANCE
from runtime.worker_args import DTYPE_CHOICES as DTYPE_CHOICES
from runtime.worker_args import add_worker_args as add_worker_args
from runtime.worker_setup import build_job
from runtime.worker_setup import train_options as train_options

#: exit code of a rank whose --check failed (other failures exit 1; a hung rank: EXIT_HUNG)
EXIT_CHECK_FAILED = 3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.worker", description=__doc__.split("\n\n")[0])
    add_worker_args(parser)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    status = RankStatus(rank=rank, pid=os.getpid(), host=socket.gethostname())
    run_dir = args.run_dir
    write_status(run_dir, status)
    progress = Progress()
    start_watchdog(progress, status, run_dir, args.timeout)
    try:
        code = _run(args, rank, status, progress)
    except BaseException as err:  # every failure is reported, then the rank exits
        progress.done = True
        status.state = "failed"
        info = error_summary(err)
        status.error_type, status.error, status.communication = info["error_type"], info["error"], info["communication"]
        status.traceback = traceback.format_exc()
        write_status(run_dir, status)
        if isinstance(err, CheckFailedError):
            if not run_dir:  # under pipeplan run the launcher prints it, once
                print(f"error: {err}", file=sys.stderr, flush=True)
            return EXIT_CHECK_FAILED
        if isinstance(err, PipeplanError):
            print(f"[rank{rank}] error: {err}", file=sys.stderr, flush=True)
        else:
            print(
                f"[rank{rank}] error: {status.error_type}: {status.error} (during {status.where()})",
                file=sys.stderr,
                flush=True,
            )
            if os.environ.get("PIPEPLAN_VERBOSE"):
                print(status.traceback, file=sys.stderr, flush=True)
        return 1
    progress.done = True
    status.state = "done"
    write_status(run_dir, status)
    return code


def _run(args: argparse.Namespace, rank: int, status: RankStatus, progress: Progress) -> int:
    """Read the plan, build and split the model, check the plan against it
    (:func:`runtime.worker_setup.build_job`), join the process group and train."""
    import torch.distributed as dist

    job = build_job(args, rank, status, progress)
    status.phase = "joining the process group"
    write_status(args.run_dir, status)
    timeout = datetime.timedelta(seconds=args.timeout)
    device = job.device
    dist.init_process_group(job.backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    try:
        return _train(job)
    finally:
        progress.done = True
        dist.destroy_process_group()


def _train(job: Job) -> int:
    """Train on this rank: the stages, the steps, then the results to rank 0 (which reports)."""
    from runtime.loop import prepare, train
    from runtime.results import finish, gather, rank_results
    from runtime.stages import build_stages, join_mesh

    if not os.environ.get("PIPEPLAN_VERBOSE"):
        # the interleaved schedule logs its whole action table when a rank fails; the status
        # file and the launcher's diagnosis say what matters (PIPEPLAN_VERBOSE=1 keeps it)
        for name in ("torch.distributed.pipelining", "torch.distributed.pipelining.schedules"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    state = join_mesh(job)  # the DeviceMesh and this rank's pipeline and data groups
    built = build_stages(state)  # this rank's PipelineStage(s), one parallelize step per axis
    training = prepare(state, built)  # loss, schedule, optimizer, --resume, data
    records = train(state, built, training)  # the steps (runtime/step.py)

    # ---- gather to rank 0
    status, progress = job.status, job.progress
    status.step = None
    status.phase = "gathering results"
    write_status(job.args.run_dir, status)
    progress.beat = time.monotonic()
    gathered = gather(job.coords.rank, job.coords.world, rank_results(state, built, training, records))
    if job.coords.rank != 0:
        return 0
    # the report and the single-process reference need no other rank: stop the watchdog
    progress.done = True
    return finish(job, training.source, gathered)


if __name__ == "__main__":
    sys.exit(main())
