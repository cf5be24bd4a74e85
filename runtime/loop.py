"""The training loop of one rank: :func:`prepare`, then :func:`train`.

:func:`prepare` turns the rank's stages into something that trains: the loss (under autocast,
scaled for float16, timed into the last stage's forward), the plan's schedule, the optimizer,
the state of ``--resume``, and the data this rank reads.  :func:`train` runs the steps
(:func:`runtime.step.train_step`) and returns what they measured.
"""

from __future__ import annotations

import time
from typing import Any

from planner.errors import InputError
from runtime.fault_injection import corrupt_restore
from runtime.faults import write_status
from runtime.rank_check import check_grad_steps
from runtime.rank_state import RankState, StageSet, StepRecords, Training
from runtime.stage_timing import fold_loss, sync
from runtime.step import train_step


def prepare(state: RankState, built: StageSet) -> Training:
    """Loss, schedule, optimizer, resumed state and data of this rank."""
    import torch

    from runtime._comm_timing import FsdpClock, TransferClock
    from runtime._dtensor_timing import CollectiveClock
    from runtime.data import DataSource, loads_data
    from runtime.mesh import make_sharded_optimizer
    from runtime.steplog import StepLog
    from runtime.training import LossScaler, unique_parameters

    job, plan, spec = state.job, state.plan, state.spec
    args, opts, split = job.args, job.opts, job.split
    scaler = LossScaler(opts.dtype == "float16")
    schedule = _schedule(state, built, _loss_fn(state, built, scaler))
    params = unique_parameters(built.modules)
    # a rank whose stages hold no parameter (a Tanh alone) has nothing to update; ZeRO 1: each
    # replica keeps the optimizer state of its share
    opt = make_sharded_optimizer(
        opts.optimizer, params, lr=opts.lr, spec=spec, mesh=state.mesh, fused=opts.fused_optimizer
    ) if params else None
    # this rank's parameters by the model's names (a tied weight's copies on this rank: one entry)
    named = list(
        {
            name: p
            for s in job.my_stages
            for u in range(plan.stages[s].start, plan.stages[s].stop)
            for name, p in split.units[u].named_parameters()
        }.items()
    )
    if state.my_fault is not None and state.my_fault.mode == "bad-restore" and not args.resume:
        raise InputError("--inject-fault R:S:bad-restore corrupts what --resume restores: give --resume")
    first_step = _resume(state, named, opt, scaler) if args.resume else 0
    has_first = 0 in job.my_stages
    has_last = (len(plan.stages) - 1) in job.my_stages
    # ---- data: only the ranks that use it read it (first stage: inputs; last: targets)
    source = DataSource.of(job.entry, global_batch_size=plan.global_batch_size, steps=args.steps, seed=args.seed)
    reads = loads_data(source.kind, has_first=has_first, has_last=has_last, takes_target=job.entry.takes_target)
    # the samples this rank reads: its replica's (the context-parallel ranks of one replica read the same)
    data_replica, data_replicas = built.axes.data_shard(job.coords.replica, spec.data_parallel_degree)
    reader = source.open(data_replica, data_replicas) if reads else None
    if reader is not None and source.kind in ("iterable", "per-replica"):
        for s in range(first_step):  # resumed: skip the batches the checkpointed steps trained on
            reader.next(s)
    return Training(
        schedule=schedule,
        params=params,
        opt=opt,
        named=named,
        scaler=scaler,
        first_step=first_step,
        source=source,
        reads=reads,
        data_replica=data_replica,
        reader=reader,
        dummy_target=torch.zeros(plan.num_microbatches * plan.microbatch_size, device=job.device),  # a loss of the output alone ignores it
        log=StepLog(args.log_file) if args.log_file and job.coords.rank == 0 else None,
        clocks=(CollectiveClock(), FsdpClock(), TransferClock()),
        fsdp=spec.zero_stage >= 2 and spec.data_parallel_degree > 1,
        # --check: the steps whose whole gradients are compared (the others: per-tensor norms)
        grad_steps=check_grad_steps(first_step, args.steps),
    )


