"""A compact text grid of a schedule: one row per pipeline rank, one column per time slot.

Each cell shows what the rank computes during that slot: ``F3`` (forward of micro-batch 3),
``B0`` (backward), ``I0`` / ``W0`` (its input- and weight-gradient halves, in zero-bubble
schedules), ``R1`` (recompute before a backward), or ``.`` (idle: the bubble).  With several
chunks per rank (interleaved, V schedules) the chunk follows after a colon: ``F3:1``.

A slot shows the event that fills most of it, so a 2 ms backward drawn with 1 ms slots takes
two cells, and a slot mostly idle shows ``.``.  Transfers are not drawn: they overlap computation.

Torch-free and matplotlib-free: ``pipeplan show`` prints it in a terminal.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from types import MappingProxyType

from planner.errors import InputError
from planner.schema import Plan
from planner.simulator import Event, Simulation

#: one letter per compute event kind
KIND_LETTER: Mapping[str, str] = MappingProxyType({
    "forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W", "recompute": "R",
})
IDLE = "."


def cell_label(event: Event, *, num_ranks: int, chunked: bool) -> str:
    """``F3`` / ``B0`` / ``I0`` / ``W0`` / ``R1``; ``F3:1`` for chunk 1 of a rank."""
    label = f"{KIND_LETTER[event.kind]}{event.microbatch}"
    if chunked:
        label += f":{event.stage // num_ranks}"
    return label


def default_slot_ms(sim: Simulation, *, max_columns: int) -> float:
    """The shortest compute event, widened so the grid has at most ``max_columns`` columns."""
    durations = [e.end_ms - e.start_ms for t in sim.timelines for e in t if e.end_ms > e.start_ms]
    if not durations or sim.makespan_ms <= 0:
        return 1.0
    slot = min(durations)
    if sim.makespan_ms / slot > max_columns:
        slot = sim.makespan_ms / max_columns
    return slot


def grid_rows(sim: Simulation, *, slot_ms: float) -> list[list[str]]:
    """The cells of each rank's row.

    A cell shows the event that overlaps the slot the longest, or ``.`` when the rank is
    idle for longer than that within the slot (ties go to the event).
    """
    if not slot_ms > 0 or math.isinf(slot_ms):
        raise InputError(f"slot_ms must be a positive number of milliseconds, got {slot_ms}")
    num_ranks = len(sim.timelines)
    chunked = any(e.stage >= num_ranks for t in sim.timelines for e in t)
    columns = max(1, math.ceil(sim.makespan_ms / slot_ms - 1e-9)) if sim.makespan_ms > 0 else 0
    rows: list[list[str]] = []
    for timeline in sim.timelines:
        events = sorted((e for e in timeline if e.end_ms > e.start_ms), key=lambda e: e.start_ms)
        ends = [e.end_ms for e in events]
        row: list[str] = []
        for c in range(columns):
            lo, hi = c * slot_ms, (c + 1) * slot_ms
            best: Event | None = None
            best_overlap = 0.0
            busy = 0.0
            # events on a rank do not overlap: scan those ending after the slot starts
            for e in events[bisect.bisect_right(ends, lo) :]:
                if e.start_ms >= hi:
                    break
                overlap = min(hi, e.end_ms) - max(lo, e.start_ms)
                busy += overlap
                if overlap > best_overlap + 1e-12 * slot_ms:
                    best, best_overlap = e, overlap
            idle = (min(hi, sim.makespan_ms) - lo) - busy
            if best is None or idle > best_overlap + 1e-9 * slot_ms:
                row.append(IDLE)
            else:
                row.append(cell_label(best, num_ranks=num_ranks, chunked=chunked))
        rows.append(row)
    return rows


def text_grid(
    plan_or_simulation: Plan | Simulation,
    *,
    slot_ms: float | None = None,
    max_columns: int = 96,
    header: bool = True,
    legend: bool = True,
) -> str:
    """Render a schedule as text: device (pipeline rank) x time slot.

    ``slot_ms`` defaults to the shortest compute event (so each one gets at least a cell),
    widened to keep at most ``max_columns`` columns.  With ``header`` the first line gives
    the schedule, the slot and the bubble; with ``legend`` the last line explains the cells.
    """
    if isinstance(plan_or_simulation, Plan):
        from planner.cost import simulate_plan

        plan: Plan | None = plan_or_simulation
        sim = simulate_plan(plan_or_simulation)
    else:
        plan = None
        sim = plan_or_simulation
    if max_columns < 1:
        raise InputError(f"max_columns must be >= 1, got {max_columns}")
    slot = slot_ms if slot_ms is not None else default_slot_ms(sim, max_columns=max_columns)
    rows = grid_rows(sim, slot_ms=slot)
    width = max((len(c) for r in rows for c in r), default=1)
    label_width = len(f"rank {len(rows) - 1}")
    lines: list[str] = []
    if header:
        what = ""
        if plan is not None:
            what = f"{plan.schedule} K={plan.pipeline_degree} M={plan.num_microbatches}"
            if plan.virtual_stages > 1:
                what += f" v={plan.virtual_stages}" + (" (V placement)" if plan.placement == "v" else "")
            if plan.tensor_parallel_degree > 1:
                what += f" T={plan.tensor_parallel_degree}" + ("+SP" if plan.sequence_parallel else "")
            if plan.zero_stage:
                what += f" ZeRO-{plan.zero_stage}"
            if plan.selective_recompute:
                what += " selective-recompute"
            what += ", "
        lines.append(
            f"{what}makespan {sim.makespan_ms:.4g} ms, bubble {sim.bubble_fraction:.1%}, "
            f"one column = {slot:.4g} ms"
        )
    for r, row in enumerate(rows):
        cells = " ".join(c.ljust(width) for c in row)
        lines.append(f"{f'rank {r}'.ljust(label_width)} | {cells}".rstrip())
    if legend:
        chunk = ", :c = chunk" if any(":" in c for r in rows for c in r) else ""
        split = any(c[:1] in ("I", "W") for r in rows for c in r)
        parts = "B backward, I input gradient, W weight gradient" if split else "B backward"
        lines.append(f"F forward, {parts}, R recompute, . idle; number = micro-batch{chunk}")
    return "\n".join(lines)
