"""A training step's batch: :func:`read_batch`.

The ranks that hold the first or last stage read the step's shard; with a real data source
every rank gathers the readers' fingerprints and checks that the readers of each replica agree
(:func:`runtime.data.judge`). Called by :func:`runtime.step.train_step`.
"""

from __future__ import annotations

from typing import Any

from planner.errors import InputError
from runtime.rank_state import RankState, StageSet, StepRecords, Training


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
