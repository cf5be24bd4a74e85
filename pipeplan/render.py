"""Human output of a plan: the per-stage table and the summary lines."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from planner.schema import Plan
from planner.units import format_bytes


@dataclass(frozen=True)
class Comparison:
    """Another plan's predicted step time (a baseline), or why it has none."""

    name: str
    step_time_ms: float | None
    note: str = ""


def layer_span(names: Sequence[str]) -> str:
    if len(names) == 1:
        return names[0]
    return f"{names[0]} .. {names[-1]}"


def plan_table(plan: Plan) -> Table:
    table = Table(title=f"{plan.model}: {len(plan.stages)} stages", title_justify="left")
    for col, justify in (
        ("stage", "right"),
        ("layers", "left"),
        ("#", "right"),
        ("params", "right"),
        ("fwd+bwd ms", "right"),
        ("memory / limit", "right"),
        ("recompute", "center"),
        ("devices", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for s in plan.stages:
        ratio = s.memory_bytes / s.memory_limit_bytes if s.memory_limit_bytes else float("inf")
        mem = f"{format_bytes(s.memory_bytes)} / {format_bytes(s.memory_limit_bytes)} ({ratio:.0%})"
        if ratio > 1:
            mem = f"[bold red]{mem}[/]"
        devices = ",".join(str(d) for d in s.devices)
        table.add_row(
            str(s.index),
            f"{s.start}:{s.stop} {layer_span(s.layer_names)}",
            str(s.stop - s.start),
            format_bytes(s.param_bytes),
            f"{s.forward_ms:.2f}+{s.backward_ms:.2f}",
            mem,
            recompute_cell(s.checkpointed_layers, s.stop - s.start, selective=plan.selective_recompute),
            devices if len(devices) <= 24 else devices[:21] + "...",
        )
    return table


def recompute_cell(checkpointed: int, layers: int, *, selective: bool = False) -> str:
    """A stage's recompute: every layer checkpointed, the first N of its layers, selective, or none."""
    if checkpointed >= layers > 0:
        return "all layers"
    if checkpointed > 0:
        return f"first {checkpointed} of {layers}"
    return "selective" if selective else "no"


def memory_table(plan: Plan) -> Table | None:
    """Per pipeline rank: what its device's predicted peak is made of (None for older plans)."""
    if any(s.memory_parts is None for s in plan.stages):
        return None
    table = Table(title="memory per device at its peak", title_justify="left")
    # the device's memory outside the allocator's peak (CUDA presets): its context and the
    # allocator's fragmentation, and what the device then holds in all
    outside = any(s.memory_parts.context or s.memory_parts.fragmentation for s in plan.stages if s.memory_parts)
    extra = ("context", "fragmentation", "device") if outside else ()
    # the optimizer step's temporaries, where they (not the activations) make a device's peak
    at_step = any(s.memory_parts.optimizer_step for s in plan.stages if s.memory_parts)
    step_col = ("optimizer step",) if at_step else ()
    for col in ("rank", "stages", "parameters", "gradients", "optimizer", "activations", *step_col,
                "ZeRO-3 gathered", "peak", *extra):
        table.add_column(col, justify="left" if col == "stages" else "right")
    k, v = plan.pipeline_degree, plan.virtual_stages
    from planner.schedules import stage_rank

    ranks: dict[int, list[int]] = {}
    for st in plan.stages:
        ranks.setdefault(stage_rank(plan.placement, st.index, k, v), []).append(st.index)
    for r in sorted(ranks):
        st = plan.stages[ranks[r][0]]
        parts = st.memory_parts
        assert parts is not None
        table.add_row(
            str(r), ",".join(map(str, ranks[r])), format_bytes(parts.parameters), format_bytes(parts.gradients),
            format_bytes(parts.optimizer), format_bytes(parts.activations),
            *((format_bytes(parts.optimizer_step),) if at_step else ()), format_bytes(parts.gathered),
            format_bytes(st.memory_bytes),
            *((format_bytes(parts.context), format_bytes(parts.fragmentation),
               format_bytes(st.device_bytes)) if outside else ()),
        )
    return table


def collective_lines(plan: Plan) -> list[str]:
    """The step's communication per axis on the busiest rank (what the plan predicts)."""
    p = plan.predicted
    parts = [
        (name, ms) for name, ms in (
            ("data-parallel gradients after the last backward", p.allreduce_ms),
            ("tensor-parallel collectives", p.tensor_parallel_ms),
            ("ZeRO-2/3 collectives", p.zero_ms),
            ("context-parallel K/V collectives", p.context_parallel_ms),
            ("expert all-to-alls", p.expert_parallel_ms),
            ("pipeline sends and receives", p.pipeline_transfer_ms),
        ) if ms
    ]
    if not parts:
        return []
    return ["communication per step: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in parts)]


def _ratio(a: float, b: float) -> str:
    """``a / b`` as ``1.23x``; a zero denominator (a model that does no work) is shown, not divided."""
    if b > 0:
        return f"{a / b:.2f}x"
    return "1.00x" if a == 0 else "inf x"


def summary_lines(plan: Plan, comparisons: Sequence[Comparison] = ()) -> list[str]:
    p = plan.predicted
    lines = [
        f"schedule {plan.schedule}"
        + (
            f" ({plan.virtual_stages} chunks per device"
            + (", V placement: rank r holds stages r and 2K-1-r" if plan.placement == "v" else "")
            + ")"
            if plan.virtual_stages > 1
            else ""
        )
        + f", pipeline degree K={plan.pipeline_degree}, data-parallel D={plan.data_parallel_degree}"
        + (
            f", tensor-parallel T={plan.tensor_parallel_degree}"
            + (" with sequence parallelism" if plan.sequence_parallel else "")
            if plan.tensor_parallel_degree > 1
            else ""
        )
        + (f", context-parallel C={plan.context_parallel_degree}"
           + (" (ring attention)" if plan.context_attention == "ring" else "")
           if plan.context_parallel_degree > 1 else "")
        + (f", expert-parallel E={plan.expert_parallel_degree}" if plan.expert_parallel_degree > 1 else "")
        + (f", ZeRO-{plan.zero_stage}" if plan.zero_stage else "")
        + (", selective recompute" if plan.selective_recompute else "")
        + (f" ({plan.world_size} devices)" if plan.tensor_parallel_degree * plan.context_parallel_degree > 1 else "")
        + (f", {plan.idle_devices} device(s) idle" if plan.idle_devices else ""),
        f"micro-batches M={plan.num_microbatches} of {plan.microbatch_size} "
        f"(global batch {plan.global_batch_size})"
        + (f", made for {plan.training.dtype}" if plan.training.dtype else ""),
        f"predicted step {p.step_time_ms:.2f} ms, {p.throughput_samples_per_s:.1f} samples/s, "
        f"bubble {p.bubble_fraction:.1%}, {_ratio(p.step_time_ms, p.lower_bound_ms)} the lower bound "
        f"{p.lower_bound_ms:.2f} ms" + (f", all-reduce {p.allreduce_ms:.2f} ms" if p.allreduce_ms else ""),
    ]
    for c in comparisons:
        if c.step_time_ms is None:
            lines.append(f"vs {c.name}: {c.note or 'no plan'}")
        else:
            lines.append(
                f"vs {c.name}: {c.step_time_ms:.2f} ms -> speed-up {_ratio(c.step_time_ms, p.step_time_ms)}"
                + (f" ({c.note})" if c.note else "")
            )
    s = plan.solver
    solver = f"solver: {s.status}"
    if s.status != "given":
        solver += f", gap {s.gap:.2%}, {s.wall_time_s:.2f} s"
    if s.message:
        solver += f" ({s.message})"
    lines.append(solver)
    lines.extend(collective_lines(plan))
    lines.extend(f"note: {note}" for note in plan.notes)
    over = [st.index for st in plan.stages if st.memory_bytes > st.memory_limit_bytes]
    if over:
        lines.append(
            f"[bold red]DOES NOT FIT: stage(s) {', '.join(map(str, over))} exceed their device memory[/]"
        )
    return lines


def make_console() -> Console:
    """A console that does not squeeze tables into 80 columns when output is piped."""
    return Console() if sys.stdout.isatty() else Console(width=150)


def print_plan(plan: Plan, comparisons: Sequence[Comparison] = (), *, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(plan_table(plan))
    memory = memory_table(plan)
    if memory is not None:
        console.print(memory)
    for line in summary_lines(plan, comparisons):
        console.print(line, highlight=False)
