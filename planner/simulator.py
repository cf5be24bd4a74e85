"""Event-level simulator of pipeline schedules.

A schedule is, per pipeline rank, an ordered list of actions (:mod:`planner.schedules`, the
one definition of every schedule's order): ``F`` (forward), ``B`` (full backward), ``I``
(input gradient) or ``W`` (weight gradient) of one stage on one micro-batch, ``"2I5"`` in
text form.  The simulator runs those lists with their data dependencies:

* ``F(s, m)`` starts after ``F(s-1, m)`` ends plus the transfer time of boundary ``s-1``;
* ``B(s, m)`` and ``I(s, m)`` start after ``F(s, m)`` and, unless ``s`` is the last stage,
  after the gradient of stage ``s+1`` (its ``B`` or ``I``) ends plus the transfer time of
  boundary ``s`` (gradients of the same size); a recomputing stage first runs its forward
  again;
* ``W(s, m)`` starts after ``I(s, m)`` (on the same rank: it sends nothing);
* a rank runs one action at a time, in its list's order; transfers overlap computation.

The stage-to-rank mapping is read from the lists (loop, V and contiguous placements alike).
The result is the exact makespan of that model and each rank's timeline, which the cost
model reports and the Gantt chart draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from planner.schedules import (
    Action,
    ScheduleError,
    check_schedule_shape,
    format_orders,
    placement_of,
    schedule_actions,
    stage_ranks,
    validate_actions,
)
from planner.schema import Schedule

__all__ = [
    "Action",
    "CompiledSchedule",
    "Event",
    "ScheduleError",
    "Simulation",
    "build_orders",
    "check_schedule_shape",
    "compile_actions",
    "compile_schedule",
    "compile_template",
    "format_orders",
    "makespans",
    "simulate",
    "simulate_schedule",
]

EventKind = Literal[
    "forward", "backward", "backward_input", "backward_weight", "recompute", "send_forward", "send_backward"
]
_COMPUTE_KIND: dict[str, EventKind] = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


@dataclass(frozen=True)
class Event:
    """One box of the timeline.  Transfers carry the receiving rank in ``peer``."""

    rank: int
    kind: EventKind
    stage: int
    microbatch: int
    start_ms: float
    end_ms: float
    peer: int | None = None


@dataclass(frozen=True)
class Simulation:
    makespan_ms: float
    #: compute events (forward, recompute, backward, input and weight gradients) per rank, in time order
    timelines: tuple[tuple[Event, ...], ...]
    #: transfer events, in time order of their start
    transfers: tuple[Event, ...]
    #: most micro-batches whose activations a stage held at once (forwarded, not yet through B/I)
    peak_inflight: tuple[int, ...]

    def busy_ms(self, rank: int) -> float:
        return sum(e.end_ms - e.start_ms for e in self.timelines[rank])

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time between 0 and the makespan."""
        if self.makespan_ms <= 0:
            return 0.0
        ranks = len(self.timelines)
        busy = sum(self.busy_ms(r) for r in range(ranks))
        return max(0.0, 1.0 - busy / (ranks * self.makespan_ms))


