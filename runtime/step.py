"""One training step of this rank: :func:`train_step`.

Read the step's batch (the ranks that use data read it and check that they agree), run the
plan's schedule over its micro-batches (timing each axis's collectives), finish the gradients
(:mod:`runtime.gradients`: average, tied weights, loss scale, clipping), step the optimizer at
the step's learning rate, save a checkpoint when one is due, and record what the step took
(:class:`runtime.rank_state.StepRecords`; rank 0 writes the ``--log-file`` line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from planner.errors import InputError
from runtime.faults import write_status
from runtime.gradients import average_gradients, clip, sum_tied, unscale
from runtime.rank_state import RankState, StageSet, StepRecords, Training
from runtime.stage_timing import comm_step, last_backward, sync
from runtime.steplog import log_step


def train_step(state: RankState, built: StageSet, training: Training, records: StepRecords, step: int) -> None:
    """Step ``step``: data, schedule, gradients, optimizer, checkpoint, records."""
    import torch.distributed as dist

    from runtime._ddp import step_reduction

    job, device = state.job, state.job.device
    job.status.step = step
    _phase(state, "reading data")
    job.progress.training = True
    state.step_box[0] = step
    state.streams.step = step
    inputs, target = read_batch(state, built, training, records, step)
    _phase(state, "training")
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    scale = training.scaler.scale
    tp_clock, fsdp_clock, transfer_clock = training.clocks
    before = (dataclasses.replace(tp_clock), dataclasses.replace(fsdp_clock), dataclasses.replace(transfer_clock))
    losses = run_schedule(state, training, inputs, target)
    sync(device)
    t_schedule = time.perf_counter()
    records.comm.append(comm_step(before, training.clocks))
    buckets = [e for c in built.clocks for e in c.take()]  # DDP's, during the schedule's last backwards
    average_gradients(state, built, training, step)
    sync(device)
    t_allreduce = time.perf_counter()
    sum_tied(built)
    sync(device)
    t_tied = time.perf_counter()
    grads = [p.grad for p in training.params if p.grad is not None]
    skip = unscale(state, training, grads, scale)
    norm = clip(state, built, training, grads, skip)
    lr = update(state, training, records, step, skip)
    sync(device)
    t_end = time.perf_counter()
    save_if_due(state, training, step)
    records.step_ms.append((t_end - t0) * 1e3)
    # where the step went, for calibration (runtime/report.py): start on the host's clock,
    # then schedule, data-parallel all-reduce, tied-weight all-reduce, optimizer (ms)
    records.phases.append([t0, t_schedule - t0, t_allreduce - t_schedule, t_tied - t_allreduce, t_end - t_tied])
    # the data-parallel reduction: what ran after the schedule (all of it exposed) and DDP's
    # buckets (in flight during the last backwards; exposed: after its last gradient was ready)
    ddp_step = step_reduction(buckets)
    after_ms = records.phases[-1][2] * 1e3
    records.comm[-1].update(
        data_parallel_ms=after_ms + ddp_step.busy_ms,
        data_parallel_exposed_ms=after_ms + ddp_step.exposed_ms,
        data_parallel_hidden_ms=ddp_step.hidden_ms,
        data_parallel_buckets=ddp_step.buckets,
        tied_weights_ms=records.phases[-1][3] * 1e3,
    )
    if buckets:
        records.last_buckets = (buckets, last_backward(built.timings, step))
    has_last = (len(state.plan.stages) - 1) in job.my_stages
    mean_loss = sum(float(x.detach()) for x in losses) / len(losses) / scale if has_last and losses else None
    records.losses.append(mean_loss)
    records.grad_norms.append(norm)
    records.skipped.append(skip)
    if job.args.log_file:
        scaler = training.scaler
        log_step(training.log, step, mean_loss, records.step_ms[-1], lr, norm, scaler.scale if scaler.enabled else None,
                 skip, state.plan.global_batch_size, job.coords.world, device)  # fmt: skip


def _phase(state: RankState, phase: str) -> None:
    """Tell the status file and the watchdog what the rank does now."""
    state.job.status.phase = phase
    write_status(state.job.args.run_dir, state.job.status)
    state.job.progress.beat = time.monotonic()


def read_batch(
    state: RankState, built: StageSet, training: Training, records: StepRecords, step: int
) -> tuple[list[Any], Any]:
    """This step's inputs (first stage) and targets (last stage) on the device; every rank
    checks that the readers of each replica read the same (a warning is kept in ``records``)."""
    import torch.distributed as dist

    from runtime.data import DataReport, judge

    job, reader, data_replica = state.job, training.reader, training.data_replica
    shard = None
    if training.source.kind == "synthetic":
        if reader is not None:
            shard, _ = reader.next(step)
    else:
        report = DataReport(job.coords.rank, data_replica, None)
        if reader is not None:
            try:
                shard, fingerprint = reader.next(step)
                report = DataReport(job.coords.rank, data_replica, fingerprint)
            except InputError as err:
                report = DataReport(job.coords.rank, data_replica, None, str(err))
        reports: list[Any] = [None] * job.coords.world
        dist.all_gather_object(reports, report)
        error, warning = judge(reports, step=step, per_replica=training.source.kind == "per-replica")
        if error:
            raise InputError(error)
        if warning and not records.warnings:
            records.warnings.append(warning)
    has_first, has_last = 0 in job.my_stages, (len(state.plan.stages) - 1) in job.my_stages
    inputs = [built.axes.local(t.to(job.device)) for t in shard.inputs] if has_first and shard is not None else []
    target = None
    if has_last:
        targets = shard.targets if job.entry.takes_target and shard is not None else None
        target = built.axes.local(targets.to(job.device)) if targets is not None else training.dummy_target
    return inputs, target


def run_schedule(state: RankState, training: Training, inputs: list[Any], target: Any) -> list[Any]:
    """Run the schedule over the step's micro-batches, timing the communication inside it on
    ``training.clocks``, per axis: DTensor's collectives (T > 1, inside F and B), FSDP2's
    all-gathers and reduce-scatters (ZeRO 2/3), the pipeline's sends and receives (K > 1).
    Returns the last stage's losses."""
    from runtime._comm_timing import timed_fsdp_collectives, timed_transfers
    from runtime._dtensor_timing import timed_redistributions
    from runtime.mesh import loss_parallel_context

    tp_clock, fsdp_clock, transfer_clock = training.clocks
    losses: list[Any] = []
    with contextlib.ExitStack() as timers:
        if state.spec.tensor_parallel_degree > 1:
            timers.enter_context(timed_redistributions(tp_clock))
        if training.fsdp:
            timers.enter_context(timed_fsdp_collectives(fsdp_clock))
        if state.plan.pipeline_degree > 1:
            timers.enter_context(timed_transfers(transfer_clock))
        timers.enter_context(loss_parallel_context(state.spec))  # the vocabulary-parallel loss, forward and backward
        training.schedule.step(*inputs, target=target, losses=losses)
    return losses


