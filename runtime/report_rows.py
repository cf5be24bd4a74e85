"""The report's measured rows against the plan's predictions (torch-free): one per step
(:func:`step_reports`), one per stage (:func:`stage_reports`), and the fraction of each step
that each pipeline rank spent in its stages' forwards and backwards (:func:`rank_busy`).
Summaries are medians over the steps after the warm-up; :func:`runtime.report.build_report`
puts them in the document.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from planner.schedules import stage_rank
from planner.schema import Plan, StageReport, StepReport
from runtime.report_check import _finite


def ratio(measured: float | None, predicted: float) -> float | None:
    """Measured over predicted; None where either is missing, zero or not finite."""
    if measured is None or predicted <= 0 or not math.isfinite(measured):
        return None
    return measured / predicted


def step_reports(
    step_ms: Sequence[float], losses: Sequence[float | None], predicted: float, warm: int
) -> list[StepReport]:
    """One row per step: its time against the prediction, its loss, whether it warmed up."""
    return [
        StepReport(
            step=i,
            measured_ms=ms,
            predicted_ms=predicted,
            ratio=ratio(ms, predicted),
            loss=_finite(losses[i]) if i < len(losses) else None,
            warmup=i < warm,
        )
        for i, ms in enumerate(step_ms)
    ]


def stage_reports(
    plan: Plan,
    stage_forward_ms: Mapping[int, list[list[float]]],
    stage_backward_ms: Mapping[int, list[list[float]]],
    peak_memory: Mapping[int, int | None],
    warm: int,
) -> list[StageReport]:
    """One row per stage: the median forward and backward per micro-batch after the warm-up
    steps, and its peak memory, against the plan's."""

    def per_mb(values: list[list[float]] | None) -> tuple[float | None, int]:
        if not values:
            return None, 0
        kept = values[warm:] if len(values) > warm else values
        flat = [x for step in kept for x in step]
        return (statistics.median(flat), len(flat)) if flat else (None, 0)

    stages = []
    for st in plan.stages:
        fwd, n = per_mb(stage_forward_ms.get(st.index))
        bwd, _ = per_mb(stage_backward_ms.get(st.index))
        names = st.layer_names
        stages.append(
            StageReport(
                index=st.index,
                pipeline_rank=stage_rank(plan.placement, st.index, plan.pipeline_degree, plan.virtual_stages),
                start=st.start,
                stop=st.stop,
                layers=f"{st.start}:{st.stop} " + (names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"),
                recompute=st.recompute,
                forward_ms=fwd,
                backward_ms=bwd,
                predicted_forward_ms=st.forward_ms,
                predicted_backward_ms=st.backward_ms,
                forward_ratio=ratio(fwd, st.forward_ms),
                backward_ratio=ratio(bwd, st.backward_ms),
                microbatches_timed=n,
                peak_memory_bytes=peak_memory.get(st.index),
                predicted_memory_bytes=st.memory_bytes,
            )
        )
    return stages


def rank_busy(
    plan: Plan,
    step_ms: Sequence[float],
    stage_forward_ms: Mapping[int, list[list[float]]],
    stage_backward_ms: Mapping[int, list[list[float]]],
    kept_steps: Sequence[int],
) -> list[float | None]:
    """Per pipeline rank, the median over ``kept_steps`` of the fraction of the step its
    stages' forwards and backwards took (per data-parallel replica)."""
    busy: list[float | None] = []
    for r in range(plan.pipeline_degree):
        fractions = []
        for i in kept_steps:
            total = 0.0
            for st in plan.stages:
                if st.index % plan.pipeline_degree != r:
                    continue
                for table in (stage_forward_ms, stage_backward_ms):
                    rows = table.get(st.index) or []
                    total += sum(rows[i]) if i < len(rows) else 0.0
            if step_ms[i] > 0:
                fractions.append(total / plan.data_parallel_degree / step_ms[i])
        busy.append(statistics.median(fractions) if fractions else None)
    return busy