def build_orders(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Per-rank ordered action lists of a named schedule (:func:`planner.schedules.schedule_actions`)."""
    return schedule_actions(schedule, num_ranks, num_microbatches, virtual_stages)


def simulate(
    orders: Sequence[Sequence[Action]],
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    *,
    recompute_ms: Sequence[float] | None = None,
    transfer_ms: Sequence[float] | None = None,
    input_ms: Sequence[float] | None = None,
    weight_ms: Sequence[float] | None = None,
) -> Simulation:
    """Run per-rank action lists and return the makespan and timelines.

    ``forward_ms[s]``, ``backward_ms[s]``: one micro-batch on stage ``s`` (backward without
    recompute); ``input_ms[s]``, ``weight_ms[s]``: its input- and weight-gradient parts
    (needed when the lists have ``I``/``W``); ``recompute_ms[s]``: the extra forward a
    recomputing stage runs right before each ``B``/``I``; ``transfer_ms[s]``: the time to move
    a micro-batch's activations across boundary ``s -> s+1`` (and its gradients back).
    """
    num_ranks = len(orders)
    num_stages = len(forward_ms)
    if len(backward_ms) != num_stages:
        raise ScheduleError(f"{len(backward_ms)} backward times for {num_stages} stages")
    recompute = list(recompute_ms) if recompute_ms is not None else [0.0] * num_stages
    transfer = list(transfer_ms) if transfer_ms is not None else [0.0] * max(0, num_stages - 1)
    inp, wgt = _split_times(backward_ms, input_ms, weight_ms)
    if len(recompute) != num_stages or len(transfer) != max(0, num_stages - 1):
        raise ScheduleError(
            f"need {num_stages} recompute times and {num_stages - 1} transfer times, got "
            f"{len(recompute)} and {len(transfer)}"
        )
    mbs = {a.microbatch for o in orders for a in o}
    m = max(mbs) + 1 if mbs else 0
    owner = validate_actions(orders, num_stages=num_stages, num_microbatches=m)
    if len(set(owner)) != num_ranks:
        raise ScheduleError(f"the actions use ranks {sorted(set(owner))} of {num_ranks}: every rank needs a stage")

    f_end: dict[tuple[int, int], float] = {}
    g_end: dict[tuple[int, int], float] = {}  # end of B or I: the gradient sent to stage s-1
    pos = [0] * num_ranks
    free = [0.0] * num_ranks
    timelines: list[list[Event]] = [[] for _ in range(num_ranks)]
    transfers: list[Event] = []
    inflight = [0] * num_stages
    peak = [0] * num_stages
    remaining = sum(len(o) for o in orders)
    last = num_stages - 1

    while remaining:
        progressed = False
        for r in range(num_ranks):
            order = orders[r]
            while pos[r] < len(order):
                a = order[pos[r]]
                s, mb = a.stage, a.microbatch
                if a.kind == "F":
                    if s > 0:
                        if (s - 1, mb) not in f_end:
                            break
                        ready = f_end[(s - 1, mb)] + transfer[s - 1]
                    else:
                        ready = 0.0
                    start = max(free[r], ready)
                    end = start + forward_ms[s]
                    f_end[(s, mb)] = end
                    timelines[r].append(Event(r, "forward", s, mb, start, end))
                    if s < last and owner[s + 1] != r:
                        transfers.append(Event(r, "send_forward", s, mb, end, end + transfer[s], peer=owner[s + 1]))
                    inflight[s] += 1
                    peak[s] = max(peak[s], inflight[s])
                elif a.kind == "W":
                    if (s, mb) not in g_end:
                        break  # (validate_actions put the I earlier on this rank)
                    start = max(free[r], g_end[(s, mb)])
                    end = start + wgt[s]
                    timelines[r].append(Event(r, "backward_weight", s, mb, start, end))
                else:
                    if (s, mb) not in f_end:
                        break
                    ready = f_end[(s, mb)]
                    if s < last:
                        if (s + 1, mb) not in g_end:
                            break
                        ready = max(ready, g_end[(s + 1, mb)] + transfer[s])
                    start = max(free[r], ready)
                    if recompute[s] > 0:
                        timelines[r].append(Event(r, "recompute", s, mb, start, start + recompute[s]))
                    end = start + recompute[s] + (backward_ms[s] if a.kind == "B" else inp[s])
                    g_end[(s, mb)] = end
                    timelines[r].append(Event(r, _COMPUTE_KIND[a.kind], s, mb, start + recompute[s], end))
                    if s > 0 and owner[s - 1] != r:
                        transfers.append(
                            Event(r, "send_backward", s, mb, end, end + transfer[s - 1], peer=owner[s - 1])
                        )
                    inflight[s] -= 1
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][pos[r]]) for r in range(num_ranks) if pos[r] < len(orders[r])}
            raise ScheduleError(f"the schedule deadlocks: ranks wait on each other at {stuck}")

    makespan = max(free) if free else 0.0
    transfers.sort(key=lambda e: (e.start_ms, e.rank))
    return Simulation(
        makespan_ms=makespan,
        timelines=tuple(tuple(t) for t in timelines),
        transfers=tuple(transfers),
        peak_inflight=tuple(peak),
    )


def _split_times(
    backward_ms: Sequence[float], input_ms: Sequence[float] | None, weight_ms: Sequence[float] | None
) -> tuple[list[float], list[float]]:
    """The input- and weight-gradient times (half the backward each when not given)."""
    n = len(backward_ms)
    inp = list(input_ms) if input_ms is not None else [b / 2 for b in backward_ms]
    wgt = list(weight_ms) if weight_ms is not None else [b - i for b, i in zip(backward_ms, inp, strict=True)]
    if len(inp) != n or len(wgt) != n:
        raise ScheduleError(f"need {n} input- and weight-gradient times, got {len(inp)} and {len(wgt)}")
    return inp, wgt


def simulate_schedule(
    schedule: Schedule,
    num_ranks: int,
    num_microbatches: int,
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    *,
    virtual_stages: int = 1,
    recompute_ms: Sequence[float] | None = None,
    transfer_ms: Sequence[float] | None = None,
    input_ms: Sequence[float] | None = None,
    weight_ms: Sequence[float] | None = None,
) -> Simulation:
    """Build a named schedule's action lists and simulate them."""
    orders = build_orders(schedule, num_ranks, num_microbatches, virtual_stages)
    return simulate(
        orders, forward_ms, backward_ms, recompute_ms=recompute_ms, transfer_ms=transfer_ms,
        input_ms=input_ms, weight_ms=weight_ms,
    )


# --------------------------------------------------------------------------- fast path


@dataclass(frozen=True)
class CompiledSchedule:
    """A schedule as a flat program: every action once, in an order where its dependencies
    come first, with the indices :func:`makespans` reads.

    Action ``i`` runs on rank ``r`` and starts after ``max(free[r], end[dep_a] + x[xa],
    end[dep_b] + x[xb])``; it lasts ``dur[di]`` (``di`` indexes forward times, then
    backward, input-gradient and weight-gradient times, ``num_stages`` each).  Missing
    dependencies point at a sentinel slot (index ``len(program)``) that ends at time 0, with
    the zero transfer that pads the transfer list (index ``stages - 1``).
    """

    program: tuple[tuple[int, int, int, int, int, int], ...]
    num_ranks: int
    num_stages: int
    num_microbatches: int
    #: stage of each action, rank of each stage
    stage_to_rank: tuple[int, ...] = ()


def compile_schedule(schedule: Schedule, k: int, m: int, v: int = 1) -> CompiledSchedule:
    """A named schedule's flat program (checks the shape like :func:`build_orders`)."""
    return compile_template(schedule, k, m, v, schedule_actions(schedule, k, m, v))


def compile_template(
    schedule: Schedule, k: int, m: int, v: int, orders: Sequence[Sequence[Action]]
) -> CompiledSchedule:
    """:func:`compile_actions` of a named schedule's own lists (``schedule_actions``), which
    are valid by construction (``tests/test_schedules.py`` validates every shape), so the
    stage-to-rank mapping comes from the placement instead of a validation pass."""
    owner = stage_ranks(placement_of(schedule), k, v)
    return compile_actions(orders, k * v, m, owner=owner)


def compile_actions(
    orders: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int, *, owner: Sequence[int] | None = None
) -> CompiledSchedule:
    """Any per-rank action lists as a flat program (:class:`CompiledSchedule`); raises
    :class:`ScheduleError` when they are malformed or deadlock.  ``owner`` (each stage's
    rank) skips the validation for lists known to be valid."""
    m = num_microbatches
    if owner is None:
        owner = validate_actions(orders, num_stages=num_stages, num_microbatches=m)
    k = len(orders)
    n_stages = num_stages
    last = n_stages - 1
    total = sum(len(o) for o in orders)
    sentinel = total
    zero_x = n_stages - 1
    f_idx = [-1] * (n_stages * m)
    g_idx = [-1] * (n_stages * m)  # the B or I that sends stage s's gradient
    program: list[tuple[int, int, int, int, int, int]] = []
    pos = [0] * k
    base = {"B": n_stages, "I": 2 * n_stages, "W": 3 * n_stages}
    while len(program) < total:
        progressed = False
        for r in range(k):
            order = orders[r]
            p = pos[r]
            while p < len(order):
                a = order[p]
                s_, kind, mb = a.stage, a.kind, a.microbatch
                i = len(program)
                if kind == "F":
                    if s_ > 0:
                        dep = f_idx[(s_ - 1) * m + mb]
                        if dep < 0:
                            break
                        program.append((r, dep, s_ - 1, sentinel, zero_x, s_))
                    else:
                        program.append((r, sentinel, zero_x, sentinel, zero_x, s_))
                    f_idx[s_ * m + mb] = i
                elif kind == "W":
                    own = g_idx[s_ * m + mb]
                    if own < 0:
                        break
                    program.append((r, own, zero_x, sentinel, zero_x, base["W"] + s_))
                else:
                    own = f_idx[s_ * m + mb]
                    if own < 0:
                        break
                    if s_ < last:
                        nxt = g_idx[(s_ + 1) * m + mb]
                        if nxt < 0:
                            break
                        program.append((r, own, zero_x, nxt, s_, base[kind] + s_))
                    else:
                        program.append((r, own, zero_x, sentinel, zero_x, base[kind] + s_))
                    g_idx[s_ * m + mb] = i
                p += 1
                progressed = True
            pos[r] = p
        if not progressed:
            stuck = {r: str(orders[r][pos[r]]) for r in range(k) if pos[r] < len(orders[r])}
            raise ScheduleError(f"the schedule deadlocks: ranks wait on each other at {stuck}")
    return CompiledSchedule(tuple(program), k, n_stages, m, tuple(owner))


def makespans(
    cs: CompiledSchedule,
    fwd: Sequence[float],
    bwd: Sequence[float],
    xfer: Sequence[float],
    *,
    binput: Sequence[float] | None = None,
    bweight: Sequence[float] | None = None,
) -> list[float]:
    """Each rank's finish time (``bwd`` and ``binput`` include recompute).

    Same semantics as :func:`simulate` (a rank runs its list in order; a forward waits for
    the previous stage's forward plus the transfer, a backward or input gradient for its own
    forward and the next stage's gradient plus the transfer, a weight gradient for its input
    gradient), without building events: the fast path of the planner and of
    :func:`planner.cost.estimate`.  ``binput``/``bweight`` default to half of ``bwd``
    each (only schedules with ``I``/``W`` read them).
    """
    half = [b / 2 for b in bwd] if binput is None or bweight is None else None
    dur = [*fwd, *bwd, *(binput if binput is not None else half or ()), *(bweight if bweight is not None else half or ())]
    x = [*xfer, 0.0]
    end = [0.0] * (len(cs.program) + 1)
    free = [0.0] * cs.num_ranks
    i = 0
    for r, da, xa, db, xb, di in cs.program:
        t = free[r]
        a = end[da] + x[xa]
        if a > t:
            t = a
        b = end[db] + x[xb]
        if b > t:
            t = b
        t += dur[di]
        end[i] = t
        free[r] = t
        i += 1
    return free
