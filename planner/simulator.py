"""Event-level simulator of pipeline schedules.

A schedule is, per pipeline rank, an ordered list of actions (as in
``torch.distributed.pipelining``): ``F`` (forward) or ``B`` (backward) of one stage on one
micro-batch.  Compact text form: ``"2F5"`` is stage 2's forward of micro-batch 5.

The simulator runs those lists with their data dependencies:

* ``F(s, m)`` starts after ``F(s-1, m)`` ends plus the transfer time of boundary ``s-1``;
* ``B(s, m)`` starts after ``F(s, m)`` and, unless ``s`` is the last stage, after
  ``B(s+1, m)`` ends plus the transfer time of boundary ``s`` (gradients of the same size);
* a rank runs one action at a time, in its list's order; transfers overlap computation.

Stage ``s`` runs on rank ``s % K``; with ``v`` chunks per rank (interleaved 1F1B) rank ``r``
holds stages ``r, r+K, ..., r+(v-1)K`` (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", section 2.2).

The result is the exact makespan of that model and each rank's timeline, which the cost
model reports and the Gantt chart draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from planner.schema import Schedule

OpKind = Literal["F", "B"]
EventKind = Literal["forward", "backward", "recompute", "send_forward", "send_backward"]


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: OpKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


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
    #: compute events (forward, recompute, backward) per rank, in time order
    timelines: tuple[tuple[Event, ...], ...]
    #: transfer events, in time order of their start
    transfers: tuple[Event, ...]
    #: most micro-batches whose activations a stage held at once
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


class ScheduleError(ValueError):
    """A schedule that is malformed or cannot run (it deadlocks)."""


def check_schedule_shape(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    """Raise ``ScheduleError`` when the (schedule, K, M, v) combination is not runnable."""
    if num_ranks < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ScheduleError(
            f"K, M and v must be >= 1, got K={num_ranks} M={num_microbatches} v={virtual_stages}"
        )
    if schedule != "interleaved-1f1b" and virtual_stages != 1:
        raise ScheduleError(f"{virtual_stages} chunks per rank need schedule 'interleaved-1f1b', not {schedule!r}")
    if schedule == "1f1b" and num_microbatches < num_ranks:
        raise ScheduleError(
            f"1f1b needs at least as many micro-batches as pipeline stages (the rule of "
            f"torch.distributed.pipelining's Schedule1F1B, which runs the plans): M={num_microbatches} < "
            f"K={num_ranks}; use M >= {num_ranks} or schedule 'gpipe'"
        )
    if schedule == "interleaved-1f1b" and num_microbatches % num_ranks != 0:
        raise ScheduleError(
            f"interleaved-1f1b needs the micro-batch count to be a multiple of the pipeline degree "
            f"(Megatron-LM's rule): M={num_microbatches} is not a multiple of K={num_ranks}; "
            f"use M={num_microbatches + (-num_microbatches) % num_ranks}"
        )


def build_orders(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Per-rank ordered action lists of a schedule (:func:`schedule_orders` as actions)."""
    check_schedule_shape(schedule, num_ranks, num_microbatches, virtual_stages)
    return [
        [Action(s, "B" if is_b else "F", mb) for s, is_b, mb in order]
        for order in schedule_orders(schedule, num_ranks, num_microbatches, virtual_stages)
    ]


