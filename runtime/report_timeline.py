"""Where each rank's time went, for the run report (torch-free): what a rank records
(:class:`RankRecord`, its actions as :data:`Event`) and the report's ``shared_clock``, ``ranks``,
``rank_steps`` and ``timeline`` made from every rank's (:func:`where_time_went`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from planner.schema import ActionTimes, Plan, RankInfo, RankStep

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


def where_time_went(
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
