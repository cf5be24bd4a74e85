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

Where each part lives (:func:`_train` calls them in this order):

- :mod:`runtime.rank_state`: the dataclasses the steps pass on (:class:`Job`, ``RankState``,
  ``StageSet``, ``Training``, ``StepRecords``);
- :mod:`runtime.stages`: the mesh, then this rank's stages, one step per axis in a fixed order
  (split, context/expert parallelism, TP/SP, recompute, autocast, FSDP2, DDP, ``PipelineStage``);
- :mod:`runtime.loop`: loss, schedule, optimizer, ``--resume`` and data; then the steps;
- :mod:`runtime.step`: one training step, and :mod:`runtime.gradients`: its gradient reduction,
  loss scale and clipping;
- :mod:`runtime.stage_timing`: the timing hooks (actions, loss, DDP's buckets, collectives);
- :mod:`runtime.results`: every rank's measurements to rank 0, and rank 0's report
  (:mod:`runtime.report_notes`: its notes; :mod:`runtime.rank_check`: ``--check``);
- :mod:`runtime.fault_injection`: ``--inject-fault``, for tests.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from planner.errors import InputError, PipeplanError
from runtime.fault_injection import FAULT_MODES as FAULT_MODES
from runtime.fault_injection import Fault
from runtime.faults import CheckFailedError, RankStatus, error_summary, write_status
from runtime.rank_check import check_grad_steps as check_grad_steps
from runtime.rank_check import tolerance as tolerance
from runtime.rank_state import Coords, Job, Progress
from runtime.stage_timing import fold_loss as _fold_loss  # noqa: F401 (tests import it from here)

#: exit code of a rank whose --check failed (other failures exit 1)
EXIT_CHECK_FAILED = 3
#: exit code of a rank whose watchdog saw it make no progress
EXIT_HUNG = 124

DEFAULT_TIMEOUT_S = 120.0
#: --check tolerance of a float32 run (16-bit runs: runtime.training.DEFAULT_TOLERANCES)
DEFAULT_TOLERANCE = 1e-5
#: --dtype choices (short and long names)
DTYPE_CHOICES = ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16")


def add_worker_args(p: argparse.ArgumentParser, *, for_launcher: bool = False) -> None:
    """Flags shared by ``pipeplan run`` and ``python -m runtime.worker``."""
    if not for_launcher:
        p.add_argument("--plan", required=True, help="plan JSON file")
    p.add_argument(
        "--model",
        required=True,
        help="MODULE:FUNC or path/to/file.py:FUNC (the profiled model); FUNC returns (model, example_inputs"
        "[, loss_fn[, data]]): loss_fn(output) or loss_fn(output, target); data: data_fn(step, batch_size), "
        "an iterable of global batches (a DataLoader) or runtime.data.Loader(make[, per_replica=True]), "
        "yielding (inputs, targets) when the loss takes a target",
    )
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument(
        "--optimizer",
        default=None,
        help="sgd, sgd-momentum, adam, adamw; must match the plan's training optimizer (default: the plan's)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="constant, or cosine decay to --min-lr at the last step (default constant)",
    )
    p.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up steps (default 0)")
    p.add_argument("--min-lr", type=float, default=0.0, help="where the cosine schedule ends (default 0)")
    p.add_argument(
        "--clip-grad-norm",
        type=float,
        metavar="MAX",
        help="clip the gradient to this L2 norm, the norm of the whole model's gradient over every "
        "pipeline rank (after the data-parallel average)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="compute dtype: bf16/fp16 run the stages under autocast with fp32 master weights "
        "(fp16 with loss scaling); must match the plan's (default: the plan's, fp32 for a plan without one)",
    )
    p.add_argument(
        "--log-file",
        metavar="FILE",
        help="write loss, lr, step time, throughput and gradient norm per step: CSV for *.csv, else JSON lines",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model set-up and of the synthetic data (a data function from FUNC ignores it; default 0)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"collective timeout in seconds: a rank that waits longer for another fails the job (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="default: nccl on CUDA, else gloo")
    p.add_argument(
        "--check",
        action="store_true",
        help="compare losses, gradients and final parameters with the unsplit model trained in one process",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        help=f"--check relative tolerance (default {DEFAULT_TOLERANCE:g} for fp32, 1e-2 for bf16, 2e-3 for fp16)",
    )
    p.add_argument("--report", metavar="FILE", help="write the measured-vs-predicted report JSON here")
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="save model and optimizer state here with torch.distributed.checkpoint (sharded, every rank "
        "writes its own part); DIR/latest names the newest complete one",
    )
    p.add_argument(
        "--every", type=int, default=0, metavar="N", help="with --checkpoint: save every N steps (default 0: at the end)"
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from the newest complete checkpoint in DIR, under this or another plan (other K, D, T "
        "or ZeRO: the checkpoint is resharded on load); --steps counts from step 0",
    )
    p.add_argument(
        "--dp-bucket-mb",
        type=float,
        default=None,
        metavar="MIB",
        help="bucket size of the data-parallel gradient all-reduce (torch DDP, overlapped with each stage's last "
        "backward; default 25, DDP's)",
    )
    p.add_argument(
        "--dp-reduction",
        choices=("auto", "flat"),
        default="auto",
        help="data-parallel gradient reduction: auto (torch DDP, bucketed and overlapped with the backward, where "
        "the mesh allows it; else the flat all-reduce) or flat (the runtime's flat all-reduce after the schedule, "
        "to compare)",
    )
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    # RANK:STEP:MODE (FAULT_MODES): make one rank fail mid-step or compute wrongly, for tests
    p.add_argument("--inject-fault", help=argparse.SUPPRESS)


def train_options(args: argparse.Namespace, plan: Any, optimizer: str) -> Any:
    """The :class:`runtime.training.TrainOptions` of the flags, checked (``--dtype`` defaults
    to the plan's)."""
    from runtime.training import RUN_DTYPES, TrainOptions

    if args.lr <= 0:
        raise InputError(f"--lr {args.lr}: give a positive learning rate")
    if args.warmup_steps < 0:
        raise InputError(f"--warmup-steps {args.warmup_steps}: give 0 or more")
    if not 0 <= args.min_lr <= args.lr:
        raise InputError(f"--min-lr {args.min_lr}: give a value between 0 and --lr {args.lr}")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        raise InputError(f"--clip-grad-norm {args.clip_grad_norm}: give a positive norm")
    return TrainOptions(
        optimizer=optimizer,
        lr=args.lr,
        steps=args.steps,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        min_lr=args.min_lr,
        clip_grad_norm=args.clip_grad_norm,
        dtype=RUN_DTYPES[args.dtype] if args.dtype else plan.training.run_dtype,
        fused_optimizer=plan.training.fused_optimizer,
    )



def _watchdog(progress: Progress, status: RankStatus, run_dir: str | None, timeout_s: float) -> None:
    """End this process if the main thread makes no progress (a hang no peer would see).

    The limit is 2 x the collective timeout during training (peers normally notice first)
    and max(4 x timeout, 300 s) during start-up (imports and model building can be slow).
    """
    while not progress.done:
        limit_s = 2 * timeout_s if progress.training else max(4 * timeout_s, 300.0)
        time.sleep(min(1.0, limit_s / 4))
        idle = time.monotonic() - progress.beat
        if idle > limit_s and not progress.done:
            status.state = "hung"
            status.error = f"no progress for {idle:.0f} s (watchdog limit {limit_s:g} s, see --timeout)"
            write_status(run_dir, status)
            print(f"[rank{status.rank}] error: {status.error} during {status.where()}", file=sys.stderr, flush=True)
            os._exit(EXIT_HUNG)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.worker", description=__doc__.split("\n\n")[0])
    add_worker_args(parser)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    status = RankStatus(rank=rank, pid=os.getpid(), host=socket.gethostname())
    run_dir = args.run_dir
    write_status(run_dir, status)
    progress = Progress()
    threading.Thread(
        target=_watchdog, args=(progress, status, run_dir, args.timeout), daemon=True, name="pipeplan-watchdog"
    ).start()
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
    """Read the plan, build and split the model, check the plan against it, join the process
    group and train."""
    import torch
    import torch.distributed as dist

    from planner.schedules import rank_stages
    from planner.schema import Plan, load_document
    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.plan_check import check_optimizer_supported, check_plan_matches
    from runtime.report import current_rss_bytes

    rss_before_model = current_rss_bytes()  # the interpreter and torch: the report's memory note subtracts it
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    plan: Plan = load_document("plan", args.plan)
    optimizer = args.optimizer or plan.training.optimizer
    check_optimizer_supported(optimizer)
    opts = train_options(args, plan, optimizer)
    fault = Fault.parse(args.inject_fault) if args.inject_fault else None

    from runtime.axes import local_examples, refuse_new_axes
    from runtime.mesh import MeshSpec, split_sharding

    k_deg, v = plan.pipeline_degree, plan.virtual_stages
    # the mesh ("pp", "dp_replicate", "dp_shard", "tp"), pipeline axis outermost:
    # rank = (k * D + d) * T + t
    spec = MeshSpec.of(plan)
    pp_rank, replica, tp_rank = spec.coords(rank) if rank < spec.world_size else (rank, 0, 0)
    my_stages = rank_stages(plan.placement, k_deg, v)[pp_rank % k_deg]  # loop: s % K == rank; V: r and 2K-1-r
    status.stages = my_stages

    backend, device = _device(args, local_rank)
    status.phase = "building the model"
    write_status(args.run_dir, status)
    torch.manual_seed(args.seed)
    entry = load_entrypoint(args.model)
    entry.model.to(device)  # before the split: every unit shares the model's tensors on the device
    # under context parallelism the units are split on this rank's tokens (runtime/axes.py)
    split = split_model(
        entry.model,
        tuple(t.to(device) for t in local_examples(entry.example_inputs, plan, replica)),
        split_points=plan.split_points or None,
        keywords=entry.keywords,
    )
    check_plan_matches(
        plan,
        layer_names=split.names,
        param_bytes=split.param_bytes(),
        sha256=split.sha256(),
        world_size=world,
        optimizer=optimizer,
        dtype=opts.dtype,
    )
    # refuse an axis the runtime cannot execute (naming the layer) before joining the group
    shardings = split_sharding(split, spec)
    refuse_new_axes(split, plan)
    status.phase = "joining the process group"
    write_status(args.run_dir, status)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    try:
        return _train(Job(
            args, plan, entry, split, Coords(rank, world, pp_rank, replica, tp_rank, spec, shardings),
            my_stages, device, backend, opts, fault, status, progress, rss_before_model=rss_before_model,
        ))  # fmt: skip
    finally:
        progress.done = True
        dist.destroy_process_group()


def _device(args: argparse.Namespace, local_rank: int) -> tuple[str, Any]:
    """The backend and this rank's device: nccl on a CUDA device of its own, else gloo on CPU."""
    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = args.backend != "gloo" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise InputError(
            f"--backend nccl needs one CUDA device per rank ({local_world} on this host, "
            f"{torch.cuda.device_count()} visible): use --backend gloo"
        )
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend, device


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
