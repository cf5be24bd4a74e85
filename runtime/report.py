"""The run report: measured against predicted, per step and per stage (torch-free).

Built by rank 0 of the job from what every rank measured, printed as a table and written as
JSON with ``--report``.  The document is :class:`planner.schema.RunReport` (versioned, read
strictly with ``load_document("report", path)``); besides the printed figures it holds the
plan that ran and where each rank's time went (schedule, all-reduces, optimizer, and when each
forward and backward ran), which ``pipeplan calibrate`` fits the cost model to.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.limits import loads_strict
from planner.schedules import stage_rank
from planner.schema import (
    REPORT_VERSION,
    ActionTimes,
    AxisTime,
    CheckCategory,
    CheckReport,
    CollectiveTimes,
    Plan,
    RankInfo,
    RankStep,
    RunReport,
    StageReport,
    StepReport,
    parse_document,
)
from planner.units import format_bytes

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

#: the timeline keeps the first timed steps up to this many micro-batch cells (stage rows x M)
TIMELINE_CELLS = 2**18
#: ``rank_steps`` keeps the first steps up to this many rows (ranks x steps)
RANK_STEP_ROWS = 2**16

#: one action as a rank records it: (op "F", "B", "I" or "W", micro-batch, start, end), seconds on
#: the host clock; a split backward is an "I" (input gradient) and later a "W" (weight gradient)
Event = tuple[str, int, float, float]


@dataclass
class RankRecord:
    """What one rank measured beyond its stage durations (all times on its host's clock, seconds).

    ``phases[step]`` is ``[start, schedule, all-reduce, tied all-reduce, optimizer]`` (start
    as ``time.perf_counter()``, the rest durations); ``events[stage][step]`` lists that stage's
    actions in the step.
    """

    rank: int
    replica: int
    host: str = ""
    stages: list[int] = field(default_factory=list)
    allreduce_bytes: int = 0
    phases: list[list[float]] = field(default_factory=list)
    events: Mapping[int, Sequence[Sequence[Event]]] = field(default_factory=dict)
    #: the rank's index on the pipeline axis (None: from ``rank`` by the plan's mesh layout)
    pipeline_rank: int | None = None


def _ratio(measured: float | None, predicted: float) -> float | None:
    if measured is None or predicted <= 0 or not math.isfinite(measured):
        return None
    return measured / predicted


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


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
    steps = [
        StepReport(
            step=i,
            measured_ms=ms,
            predicted_ms=predicted,
            ratio=_ratio(ms, predicted),
            loss=_finite(losses[i]) if i < len(losses) else None,
            warmup=i < warm,
        )
        for i, ms in enumerate(step_ms)
    ]
    timed = [s.measured_ms for s in steps if not s.warmup]
    measured = statistics.median(timed) if timed else None

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
                forward_ratio=_ratio(fwd, st.forward_ms),
                backward_ratio=_ratio(bwd, st.backward_ms),
                microbatches_timed=n,
                peak_memory_bytes=peak_memory.get(st.index),
                predicted_memory_bytes=st.memory_bytes,
            )
        )
    kept_steps = [i for i, s in enumerate(steps) if not s.warmup]
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
        ratio=_ratio(measured, predicted),
        rank_busy_fraction=busy,
        notes=list(notes),
        plan=plan,
        shared_clock=shared,
        ranks=infos,
        rank_steps=rank_steps,
        timeline=timeline,
        collectives=collectives,
    )


#: what a rank measures of its communication in a step (ms; ``*_calls``: counts): DTensor's
#: redistributions, the data-parallel gradient reduction (all of it: the flat all-reduce after
#: the schedule and DDP's buckets during the last backwards; its part exposed after the
#: backward's last gradient, its part hidden behind the backward, DDP's buckets), the tied-weight
#: sums, FSDP2's all-gathers and reduce-scatters, and the pipeline's transfers (posting and
#: waiting for sends; waiting for receives)
COMM_KEYS = (
    "tensor_parallel_ms", "tensor_parallel_calls", "data_parallel_ms", "data_parallel_exposed_ms",
    "data_parallel_hidden_ms", "data_parallel_buckets", "tied_weights_ms",
    "fsdp_all_gather_ms", "fsdp_reduce_scatter_ms", "fsdp_calls",
    "transfer_send_ms", "transfer_receive_ms", "transfer_calls",
)  # fmt: skip


def collective_times(
    plan: Plan, rows: Sequence[Sequence[Mapping[str, float]]], *, warmup_steps: int = 1
) -> CollectiveTimes | None:
    """The report's ``collectives``: for each axis the plan has, per step the slowest rank's time
    (``rows[rank][step]``, keys of :data:`COMM_KEYS`), the median over the steps after
    ``warmup_steps`` (all steps when there are no others), beside the plan's prediction."""
    n = min((len(r) for r in rows), default=0)
    if n == 0:
        return None
    first = warmup_steps if n > warmup_steps else 0
    # rows without the exposed/hidden split (all of the reduction after the schedule): all exposed
    rows = [
        [{**x, "data_parallel_exposed_ms": x.get("data_parallel_exposed_ms", x.get("data_parallel_ms", 0.0))} for x in r]
        for r in rows
    ]

    def busiest(*keys: str) -> float:
        return float(
            statistics.median(max(sum(r[i].get(k, 0.0) for k in keys) for r in rows) for i in range(first, n))
        )

    def axis(parts: Mapping[str, str], predicted: float | None, calls: str | None = None) -> AxisTime:
        """``parts``: part name -> key; with several, each part is the slowest rank's (by the
        sum) at each step, then the median over the steps."""
        keys = list(parts.values())
        slowest = [max(rows, key=lambda r: sum(r[i].get(k, 0.0) for k in keys)) for i in range(first, n)]
        return AxisTime(
            measured_ms=busiest(*keys),
            predicted_ms=predicted,
            calls=round(busiest(calls)) if calls else None,
            parts_ms={
                name: float(statistics.median(r[i].get(key, 0.0) for r, i in zip(slowest, range(first, n), strict=True)))
                for name, key in parts.items()
            }
            if len(parts) > 1
            else {},
        )

    p = plan.predicted
    d, zero, k = plan.data_parallel_degree, plan.zero_stage, plan.pipeline_degree
    tied = busiest("tied_weights_ms")
    return CollectiveTimes(
        tensor_parallel=axis({"": "tensor_parallel_ms"}, p.tensor_parallel_ms, "tensor_parallel_calls")
        if plan.tensor_parallel_degree > 1
        else None,
        data_parallel=axis(
            {"exposed": "data_parallel_exposed_ms", "hidden": "data_parallel_hidden_ms"},
            p.allreduce_ms,
            "data_parallel_buckets",
        )
        if d > 1
        else None,
        fsdp=axis(
            {"all_gather": "fsdp_all_gather_ms", "reduce_scatter": "fsdp_reduce_scatter_ms"}, p.zero_ms, "fsdp_calls"
        )
        if zero >= 2 and d > 1
        else None,
        pipeline_transfers=axis(
            {"send": "transfer_send_ms", "receive": "transfer_receive_ms"}, p.pipeline_transfer_ms, "transfer_calls"
        )
        if k > 1
        else None,
        tied_weights=axis({"": "tied_weights_ms"}, None) if tied > 0.0 and k > 1 else None,
    )


def collectives_note(plan: Plan, times: CollectiveTimes | None) -> str:
    """The report's ``collectives per step:`` note: each axis measured beside predicted."""
    if times is None:
        return ""

    def pred(a: AxisTime, what: str = "") -> str:
        if a.predicted_ms is None:
            return "the plan predicts none (made before per-axis predictions: plan again to get one)"
        return f"predicted {a.predicted_ms:.2f} ms" + (f" ({what})" if what else "")

    parts = []
    if (a := times.tensor_parallel) is not None:
        parts.append(
            f"tensor-parallel collectives (DTensor's, inside the layers' forward and backward, counted in the "
            f"stage times): measured {a.measured_ms:.2f} ms in {a.calls} redistributions, "
            + pred(a, "every layer's all-reduces, every micro-batch")
        )
    if (a := times.data_parallel) is not None:
        fsdp = plan.zero_stage >= 2
        if a.calls:  # DDP's buckets: bucketed, during the stages' last backwards
            overlap = plan.training.gradient_overlap
            predicted = (
                f"; predicted {a.predicted_ms:.2f} ms, exposed {a.predicted_ms * (1 - overlap):.2f} ms (the plan's "
                f"gradient_overlap {overlap:g})"
                if a.predicted_ms is not None
                else "; " + pred(a)
            )
            parts.append(
                f"data-parallel gradient reduction (DDP, {a.calls} bucket(s) during the last backwards): measured "
                f"{a.measured_ms:.2f} ms, exposed {a.parts_ms.get('exposed', 0.0):.2f} ms after the backward's last "
                f"gradient, hidden {a.parts_ms.get('hidden', 0.0):.2f} ms behind the backward" + predicted
            )
        else:
            parts.append(
                "data-parallel flat all-reduce" + (" of what FSDP2 does not shard" if fsdp else "")
                + f": measured {a.measured_ms:.2f} ms, " + pred(a, "the collective after the step")
            )  # fmt: skip
    if (a := times.fsdp) is not None:
        parts.append(
            f"FSDP2 all-gathers and reduce-scatters (ZeRO {plan.zero_stage}, inside the schedule's forward and "
            f"backward): measured {a.measured_ms:.2f} ms in {a.calls} collectives (all-gathers "
            f"{a.parts_ms.get('all_gather', 0.0):.2f} ms, reduce-scatters "
            f"{a.parts_ms.get('reduce_scatter', 0.0):.2f} ms), "
            + pred(a, "each layer's, every micro-batch, before overlap")
        )
    if (a := times.pipeline_transfers) is not None:
        parts.append(
            f"pipeline transfers (activations and gradients between stages): measured {a.measured_ms:.2f} ms in "
            f"{a.calls} sends and receives (posting them and waiting on sends {a.parts_ms.get('send', 0.0):.2f} "
            f"ms, waiting on receives {a.parts_ms.get('receive', 0.0):.2f} ms; the waits include the peer's "
            "readiness: a receive waits for the peer's compute before it sends, a send may wait for the peer "
            "to post its receive), " + pred(a, "link time of the busiest rank's sends and receives")
        )
    if (a := times.tied_weights) is not None:
        parts.append(f"tied-weight sums between pipeline ranks: measured {a.measured_ms:.2f} ms")
    if not parts:
        return ""
    return (
        "collectives per step: " + "; ".join(parts)
        + "; measured: the slowest rank's time, median after the first step; predicted: the plan's busiest pipeline rank"
    )  # fmt: skip


def _where_time_went(
    plan: Plan, ranks: Sequence[RankRecord], *, num_steps: int, first_timed: int
) -> tuple[bool, list[RankInfo], list[RankStep], list[ActionTimes]]:
    """The report's ``shared_clock``, ``ranks``, ``rank_steps`` and ``timeline``.

    Times become milliseconds after the step's first start over all ranks when every rank
    ran on one host (one clock), else after each rank's own start."""
    from runtime.mesh import MeshSpec

    k = plan.pipeline_degree
    spec = MeshSpec.of(plan)  # rank = (k * D + d) * T + t
    hosts = {r.host for r in ranks}
    shared = bool(ranks) and len(hosts) == 1 and "" not in hosts
    origin: list[float | None] = []
    for step in range(num_steps):
        starts = [r.phases[step][0] for r in ranks if step < len(r.phases)]
        origin.append(min(starts) if starts else None)
    infos = [
        RankInfo(
            rank=r.rank,
            replica=r.replica,
            pipeline_rank=r.pipeline_rank
            if r.pipeline_rank is not None
            else (spec.coords(r.rank)[0] if r.rank < spec.world_size else r.rank % k),
            host=r.host,
            stages=list(r.stages),
            allreduce_bytes=r.allreduce_bytes,
        )
        for r in ranks
    ]
    rank_steps = []
    rows = min(num_steps, max(first_timed + 1, RANK_STEP_ROWS // max(1, len(ranks))))
    for r in ranks:
        for step, ph in enumerate(r.phases[:rows]):
            base = origin[step] if shared else ph[0]
            rank_steps.append(
                RankStep(
                    rank=r.rank,
                    step=step,
                    start_ms=(ph[0] - (base if base is not None else ph[0])) * 1e3,
                    schedule_ms=max(0.0, ph[1] * 1e3),
                    allreduce_ms=max(0.0, ph[2] * 1e3),
                    tied_ms=max(0.0, ph[3] * 1e3),
                    optimizer_ms=max(0.0, ph[4] * 1e3),
                )
            )
    m = plan.num_microbatches
    rows_per_step = max(1, sum(len(r.events) for r in ranks))
    keep = max(1, TIMELINE_CELLS // (rows_per_step * m))
    timeline = []
    for step in range(first_timed, min(num_steps, first_timed + keep)):
        for r in ranks:
            if step >= len(r.phases):
                continue
            base = origin[step] if shared else r.phases[step][0]
            if base is None:
                continue
            for stage in sorted(r.events):
                per_step = r.events[stage]
                if step >= len(per_step):
                    continue
                row = _action_row(per_step[step], m, base)
                if row is not None:
                    timeline.append(ActionTimes(stage=stage, replica=r.replica, step=step, **row))
    return shared, infos, rank_steps, timeline


def _action_row(events: Sequence[Event], m: int, base: float) -> dict[str, list[float]] | None:
    """One stage's actions in one step as lists indexed by micro-batch (``None`` when some
    micro-batch has no forward or no backward)."""
    out: dict[str, list[float | None]] = {
        "forward_start_ms": [None] * m,
        "forward_ms": [None] * m,
        "backward_start_ms": [None] * m,
        "backward_ms": [None] * m,
    }
    weight: list[float] = [0.0] * m
    for op, mb, start, end in events:
        if not 0 <= mb < m:
            return None
        if op == "W":  # a split backward: its duration is I + W, its start the I's
            weight[mb] += max(0.0, (end - start) * 1e3)
            continue
        kind = "forward" if op == "F" else "backward"
        out[f"{kind}_start_ms"][mb] = (start - base) * 1e3
        out[f"{kind}_ms"][mb] = max(0.0, (end - start) * 1e3)
    for mb, w in enumerate(weight):
        ms = out["backward_ms"][mb]
        if w and ms is not None:
            out["backward_ms"][mb] = ms + w
    if any(x is None for values in out.values() for x in values):
        return None
    return {key: [float(x) for x in values if x is not None] for key, values in out.items()}


def check_report(
    *,
    passed: bool,
    tolerance: float,
    max_loss_rel_diff: float,
    max_param_rel_diff: float,
    worst_param: str,
    params_compared: int,
    losses_pipelined: Sequence[float | None],
    losses_reference: Sequence[float | None],
    max_grad_rel_diff: float | None = None,
    worst_grad: str = "",
    categories: Sequence[Any] = (),
    grad_tolerance: float | None = None,
) -> CheckReport:
    """The ``--check`` verdict as the report holds it (non-finite figures become ``None``);
    ``categories``: :class:`runtime.training.Category` (or anything with its fields)."""
    return CheckReport(
        passed=passed,
        tolerance=tolerance,
        max_loss_rel_diff=_finite(max_loss_rel_diff),
        max_param_rel_diff=_finite(max_param_rel_diff),
        worst_param=worst_param,
        params_compared=params_compared,
        losses_pipelined=[_finite(x) for x in losses_pipelined],
        losses_reference=[_finite(x) for x in losses_reference],
        max_grad_rel_diff=_finite(max_grad_rel_diff) if max_grad_rel_diff is not None else None,
        worst_grad=worst_grad,
        grad_tolerance=grad_tolerance,
        categories=[
            CheckCategory(
                name=c.name, measure=c.measure, compared=c.compared, max_diff=_finite(c.max_diff), worst=c.worst,
                tensors=list(c.tensors),
            )
            for c in categories
        ],
    )


def check_failed_message(check: CheckReport) -> str:
    """The one ``error:`` line of a failed ``--check``: the largest difference in losses,
    gradients and parameters (worst tensors), the tolerance, and what to do."""
    loss, grad, param = ("n/a" if x is None else f"{x:.3g}" for x in
                         (check.max_loss_rel_diff, check.max_grad_rel_diff, check.max_param_rel_diff))  # fmt: skip
    grads = f"{grad} (gradients, worst {check.worst_grad or '-'}), " if check.categories else ""
    grad_tol = f" ({check.grad_tolerance:g} for gradients)" if check.grad_tolerance not in (None, check.tolerance) else ""
    return (
        f"--check failed: the pipelined run differs from the unsplit model by {loss} (losses), {grads}"
        f"{param} (parameters, worst {check.worst_param}), more than the tolerance {check.tolerance:g}{grad_tol}: the "
        "split, the schedule or a reduction computes something else (the report's check lists each category), "
        "or, if the difference is rounding, give a larger --tolerance"
    )


#: how many tensors of an exceptional check category the printed report names
CATEGORY_NAMES_SHOWN = 4


def check_category_lines(check: CheckReport) -> list[str]:
    """One indented line per category of a ``--check`` verdict: what was compared, how many,
    the largest difference and where (the tensors of an exceptional category, the first few)."""
    out = []
    for cat in check.categories:
        where = f" at {cat.worst}" if cat.worst else ""
        line = f"  {cat.name}: {cat.compared} compared, max {_fmt(cat.max_diff, '.2e')}{where} ({cat.measure})"
        if cat.tensors:
            shown = ", ".join(cat.tensors[:CATEGORY_NAMES_SHOWN])
            more = len(cat.tensors) - CATEGORY_NAMES_SHOWN
            line += f"; tensors: {shown}" + (f" and {more} more" if more > 0 else "")
        out.append(line)
    return out


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _recompute_mark(report: RunReport, stage: int) -> str:
    """The ``rc`` column: ``y`` (every layer checkpointed), ``n`` (none), ``s`` (Megatron's
    selective recompute: attention's core in each block), or how many of the stage's first
    layers are checkpointed (a partial recompute)."""
    st = report.plan.stages[stage]
    n = st.checkpointed_layers
    if n == 0:
        return "s" if report.plan.selective_recompute else "n"
    return "y" if n == st.stop - st.start else str(n)


def render_lines(report: RunReport) -> list[str]:
    """The report as plain text lines (two tables and a summary)."""
    out = [
        f"{report.model}: {report.schedule}, K={report.pipeline_degree} x D={report.data_parallel_degree}"
        + (f" x T={report.plan.tensor_parallel_degree}" if report.plan.tensor_parallel_degree > 1 else "")
        + (f", ZeRO {report.plan.zero_stage}" if report.plan.zero_stage else "")
        + (f" (v={report.virtual_stages})" if report.virtual_stages > 1 else "")
        + f", M={report.num_microbatches} x {report.microbatch_size} (global batch "
        f"{report.global_batch_size}), {report.world_size} rank(s), {report.backend} on {report.device}, "
        f"{report.optimizer} lr={report.lr:g}",
        "",
        f"{'step':>4}  {'measured ms':>12}  {'predicted ms':>12}  {'ratio':>6}  {'loss':>12}",
    ]
    for s in report.steps:
        loss = "-" if s.loss is None else f"{s.loss:.6g}"
        mark = " (warm-up)" if s.warmup else ""
        out.append(
            f"{s.step:>4}  {s.measured_ms:>12.2f}  {s.predicted_ms:>12.2f}  {_fmt(s.ratio):>6}  {loss:>12}{mark}"
        )
    mem = any(st.peak_memory_bytes is not None for st in report.stages)
    out += [
        "",
        f"{'stage':>5} {'rank':>4}  {'layers':<28} {'rc':>2}  {'fwd ms/mb':>9} {'pred':>8} {'ratio':>5}  "
        f"{'bwd ms/mb':>9} {'pred':>8} {'ratio':>5}" + ("  peak mem / predicted" if mem else ""),
    ]
    for st in report.stages:
        line = (
            f"{st.index:>5} {st.pipeline_rank:>4}  {st.layers[:28]:<28} {_recompute_mark(report, st.index):>2}  "
            f"{_fmt(st.forward_ms):>9} {st.predicted_forward_ms:>8.2f} {_fmt(st.forward_ratio):>5}  "
            f"{_fmt(st.backward_ms):>9} {st.predicted_backward_ms:>8.2f} {_fmt(st.backward_ratio):>5}"
        )
        if mem:
            peak = "-" if st.peak_memory_bytes is None else format_bytes(st.peak_memory_bytes)
            line += f"  {peak} / {format_bytes(st.predicted_memory_bytes)}"
        out.append(line)
    out += [
        "",
        f"step time: measured {_fmt(report.measured_step_ms)} ms (median after warm-up), predicted "
        f"{report.predicted_step_ms:.2f} ms, measured/predicted {_fmt(report.ratio)}",
    ]
    if any(b is not None for b in report.rank_busy_fraction):
        out.append(
            "compute share of the step: "
            + ", ".join(
                f"rank {r} {b:.0%}" for r, b in enumerate(report.rank_busy_fraction) if b is not None
            )
            + " (the rest: waiting for other stages, communication, optimizer)"
        )
    if report.check is not None:
        c = report.check
        verdict = "PASSED" if c.passed else "FAILED"
        grads = (
            f"{_fmt(c.max_grad_rel_diff, '.2e')} in gradients (worst {c.worst_grad}), "
            if c.max_grad_rel_diff is not None
            else ""
        )
        out.append(
            f"check {verdict}: vs the unsplit model in one process, max relative difference "
            f"{_fmt(c.max_loss_rel_diff, '.2e')} in losses, {grads}{_fmt(c.max_param_rel_diff, '.2e')} in "
            f"{c.params_compared} parameter tensors (worst {c.worst_param}; tolerance {c.tolerance:g}"
            + (f", {c.grad_tolerance:g} for gradients" if c.grad_tolerance not in (None, c.tolerance) else "")
            + ")"
        )
        out.extend(check_category_lines(c))
    out.extend(f"note: {n}" for n in report.notes)
    return out


def load_report(text: str | bytes, *, source: str = "") -> RunReport:
    """Read a report strictly (no NaN or Infinity) and validate it against the schema."""
    report: RunReport = parse_document("report", loads_strict(text, what=f"report {source}".strip()), source=source)
    return report



# ---- process memory (CPU runs have no allocator figure: the resident set stands in for it)

#: the note's opening words; :func:`parse_rss_note` finds the note by them
RSS_NOTE = "resident set per rank"
_MIB = 1 << 20
_RSS_ROW = re.compile(
    r"rank (\d+) \[stages ([\d,]+)\]: ([\d.]+) MiB peak (in training|of the run) "
    r"\(([\d.]+|\?) MiB at the first step, ([\d.]+|\?) MiB before the model\)"
)


@dataclass(frozen=True)
class RssRow:
    """One rank's resident set (bytes): its peak in training (from the first step on, where
    the peak can be reset; else over the whole run), its size at the first step (the model,
    its stages and the process group built) and just before it built the model (the
    interpreter, torch and the launcher's share)."""

    rank: int
    stages: tuple[int, ...]
    peak_bytes: int
    first_step_bytes: int | None
    before_model_bytes: int | None
    peak_in_training: bool = True


def current_rss_bytes() -> int | None:
    """This process's resident set now (Linux ``/proc/self/statm``); None where there is none."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def reset_peak_rss() -> bool:
    """Start this process's peak resident set again from now (Linux ``clear_refs`` 5, which
    resets ``VmHWM``); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int | None:
    """This process's peak resident set so far: Linux ``VmHWM`` (which counts the resident set
    now, where ``getrusage`` may lag it), else ``getrusage``; None where there is neither."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB elsewhere


def _mib(x: int | None) -> str:
    return "?" if x is None else f"{x / _MIB:.1f}"


def rss_note(rows: Sequence[RssRow]) -> str:
    """The report's note on every rank's resident set (read back by :func:`parse_rss_note`)."""
    cells = [
        f"rank {r.rank} [stages {','.join(map(str, r.stages))}]: {_mib(r.peak_bytes)} MiB peak "
        f"{'in training' if r.peak_in_training else 'of the run'} ({_mib(r.first_step_bytes)} MiB at the first "
        f"step, {_mib(r.before_model_bytes)} MiB before the model)"
        for r in sorted(rows, key=lambda r: r.rank)
    ]
    return (
        f"{RSS_NOTE} (whole process; every rank builds and traces the whole model before keeping its "
        "stages): " + "; ".join(cells)
    )


def parse_rss_note(notes: Sequence[str]) -> list[RssRow]:
    """The rows of a report's :func:`rss_note` (MiB rounded to 0.1), [] when the report has none."""
    note = next((n for n in notes if n.startswith(RSS_NOTE)), None)
    if note is None:
        return []

    def size(text: str) -> int | None:
        return None if text == "?" else round(float(text) * _MIB)

    return [
        RssRow(
            rank=int(m.group(1)),
            stages=tuple(int(x) for x in m.group(2).split(",")),
            peak_bytes=round(float(m.group(3)) * _MIB),
            first_step_bytes=size(m.group(5)),
            before_model_bytes=size(m.group(6)),
            peak_in_training=m.group(4) == "in training",
        )
        for m in _RSS_ROW.finditer(note)
    ]
