"""The run report: measured against predicted, per step and per stage (torch-free).

Built by rank 0 of the job from what every rank measured, printed as a table and written as
JSON with ``--report``.  The document is :class:`planner.schema.RunReport` (versioned, read
strictly with ``load_document("report", path)``); besides the printed figures it holds the
plan that ran and where each rank's time went (schedule, all-reduces, optimizer, and when each
forward and backward ran), which ``pipeplan calibrate`` fits the cost model to.

This module builds the document (:func:`build_report`); its parts live beside it, and every
public name stays importable from here: :mod:`runtime.report_timeline` (what a rank records and
where its time went), :mod:`runtime.report_rows` (the rows per step and per stage, and how busy
each pipeline rank was), :mod:`runtime.report_collectives` (communication per axis and its note),
:mod:`runtime.report_check` (the ``--check`` verdict), :mod:`runtime.report_text` (the printed
report, reading one back) and :mod:`runtime.report_rss` (process memory and its note).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from planner.schema import (
    REPORT_VERSION,
    CheckReport,
    CollectiveTimes,
    Plan,
    RunReport,
)
from runtime.report_check import CATEGORY_NAMES_SHOWN as CATEGORY_NAMES_SHOWN
from runtime.report_check import check_category_lines as check_category_lines
from runtime.report_check import check_failed_message
from runtime.report_check import check_report as check_report
from runtime.report_collectives import COMM_KEYS, collective_times, collectives_note
from runtime.report_rows import rank_busy, ratio, stage_reports, step_reports
from runtime.report_rss import RSS_NOTE as RSS_NOTE
from runtime.report_rss import (
    RssRow,
    current_rss_bytes,
    parse_rss_note,
    peak_rss_bytes,
    reset_peak_rss,
    rss_note,
)
from runtime.report_text import load_report, render_lines
from runtime.report_timeline import RANK_STEP_ROWS, TIMELINE_CELLS, RankRecord
from runtime.report_timeline import Event as Event
from runtime.report_timeline import where_time_went as _where_time_went

__all__ = [
    "COMM_KEYS",
    "RANK_STEP_ROWS",
    "REPORT_VERSION",
    "TIMELINE_CELLS",
    "CheckReport",
    "CollectiveTimes",
    "RankRecord",
    "RssRow",
    "RunReport",
    "build_report",
    "check_failed_message",
    "collective_times",
    "collectives_note",
    "current_rss_bytes",
    "load_report",
    "parse_rss_note",
    "peak_rss_bytes",
    "render_lines",
    "reset_peak_rss",
    "rss_note",
]


def build_report(
    plan: Plan,
    *,
    model: str,
    step_ms: Sequence[float],
    losses: Sequence[float | None],
    stage_forward_ms: Mapping[int, list[list[float]]],
    stage_backward_ms: Mapping[int, list[list[float]]],
    peak_memory: Mapping[int, int | None],
    backend: str,
    device: str,
    optimizer: str,
    lr: float,
    seed: int,
    threads_per_rank: int | None,
    warmup_steps: int = 1,
    notes: Sequence[str] = (),
    ranks: Sequence[RankRecord] = (),
    collectives: CollectiveTimes | None = None,
) -> RunReport:
    """Assemble the report.  ``stage_*_ms[s][step]`` are per-micro-batch times of stage ``s``.

    Step and stage summaries are medians over the steps after ``warmup_steps`` (all steps
    when there are no others).  ``ranks``: each rank's phases and actions, for the report's
    ``rank_steps`` (the first steps, up to :data:`RANK_STEP_ROWS` rows) and ``timeline`` (the
    first timed steps, up to :data:`TIMELINE_CELLS` cells).
    """
    predicted = plan.predicted.step_time_ms
    warm = warmup_steps if len(step_ms) > warmup_steps else 0
    steps = step_reports(step_ms, losses, predicted, warm)
    timed = [s.measured_ms for s in steps if not s.warmup]
    measured = statistics.median(timed) if timed else None
    stages = stage_reports(plan, stage_forward_ms, stage_backward_ms, peak_memory, warm)
    kept_steps = [i for i, s in enumerate(steps) if not s.warmup]
    busy = rank_busy(plan, step_ms, stage_forward_ms, stage_backward_ms, kept_steps)
    shared, infos, rank_steps, timeline = _where_time_went(plan, ranks, num_steps=len(steps), first_timed=warm)
    return RunReport(
        model=model,
        plan_model=plan.model,
        schedule=plan.schedule,
        pipeline_degree=plan.pipeline_degree,
        data_parallel_degree=plan.data_parallel_degree,
        virtual_stages=plan.virtual_stages,
        num_microbatches=plan.num_microbatches,
        microbatch_size=plan.microbatch_size,
        global_batch_size=plan.global_batch_size,
        world_size=plan.world_size,
        backend=backend,
        device=device,
        optimizer=optimizer,
        lr=lr,
        seed=seed,
        threads_per_rank=threads_per_rank,
        warmup_steps=warm,
        steps=steps,
        stages=stages,
        measured_step_ms=measured,
        predicted_step_ms=predicted,
        ratio=ratio(measured, predicted),
        rank_busy_fraction=busy,
        notes=list(notes),
        plan=plan,
        shared_clock=shared,
        ranks=infos,
        rank_steps=rank_steps,
        timeline=timeline,
        collectives=collectives,
    )