def train(state: RankState, built: StageSet, training: Training) -> StepRecords:
    """Every step from the first (after ``--resume``: the checkpoint's) to ``--steps``."""
    from runtime.report import current_rss_bytes, reset_peak_rss

    state.job.status.state = "running"
    # the resident set with the model, its stages and the process group built; the peak from here on
    records = StepRecords(rss_first_step=current_rss_bytes(), peak_in_training=reset_peak_rss())
    for step in range(training.first_step, state.job.args.steps):
        train_step(state, built, training, records, step)
    if training.log is not None:
        training.log.close()
    return records


def own_loss(value: Any) -> Any:
    """The loss as a tensor of its own, not a view: torch's split-backward schedules (ZB-H1, ZBV)
    detach the loss in place once the input gradients are taken (``stage_backward_input``),
    which a view refuses ("Can't detach views in-place").  The vocabulary-parallel loss is one
    (``full_tensor()`` of the replicated loss DTensor returns a view of its local tensor), so
    Llama at T > 1 with K > 1 failed its first backward under ZB-H1 and ZBV.  A view is cloned
    (the loss is a scalar); any other value is returned as it is."""
    import torch

    return value.clone() if isinstance(value, torch.Tensor) and value._is_view() else value


def _loss_fn(state: RankState, built: StageSet, scaler: Any) -> Any:
    """The schedule's loss: the model's loss of the rebuilt output, under autocast, times the
    float16 loss scale; timed into the last stage's forward."""
    from runtime.mesh import vocab_parallel_loss
    from runtime.training import autocast

    job, step_box = state.job, state.step_box
    split, entry, device, opts = job.split, job.entry, job.device, job.opts
    last_record = built.timings.get(len(state.plan.stages) - 1)

    def loss_fn(output: Any, target: Any) -> Any:
        t0 = time.perf_counter()

        def loss_of(stage_output: Any) -> Any:
            out = split.rebuild_output(stage_output if isinstance(stage_output, tuple) else (stage_output,))
            with autocast(device, opts.dtype):
                return entry.loss(out, target) if entry.takes_target else entry.loss(out)

        # vocabulary-parallel where the head keeps its logits sharded
        value, sharded = vocab_parallel_loss(loss_of, output)
        value = own_loss(value)
        built.vocab_parallel_losses += sharded
        if last_record is not None:  # the profile counts the loss in the last layer's forward: so do we
            sync(device)
            fold_loss(last_record, step_box[0], t0, time.perf_counter())
        return value * scaler.scale if scaler.enabled else value

    return loss_fn


def _schedule(state: RankState, built: StageSet, loss_fn: Any) -> Any:
    """The plan's schedule over this rank's stages.

    What runs is the plan's action list (planner/schedules.py made it; the prediction timed
    it): a public torch class when the list is its order, else torch's action-list runtime.
    scale_grads=False: the schedules divide each stage's gradients by M, which would divide
    a weight shared by two stages of this rank twice; the step divides every parameter once
    (runtime.gradients.average_gradients)."""
    from planner.cost import plan_orders
    from planner.schedules import format_actions, schedule_actions
    from runtime._torch_schedule import build_schedule

    plan = state.plan
    m = plan.num_microbatches
    actions = [line.split() for line in format_actions(plan_orders(plan))]
    template = (
        [
            line.split()
            for line in format_actions(
                schedule_actions(plan.schedule, plan.pipeline_degree, m, plan.virtual_stages)
            )
        ]
        if plan.schedule != "planned"
        else None
    )
    schedule, _runner = build_schedule(plan.schedule, built.stages, actions, template, m, loss_fn=loss_fn)
    return schedule


def _resume(state: RankState, named: list[tuple[str, Any]], opt: Any, scaler: Any) -> int:
    """``--resume DIR``: load the newest complete checkpoint; the step it is at."""
    from runtime.checkpoint import load_checkpoint

    job, args = state.job, state.job.args
    job.status.phase = "loading the checkpoint"
    write_status(args.run_dir, job.status)
    resumed = load_checkpoint(
        args.resume, named, opt, model=args.model, sha256=job.split.sha256(), optimizer_name=job.opts.optimizer
    )
    first_step: int = resumed.step
    scaler.restore(resumed.loss_scale, resumed.loss_scale_good_steps)
    if first_step >= args.steps:
        raise InputError(f"--resume {args.resume}: its checkpoint is at step {first_step}; give --steps above it")
    if state.my_fault is not None and state.my_fault.mode == "bad-restore":
        corrupt_restore(state.my_fault, first_step, named, opt)
    return first_step