def schedule_orders(schedule: Schedule, k: int, m: int, v: int = 1) -> list[list[tuple[int, bool, int]]]:
    """Per-rank ordered actions as ``(stage, backward?, micro-batch)`` tuples.

    * GPipe (Huang et al. 2019): all forwards, then all backwards.
    * 1F1B / PipeDream-Flush (Narayanan et al. 2021): ``K-r-1`` warm-up forwards, then one
      forward and one backward in turn, then the remaining backwards.
    * Interleaved 1F1B (Megatron-LM): micro-batches in groups of K go through chunk 0, then
      chunk 1, ...; backwards visit the chunks in reverse; ``(K-r-1)·2 + (v-1)·K`` warm-up
      forwards, then 1F1B.
    """
    if schedule == "gpipe":
        return [[(r, False, i) for i in range(m)] + [(r, True, i) for i in range(m)] for r in range(k)]
    out = []
    for r in range(k):
        if schedule == "1f1b":
            fwd = [(r, False, i) for i in range(m)]
            bwd = [(r, True, i) for i in range(m)]
            warmup = min(k - r - 1, m)
        else:
            fwd, bwd = [], []
            for i in range(m * v):
                group, within = divmod(i, k * v)
                chunk = (i // k) % v
                mb = group * k + within % k
                fwd.append((chunk * k + r, False, mb))
                bwd.append(((v - 1 - chunk) * k + r, True, mb))
            warmup = min((k - r - 1) * 2 + (v - 1) * k, m * v)
        order = fwd[:warmup]
        f = warmup
        for b in range(len(bwd)):
            if f < len(fwd):
                order.append(fwd[f])
                f += 1
            order.append(bwd[b])
        out.append(order)
    return out


def format_orders(orders: Sequence[Sequence[Action]]) -> str:
    """Compact text form, one rank a line: ``rank 0: 0F0 0F1 0B0 ...``."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(orders))


def simulate(
    orders: Sequence[Sequence[Action]],
    forward_ms: Sequence[float],
    backward_ms: Sequence[float],
    *,
    recompute_ms: Sequence[float] | None = None,
    transfer_ms: Sequence[float] | None = None,
) -> Simulation:
    """Run per-rank action lists and return the makespan and timelines.

    ``forward_ms[s]``, ``backward_ms[s]``: one micro-batch on stage ``s`` (backward without
    recompute); ``recompute_ms[s]``: the extra forward a recomputing stage runs right before
    each backward; ``transfer_ms[s]``: the time to move a micro-batch's activations across
    boundary ``s -> s+1`` (and its gradients back).
    """
    num_ranks = len(orders)
    num_stages = len(forward_ms)
    if len(backward_ms) != num_stages:
        raise ScheduleError(f"{len(backward_ms)} backward times for {num_stages} stages")
    recompute = list(recompute_ms) if recompute_ms is not None else [0.0] * num_stages
    transfer = list(transfer_ms) if transfer_ms is not None else [0.0] * max(0, num_stages - 1)
    if len(recompute) != num_stages or len(transfer) != max(0, num_stages - 1):
        raise ScheduleError(
            f"need {num_stages} recompute times and {num_stages - 1} transfer times, got "
            f"{len(recompute)} and {len(transfer)}"
        )
    if num_stages % num_ranks != 0:
        raise ScheduleError(f"{num_stages} stages do not spread evenly over {num_ranks} ranks")

    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
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
                if s % num_ranks != r:
                    raise ScheduleError(f"action {a} is listed on rank {r} but stage {s} runs on rank {s % num_ranks}")
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
                    if s < last:
                        transfers.append(
                            Event(r, "send_forward", s, mb, end, end + transfer[s], peer=(s + 1) % num_ranks)
                        )
                    inflight[s] += 1
                    peak[s] = max(peak[s], inflight[s])
                else:
                    if (s, mb) not in f_end:
                        break
                    ready = f_end[(s, mb)]
                    if s < last:
                        if (s + 1, mb) not in b_end:
                            break
                        ready = max(ready, b_end[(s + 1, mb)] + transfer[s])
                    start = max(free[r], ready)
                    if recompute[s] > 0:
                        timelines[r].append(Event(r, "recompute", s, mb, start, start + recompute[s]))
                    end = start + recompute[s] + backward_ms[s]
                    b_end[(s, mb)] = end
                    timelines[r].append(Event(r, "backward", s, mb, start + recompute[s], end))
                    if s > 0:
                        transfers.append(
                            Event(r, "send_backward", s, mb, end, end + transfer[s - 1], peer=(s - 1) % num_ranks)
                        )
                    inflight[s] -= 1
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][pos[r]]) for r in range(num_ranks) if pos[r] < len(orders[r])}
            raise ScheduleError(f"the schedule deadlocks: ranks wait on each other at {stuck}")

    _check_complete(orders, num_stages, f_end, b_end)
    makespan = max(free) if free else 0.0
    transfers.sort(key=lambda e: (e.start_ms, e.rank))
    return Simulation(
        makespan_ms=makespan,
        timelines=tuple(tuple(t) for t in timelines),
        transfers=tuple(transfers),
        peak_inflight=tuple(peak),
    )


def _check_complete(
    orders: Sequence[Sequence[Action]],
    num_stages: int,
    f_end: dict[tuple[int, int], float],
    b_end: dict[tuple[int, int], float],
) -> None:
    mbs = {a.microbatch for o in orders for a in o}
    for s in range(num_stages):
        for mb in mbs:
            if (s, mb) not in f_end or (s, mb) not in b_end:
                raise ScheduleError(f"stage {s} never runs the forward and backward of micro-batch {mb}")
    count = sum(len(o) for o in orders)
    if count != 2 * num_stages * len(mbs):
        raise ScheduleError(f"{count} actions for {num_stages} stages x {len(mbs)} micro-batches: some repeat")


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
) -> Simulation:
    """Build the schedule's action lists and simulate them."""
    orders = build_orders(schedule, num_ranks, num_microbatches, virtual_stages)
    return simulate(orders, forward_ms, backward_ms, recompute_ms=recompute_ms, transfer_ms=transfer_ms)


# --------------------------------------------------------------------------- fast path


@dataclass(frozen=True)
class CompiledSchedule:
    """A schedule as a flat program: every action once, in an order where its dependencies
    come first, with the indices :func:`makespans` reads.

    Action ``i`` runs on rank ``r`` and starts after ``max(free[r], end[dep_a] + x[xa],
    end[dep_b] + x[xb])``; it lasts ``dur[di]`` (``di`` indexes forward times, then backward
    times).  Missing dependencies point at a sentinel slot (index ``len(program)``) that ends
    at time 0, with the zero transfer that pads the transfer list (index ``stages - 1``).
    """

    program: tuple[tuple[int, int, int, int, int, int], ...]
    num_ranks: int
    num_stages: int
    num_microbatches: int


def compile_schedule(schedule: Schedule, k: int, m: int, v: int = 1) -> CompiledSchedule:
    """The schedule's flat program (checks the shape like :func:`build_orders`)."""
    check_schedule_shape(schedule, k, m, v)
    orders = schedule_orders(schedule, k, m, v)
    n_stages = k * v
    last = n_stages - 1
    total = sum(len(o) for o in orders)
    sentinel = total
    zero_x = n_stages - 1
    f_idx = [-1] * (n_stages * m)
    b_idx = [-1] * (n_stages * m)
    program: list[tuple[int, int, int, int, int, int]] = []
    pos = [0] * k
    while len(program) < total:
        progressed = False
        for r in range(k):
            order = orders[r]
            p = pos[r]
            while p < len(order):
                s_, is_b, mb = order[p]
                i = len(program)
                if not is_b:
                    if s_ > 0:
                        dep = f_idx[(s_ - 1) * m + mb]
                        if dep < 0:
                            break
                        program.append((r, dep, s_ - 1, sentinel, zero_x, s_))
                    else:
                        program.append((r, sentinel, zero_x, sentinel, zero_x, s_))
                    f_idx[s_ * m + mb] = i
                else:
                    own = f_idx[s_ * m + mb]
                    if own < 0:
                        break
                    if s_ < last:
                        nxt = b_idx[(s_ + 1) * m + mb]
                        if nxt < 0:
                            break
                        program.append((r, own, zero_x, nxt, s_, n_stages + s_))
                    else:
                        program.append((r, own, zero_x, sentinel, zero_x, n_stages + s_))
                    b_idx[s_ * m + mb] = i
                p += 1
                progressed = True
            pos[r] = p
        if not progressed:  # pragma: no cover - schedule_orders gives runnable orders
            raise ScheduleError("the schedule deadlocks")
    return CompiledSchedule(tuple(program), k, n_stages, m)


def makespans(
    cs: CompiledSchedule, fwd: Sequence[float], bwd: Sequence[float], xfer: Sequence[float]
) -> list[float]:
    """Each rank's finish time (``bwd`` includes recompute).

    Same semantics as :func:`simulate` (a rank runs its list in order; a forward waits for
    the previous stage's forward plus the transfer, a backward for its own forward and the
    next stage's backward plus the transfer), without building events: the fast path of
    the planner and of :func:`planner.costmodel.estimate`.
    """
    dur = [*fwd, *bwd]
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