def update(state: RankState, training: Training, records: StepRecords, step: int, skip: bool) -> float:
    """Step the optimizer at the step's learning rate (unless the step is skipped); with
    ``--check``, keep what it steps on first.  Returns the learning rate."""
    from runtime.mesh import full_gradients, gradient_norms

    opt = training.opt
    lr: float = state.job.opts.lr_at(step)
    for group in opt.param_groups if opt is not None else ():
        group["lr"] = lr
    if state.job.args.check:  # what the optimizer steps on, against the reference's (DTensors: collectives)
        records.check_norms[step] = {} if skip else gradient_norms(training.named)
        if step in training.grad_steps and not skip:
            records.check_grads[step] = full_gradients(training.named)
    if not skip and opt is not None:
        opt.step()
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    return lr


def save_if_due(state: RankState, training: Training, step: int) -> None:
    """``--checkpoint DIR``: save after every ``--every`` steps and after the last."""
    args, plan, spec = state.job.args, state.plan, state.spec
    if not (args.checkpoint and ((args.every and (step + 1) % args.every == 0) or step + 1 == args.steps)):
        return
    from runtime.checkpoint import save_checkpoint

    state.job.status.phase = "saving a checkpoint"
    write_status(args.run_dir, state.job.status)
    save_checkpoint(
        args.checkpoint, step + 1, training.named, training.opt, model=args.model, sha256=state.job.split.sha256(),
        plan=f"K={plan.pipeline_degree} D={spec.data_parallel_degree} T={spec.tensor_parallel_degree} "
        f"zero={spec.zero_stage} {plan.schedule}",
        optimizer_name=state.job.opts.optimizer, loss_scale=training.scaler.state(),
    )  # fmt: skip
    state.job.progress.beat = time.monotonic()
