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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import math
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
from runtime.fault_injection import Fault, drop_gradient
from runtime.faults import CheckFailedError, RankStatus, error_summary, write_status
from runtime.rank_check import check_grad_steps as check_grad_steps
from runtime.rank_check import tolerance as tolerance
from runtime.rank_state import Coords, Job, Progress
from runtime.stage_timing import bucket_rows, comm_step, fold_loss, last_backward, sync
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

    # ---- devices
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


def _train(job: Job) -> int:
    import torch
    import torch.distributed as dist

    from planner.cost import plan_orders
    from planner.schedules import format_actions, schedule_actions
    from runtime._comm_timing import (
        FsdpClock,
        TransferClock,
        timed_fsdp_collectives,
        timed_transfers,
    )
    from runtime._ddp import step_reduction
    from runtime._dtensor_timing import CollectiveClock, timed_redistributions
    from runtime._torch_schedule import build_schedule
    from runtime.data import DataReport, DataSource, judge, loads_data
    from runtime.mesh import (
        all_reduce_grad,
        full_gradients,
        full_parameters,
        gradient_norms,
        make_sharded_optimizer,
        reduces_data_gradients,
        squared_grad_norm,
    )
    from runtime.report import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from runtime.results import finish
    from runtime.stages import build_stages, join_mesh
    from runtime.steplog import StepLog, log_step
    from runtime.training import (
        LossScaler,
        autocast,
        clip_coefficient,
        has_nonfinite,
        unique_parameters,
    )

    args, plan, entry, split, coords, my_stages = job.args, job.plan, job.entry, job.split, job.coords, job.my_stages
    device, opts, status, progress = job.device, job.opts, job.status, job.progress
    rss_before_model = job.rss_before_model
    rank, world, pp_rank, replica, tp_rank = coords.rank, coords.world, coords.pp_rank, coords.replica, coords.tp_rank
    spec = coords.spec

    if not os.environ.get("PIPEPLAN_VERBOSE"):
        # the interleaved schedule logs its whole action table when a rank fails; the status
        # file and the launcher's diagnosis say what matters (PIPEPLAN_VERBOSE=1 keeps it)
        for name in ("torch.distributed.pipelining", "torch.distributed.pipelining.schedules"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    # d_deg: the mesh's data axis, D x C (context parallelism folds into it, runtime/mesh.py)
    k_deg, d_deg, t_deg = plan.pipeline_degree, spec.data_parallel_degree, spec.tensor_parallel_degree
    num_stages = len(plan.stages)
    m = plan.num_microbatches
    rank_state = join_mesh(job)  # the DeviceMesh and this rank's pipeline and data groups
    built = build_stages(rank_state)  # this rank's PipelineStage(s), one parallelize step per axis
    mesh, pp_group, dp_group = rank_state.mesh, rank_state.pp_group, rank_state.dp_group
    step_box, streams, my_fault = rank_state.step_box, rank_state.streams, rank_state.my_fault
    axes, stages, modules, timings = built.axes, built.stages, built.modules, built.timings
    tied, not_mine_in_norm, reduction, bucket_mb = built.tied, built.not_mine_in_norm, built.reduction, built.bucket_mb
    clocks, by_ddp, left_to_us, layer_of = built.clocks, built.by_ddp, built.left_to_us, built.layer_of

    scaler = LossScaler(opts.dtype == "float16")
    last_record = timings.get(num_stages - 1)

    def loss_fn(output: Any, target: Any) -> Any:
        t0 = time.perf_counter()
        out = split.rebuild_output(output if isinstance(output, tuple) else (output,))
        with autocast(device, opts.dtype):
            value = entry.loss(out, target) if entry.takes_target else entry.loss(out)
        if last_record is not None:  # the profile counts the loss in the last layer's forward: so do we
            sync(device)
            fold_loss(last_record, step_box[0], t0, time.perf_counter())
        return value * scaler.scale if scaler.enabled else value

    # what runs is the plan's action list (planner/schedules.py made it; the prediction timed
    # it): a public torch class when the list is its order, else torch's action-list runtime.
    # scale_grads=False: the schedules divide each stage's gradients by M, which would divide
    # a weight shared by two stages of this rank twice; we divide every parameter once below
    actions = [line.split() for line in format_actions(plan_orders(plan))]
    template = (
        [
            line.split()
            for line in format_actions(
                schedule_actions(plan.schedule, k_deg, m, plan.virtual_stages)
            )
        ]
        if plan.schedule != "planned"
        else None
    )
    schedule, _runner = build_schedule(plan.schedule, stages, actions, template, m, loss_fn=loss_fn)
    params = unique_parameters(modules)
    # a rank whose stages hold no parameter (a Tanh alone) has nothing to update; ZeRO 1: each
    # replica keeps the optimizer state of its share
    opt = make_sharded_optimizer(opts.optimizer, params, lr=opts.lr, spec=spec, mesh=mesh) if params else None
    # this rank's parameters by the model's names (a tied weight's copies on this rank: one entry)
    named = list(
        {
            name: p
            for s in my_stages
            for u in range(plan.stages[s].start, plan.stages[s].stop)
            for name, p in split.units[u].named_parameters()
        }.items()
    )
    first_step = 0
    if args.resume:
        from runtime.checkpoint import load_checkpoint

        status.phase = "loading the checkpoint"
        write_status(args.run_dir, status)
        resumed = load_checkpoint(
            args.resume, named, opt, model=args.model, sha256=split.sha256(), optimizer_name=opts.optimizer
        )
        first_step = resumed.step
        scaler.restore(resumed.loss_scale, resumed.loss_scale_good_steps)
        if first_step >= args.steps:
            raise InputError(f"--resume {args.resume}: its checkpoint is at step {first_step}; give --steps above it")
    has_first = 0 in my_stages
    has_last = (num_stages - 1) in my_stages
    b = plan.microbatch_size

    # ---- data: only the ranks that use it read it (first stage: inputs; last: targets)
    source = DataSource.of(entry, global_batch_size=plan.global_batch_size, steps=args.steps, seed=args.seed)
    reads = loads_data(source.kind, has_first=has_first, has_last=has_last, takes_target=entry.takes_target)
    # the samples this rank reads: its replica's (the context-parallel ranks of one replica read the same)
    data_replica, data_replicas = axes.data_shard(replica, d_deg)
    reader = source.open(data_replica, data_replicas) if reads else None
    if reader is not None and source.kind in ("iterable", "per-replica"):
        for s in range(first_step):  # resumed: skip the batches the checkpointed steps trained on
            reader.next(s)
    dummy_target = torch.zeros(m * b, device=device)  # a loss of the output alone ignores it
    warnings: list[str] = []
    log = StepLog(args.log_file) if args.log_file and rank == 0 else None

    step_ms: list[float] = []
    phases: list[list[float]] = []
    last_buckets: tuple[list[Any], tuple[float, float] | None] = ([], None)
    # communication inside the schedule, per axis: DTensor's collectives (T > 1, inside F and B),
    # FSDP2's all-gathers and reduce-scatters (ZeRO 2/3), the pipeline's sends and receives (K > 1)
    tp_clock, fsdp_clock, transfer_clock = CollectiveClock(), FsdpClock(), TransferClock()
    fsdp = spec.zero_stage >= 2 and d_deg > 1
    comm: list[dict[str, float]] = []  # per step: runtime.report.COMM_KEYS
    local_losses: list[float | None] = []
    grad_norms: list[float | None] = []
    # --check: every step's per-tensor gradient norms, and the whole gradients of the first and
    # last steps (runtime.training.compare), on CPU
    grad_steps = check_grad_steps(first_step, args.steps)
    check_norms: dict[int, dict[str, float]] = {}
    check_grads: dict[int, dict[str, Any]] = {}
    skipped: list[bool] = []
    status.state = "running"
    # the resident set with the model, its stages and the process group built; the peak from here on
    rss_first_step, peak_in_training = current_rss_bytes(), reset_peak_rss()
    for step in range(first_step, args.steps):
        status.step = step
        status.phase = "reading data"
        write_status(args.run_dir, status)
        progress.beat = time.monotonic()
        progress.training = True
        step_box[0] = step
        streams.step = step
        shard = None
        if source.kind == "synthetic":
            if reader is not None:
                shard, _ = reader.next(step)
        else:
            report = DataReport(rank, data_replica, None)
            if reader is not None:
                try:
                    shard, fingerprint = reader.next(step)
                    report = DataReport(rank, data_replica, fingerprint)
                except InputError as err:
                    report = DataReport(rank, data_replica, None, str(err))
            reports: list[Any] = [None] * world
            dist.all_gather_object(reports, report)
            error, warning = judge(reports, step=step, per_replica=source.kind == "per-replica")
            if error:
                raise InputError(error)
            if warning and not warnings:
                warnings.append(warning)
        inputs = [axes.local(t.to(device)) for t in shard.inputs] if has_first and shard is not None else []
        target = None
        if has_last:
            targets = shard.targets if entry.takes_target and shard is not None else None
            target = axes.local(targets.to(device)) if targets is not None else dummy_target
        status.phase = "training"
        write_status(args.run_dir, status)
        progress.beat = time.monotonic()
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        losses: list[Any] = []
        scale = scaler.scale
        before = (dataclasses.replace(tp_clock), dataclasses.replace(fsdp_clock), dataclasses.replace(transfer_clock))
        with contextlib.ExitStack() as timers:
            if t_deg > 1:
                timers.enter_context(timed_redistributions(tp_clock))
            if fsdp:
                timers.enter_context(timed_fsdp_collectives(fsdp_clock))
            if k_deg > 1:
                timers.enter_context(timed_transfers(transfer_clock))
            schedule.step(*inputs, target=target, losses=losses)
        sync(device)
        t_schedule = time.perf_counter()
        comm.append(comm_step(before, (tp_clock, fsdp_clock, transfer_clock)))
        buckets = [e for c in clocks for e in c.take()]  # DDP's, during the schedule's last backwards
        ddp_step = step_reduction(buckets)
        # DDP (find_unused_parameters=False) never reduces a bucket holding a weight left without a
        # gradient, and fails the next step obscurely: the splitter keeps no unused weight, so this
        # is a layer the backward did not reach (--inject-fault R:S:skip-layer)
        if by_ddp:
            unused = sorted({layer_of.get(id(p), "?") for p in params if id(p) in by_ddp and p.grad is None})
            if unused:
                raise InputError(
                    f"rank {rank}: a weight of layer(s) {', '.join(unused)} got no gradient in step {step}'s backward; "
                    "torch DDP cannot reduce a stage with unused weights: run with --dp-reduction flat"
                )
        for p in params:
            if p.grad is not None:
                p.grad.div_(m)  # mean over micro-batches, once per tensor
        if my_fault is not None and my_fault.mode == "drop-grad" and step == my_fault.step:
            drop_gradient(params)
        # the flat all-reduce, for what neither FSDP2 (ZeRO 2/3: what it shards) nor DDP (by_ddp)
        # averaged: kept for T > 1 and the split-backward schedules (runtime.mesh.gradient_reduction
        # says why), and under DDP for the weights it leaves out (two stages' of one rank)
        if dp_group is not None:
            mine_to_reduce = [
                p
                for p in params
                if p.grad is not None and not reduces_data_gradients(spec, p) and not axes.owns(p) and id(p) not in by_ddp
            ]
            _allreduce_mean([p.grad for p in mine_to_reduce if not _is_dtensor(p.grad)], dp_group, d_deg)
            for p in mine_to_reduce:
                if _is_dtensor(p.grad):  # tensor-parallel shards: one all-reduce of the local shard each
                    all_reduce_grad(p, dp_group, divide=d_deg)
        axes.reduce_gradients()
        sync(device)
        t_allreduce = time.perf_counter()
        for pg, p in tied:
            if p.grad is None:  # every holder must join the all-reduce
                p.grad = torch.zeros_like(p)
            all_reduce_grad(p, pg)
        sync(device)
        t_tied = time.perf_counter()
        grads = [p.grad for p in params if p.grad is not None]
        skip = False
        if scaler.enabled:  # one decision for the whole job: any rank's inf skips the step everywhere
            for g in grads:
                g.div_(scale)
            flag = torch.tensor([1.0 if has_nonfinite(_local(g) for g in grads) else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            skip = bool(flag.item() > 0)
            scaler.update(skip)
        norm = None
        if (opts.clip_grad_norm is not None or args.log_file) and not skip:  # every rank joins the reduction
            # DTensor gradients (tensor-parallel or FSDP shards) count whole: a collective over their mesh
            part = squared_grad_norm(params, skip=not_mine_in_norm)
            total = torch.tensor(part, dtype=torch.float64, device=device)
            dist.all_reduce(total, group=pp_group)  # replicas (and tp ranks) hold the same whole gradient
            norm = math.sqrt(float(total))
            if opts.clip_grad_norm is not None:
                coef = clip_coefficient(norm, opts.clip_grad_norm)
                for g in grads:
                    g.mul_(coef)
        lr = opts.lr_at(step)
        for group in opt.param_groups if opt is not None else ():
            group["lr"] = lr
        if args.check:  # what the optimizer steps on, against the reference's (DTensors: collectives)
            check_norms[step] = {} if skip else gradient_norms(named)
            if step in grad_steps and not skip:
                check_grads[step] = full_gradients(named)
        if not skip and opt is not None:
            opt.step()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        sync(device)
        t_end = time.perf_counter()
        if args.checkpoint and ((args.every and (step + 1) % args.every == 0) or step + 1 == args.steps):
            from runtime.checkpoint import save_checkpoint

            status.phase = "saving a checkpoint"
            write_status(args.run_dir, status)
            save_checkpoint(
                args.checkpoint, step + 1, named, opt, model=args.model, sha256=split.sha256(),
                plan=f"K={k_deg} D={d_deg} T={t_deg} zero={spec.zero_stage} {plan.schedule}",
                optimizer_name=opts.optimizer, loss_scale=scaler.state(),
            )  # fmt: skip
            progress.beat = time.monotonic()
        step_ms.append((t_end - t0) * 1e3)
        # where the step went, for calibration (runtime/report.py): start on the host's clock,
        # then schedule, data-parallel all-reduce, tied-weight all-reduce, optimizer (ms)
        phases.append([t0, t_schedule - t0, t_allreduce - t_schedule, t_tied - t_allreduce, t_end - t_tied])
        # the data-parallel reduction: what ran after the schedule (all of it exposed) and DDP's
        # buckets (in flight during the last backwards; exposed: after its last gradient was ready)
        after_ms = phases[-1][2] * 1e3
        comm[-1].update(
            data_parallel_ms=after_ms + ddp_step.busy_ms,
            data_parallel_exposed_ms=after_ms + ddp_step.exposed_ms,
            data_parallel_hidden_ms=ddp_step.hidden_ms,
            data_parallel_buckets=ddp_step.buckets,
            tied_weights_ms=phases[-1][3] * 1e3,
        )
        if buckets:
            last_buckets = (buckets, last_backward(timings, step))
        mean_loss = sum(float(x.detach()) for x in losses) / len(losses) / scale if has_last and losses else None
        local_losses.append(mean_loss)
        grad_norms.append(norm)
        skipped.append(skip)
        if args.log_file:
            log_step(log, step, mean_loss, step_ms[-1], lr, norm, scaler.scale if scaler.enabled else None, skip,
                      plan.global_batch_size, world, device)  # fmt: skip
    if log is not None:
        log.close()

    # ---- gather to rank 0
    status.step = None
    status.phase = "gathering results"
    write_status(args.run_dir, status)
    progress.beat = time.monotonic()
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    mine: dict[str, Any] = {
        "rss": (peak_rss_bytes(), rss_first_step, rss_before_model, peak_in_training),
        "rank": rank,
        # the data-parallel replica d (the mesh's data axis folds context parallelism in: d * C + c)
        "replica": data_replica,
        "cp_rank": replica % plan.context_parallel_degree,
        "stages": my_stages,
        "step_ms": step_ms,
        "losses": local_losses,
        "timings": timings,
        "phases": phases,
        "host": socket.gethostname(),
        "tp_rank": tp_rank,
        "mesh": {
            "tp_layers": [u for s in my_stages for u in range(plan.stages[s].start, plan.stages[s].stop) if u in coords.shardings],
            "fsdp": sum(1 for p in params if reduces_data_gradients(spec, p)),
            # layers FSDP2 gathers one by one (runtime.mesh.apply_data_sharding)
            "fsdp_layers": sum(1 for m in modules for u in m.units if _is_fsdp(u)),
            "optimizer": type(opt).__name__ if opt is not None else None,
            # which path reduced the data-parallel gradients (runtime.mesh.gradient_reduction)
            "dp_path": reduction.path,
            "dp_why": reduction.why,
            "dp_bucket_mb": bucket_mb,
            "dp_ddp_tensors": len(by_ddp),
            "dp_left": {why: len(ids) for why, ids in left_to_us.items()},
            "dp_last_buckets": bucket_rows(*last_buckets),
            **axes.report(),  # context- and expert-parallel layers (runtime/axes.py)
        },
        "pipeline_rank": pp_rank,
        "comm": comm,
        "first_step": first_step,
        # what the flat all-reduce after the schedule carries (the phase calibration times)
        "allreduce_bytes": sum(
            _local(p).numel() * p.element_size()
            for p in params
            if not reduces_data_gradients(spec, p) and id(p) not in by_ddp
        )
        if dp_group is not None
        else 0,
        "peak": peak,
        "threads": torch.get_num_threads(),
        "params": None,
        "reads": reads,
        "batches_read": reader.read if reader is not None else 0,
        "grad_norms": grad_norms,
        "skipped": skipped,
        "warnings": warnings,
    }
    if args.check:  # every rank gathers its DTensors whole (a collective); replica 0, tp rank 0 sends them
        full = full_parameters(named)
        if replica == 0 and tp_rank == 0:
            mine["params"] = full
            mine["check_norms"] = check_norms
            mine["check_grads"] = check_grads
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    dist.barrier()
    if rank != 0:
        return 0
    # the report and the single-process reference need no other rank: stop the watchdog
    progress.done = True
    return finish(job, source, gathered)


def _is_fsdp(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(p: Any) -> Any:
    """A parameter's local part (a DTensor's shard)."""
    return p.to_local() if _is_dtensor(p) else p


def _allreduce_mean(grads: list[Any], group: Any, replicas: int) -> None:
    """Average gradients over the data-parallel group, in one flat buffer, after the schedule:
    the path of the plans torch's DDP cannot reduce (:func:`runtime.mesh.gradient_reduction`)."""
    import torch
    import torch.distributed as dist

    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= replicas
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


if __name__ == "__main__":
    sys.exit(main())
