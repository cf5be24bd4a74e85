"""The run report: measured against predicted, per step and per stage (torch-free).

Built by rank 0 of the job from what every rank measured, printed as a table and written as
JSON with ``--report``.  It is the input of the cost-model accuracy figure.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from planner.schema import Plan
from planner.units import format_bytes

REPORT_VERSION = 1


@dataclass
class StepReport:
    step: int
    measured_ms: float
    predicted_ms: float
    ratio: float
    loss: float | None
    warmup: bool = False


@dataclass
class StageReport:
    index: int
    pipeline_rank: int
    layers: str
    recompute: bool
    forward_ms: float | None
    backward_ms: float | None
    predicted_forward_ms: float
    predicted_backward_ms: float
    forward_ratio: float | None
    backward_ratio: float | None
    microbatches_timed: int
    peak_memory_bytes: int | None
    predicted_memory_bytes: int


@dataclass
class CheckReport:
    passed: bool
    tolerance: float
    max_loss_rel_diff: float
    max_param_rel_diff: float
    worst_param: str
    params_compared: int
    losses_pipelined: list[float]
    losses_reference: list[float]


@dataclass
class RunReport:
    model: str
    plan_model: str
    schedule: str
    pipeline_degree: int
    data_parallel_degree: int
    virtual_stages: int
    num_microbatches: int
    microbatch_size: int
    global_batch_size: int
    world_size: int
    backend: str
    device: str
    optimizer: str
    lr: float
    seed: int
    threads_per_rank: int | None
    steps: list[StepReport]
    stages: list[StageReport]
    measured_step_ms: float
    predicted_step_ms: float
    ratio: float
    #: per pipeline rank: median fraction of the step spent in forward/backward compute
    rank_busy_fraction: list[float | None] = field(default_factory=list)
    check: CheckReport | None = None
    notes: list[str] = field(default_factory=list)
    version: int = REPORT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _ratio(measured: float | None, predicted: float) -> float | None:
    if measured is None or predicted <= 0:
        return None
    return measured / predicted


def build_report(
    plan: Plan,
    *,
    model: str,
    step_ms: Sequence[float],
    losses: Sequence[float | None],
    stage_forward_ms: dict[int, list[list[float]]],
    stage_backward_ms: dict[int, list[list[float]]],
    peak_memory: dict[int, int | None],
    backend: str,
    device: str,
    optimizer: str,
    lr: float,
    seed: int,
    threads_per_rank: int | None,
    warmup_steps: int = 1,
    notes: Sequence[str] = (),
) -> RunReport:
    """Assemble the report.  ``stage_*_ms[s][step]`` are per-micro-batch times of stage ``s``.

    Step and stage summaries are medians over the steps after ``warmup_steps`` (all steps
    when there are no others).
    """
    predicted = plan.predicted.step_time_ms
    steps = [
        StepReport(
            step=i,
            measured_ms=ms,
            predicted_ms=predicted,
            ratio=ms / predicted if predicted > 0 else float("nan"),
            loss=losses[i] if i < len(losses) else None,
            warmup=i < warmup_steps and len(step_ms) > warmup_steps,
        )
        for i, ms in enumerate(step_ms)
    ]
    timed = [s.measured_ms for s in steps if not s.warmup] or [s.measured_ms for s in steps]
    measured = statistics.median(timed) if timed else float("nan")

    def per_mb(values: list[list[float]] | None) -> tuple[float | None, int]:
        if not values:
            return None, 0
        kept = values[warmup_steps:] if len(values) > warmup_steps else values
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
                pipeline_rank=st.index % plan.pipeline_degree,
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
        steps=steps,
        stages=stages,
        measured_step_ms=measured,
        predicted_step_ms=predicted,
        ratio=measured / predicted if predicted > 0 else float("nan"),
        rank_busy_fraction=busy,
        notes=list(notes),
    )


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def render_lines(report: RunReport) -> list[str]:
    """The report as plain text lines (two tables and a summary)."""
    out = [
        f"{report.model}: {report.schedule}, K={report.pipeline_degree} x D={report.data_parallel_degree}"
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
            f"{s.step:>4}  {s.measured_ms:>12.2f}  {s.predicted_ms:>12.2f}  {s.ratio:>6.2f}  {loss:>12}{mark}"
        )
    mem = any(st.peak_memory_bytes is not None for st in report.stages)
    out += [
        "",
        f"{'stage':>5} {'rank':>4}  {'layers':<28} {'rc':>2}  {'fwd ms/mb':>9} {'pred':>8} {'ratio':>5}  "
        f"{'bwd ms/mb':>9} {'pred':>8} {'ratio':>5}" + ("  peak mem / predicted" if mem else ""),
    ]
    for st in report.stages:
        line = (
            f"{st.index:>5} {st.pipeline_rank:>4}  {st.layers[:28]:<28} {'y' if st.recompute else 'n':>2}  "
            f"{_fmt(st.forward_ms):>9} {st.predicted_forward_ms:>8.2f} {_fmt(st.forward_ratio):>5}  "
            f"{_fmt(st.backward_ms):>9} {st.predicted_backward_ms:>8.2f} {_fmt(st.backward_ratio):>5}"
        )
        if mem:
            peak = "-" if st.peak_memory_bytes is None else format_bytes(st.peak_memory_bytes)
            line += f"  {peak} / {format_bytes(st.predicted_memory_bytes)}"
        out.append(line)
    out += [
        "",
        f"step time: measured {report.measured_step_ms:.2f} ms (median after warm-up), predicted "
        f"{report.predicted_step_ms:.2f} ms, measured/predicted {report.ratio:.2f}",
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
        out.append(
            f"check {verdict}: vs the unsplit model in one process, max relative difference "
            f"{c.max_loss_rel_diff:.2e} in losses, {c.max_param_rel_diff:.2e} in {c.params_compared} "
            f"parameter tensors (worst {c.worst_param}; tolerance {c.tolerance:g})"
        )
    out.extend(f"note: {n}" for n in report.notes)
    return out


def load_report(text: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(text)
    return data
