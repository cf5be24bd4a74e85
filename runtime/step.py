"""One training step of this rank: :func:`train_step`.

Read the step's batch (the ranks that use data read it and check that they agree), run the
plan's schedule over its micro-batches (timing each axis's collectives), finish the gradients
(:mod:`runtime.gradients`: average, tied weights, loss scale, clipping), step the optimizer at
the step's learning rate, save a checkpoint when one is due, and record what the step took
(:class:`runtime.rank_state.StepRecords`; rank 0 writes the ``--log-file`` line).

Its parts: :mod:`runtime.step_data` the step's batch and the readers' agreement
(:func:`read_batch`), :mod:`runtime.step_update` the optimizer step and the checkpoint
(:func:`update`, :func:`save_if_due`); both names are still importable from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from runtime.faults import write_status
from runtime.gradients import average_gradients, clip, sum_tied, unscale
from runtime.rank_state import RankState, StageSet, StepRecords, Training
from runtime.stage_timing import comm_step, last_backward, sync
from runtime.step_data import read_batch as read_batch
from runtime.step_update import save_if_due as save_if_due
from runtime.step_update import update as update
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
