"""Every pipeline schedule, defined once: per-rank lists of actions over stages and micro-batches.

A schedule is, per pipeline rank, the ordered list of what the rank computes, in the text form
of ``torch.distributed.pipelining`` (``_Action``): ``"2F5"`` is stage 2's forward of
micro-batch 5, ``"2B5"`` its full backward, ``"2I5"`` the input-gradient half of the backward
(what the previous stage waits for) and ``"2W5"`` the weight-gradient half (which nobody waits
for, so zero-bubble schedules use it to fill the bubble).  Recompute is not an action: a stage
that re-materializes runs its forward again right before each ``B``/``I``.

This module is the only place that knows each schedule's order.  The simulator
(:mod:`planner.simulator`) times these lists, the cost model walks them for memory
(:func:`memory_points`), ``pipeplan show`` draws them and writes them as torch's CSV
(:func:`to_csv`), and a plan carries them (``Plan.actions``) so that the runtime executes what
was predicted.

Placements (``stage_rank``): ``loop`` puts stage ``s`` on rank ``s mod K``; ``v`` puts stages
``r`` and ``2K-1-r`` on rank ``r`` (a V: the last stage is back on rank 0); ``contiguous``
puts stages ``r·v .. r·v+v-1`` on rank ``r``.

The schedules (``K`` ranks, ``M`` micro-batches, ``v`` chunks per rank):

* ``gpipe`` (Huang et al. 2019): every forward, then every backward.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): ``K-r-1`` warm-up forwards, then one
  forward and one backward in turn.
* ``interleaved-1f1b`` (Megatron-LM): micro-batches in groups of ``K`` through chunk 0, then
  chunk 1, ...; ``2(K-r-1) + (v-1)K`` warm-up forwards; as torch's ``ScheduleInterleaved1F1B``
  when ``M`` is a multiple of ``K``.
* ``zb-h1`` (Qi et al., ICLR 2024, ZB-H1): 1F1B whose backwards are split, rank ``r`` running
  its weight gradients ``r`` steps late, the last ``r`` at the end; torch's
  ``ScheduleInterleavedZeroBubble`` (ZB1P) with one stage per rank.
* ``interleaved-zb``: the same with ``v`` chunks per rank, exactly torch's
  ``ScheduleInterleavedZeroBubble`` (rounds of ``M // max(1, M // K)`` micro-batches).
* ``zb-h2`` (ZB-H2): up to ``2K-1`` micro-batches in flight on every rank (about twice
  1F1B's memory), ``2(K-r)-1`` warm-up forwards, weight gradients filling every gap: the
  greedy list schedule of :func:`list_schedule` at unit times (``F = I = W``), where the
  paper draws its figure.
* ``zbv`` (ZB-V, Qi et al. 2024): two chunks per rank in the V placement; torch's
  ``ScheduleZBVZeroBubble``.
* ``dualpipev`` (DeepSeek's DualPipe, V variant): two chunks per rank in the V placement,
  ``M >= 2K``; torch's ``ScheduleDualPipeV`` with each overlapped forward+backward pair run
  as its two actions in turn (which is what torch's runtime does with them).
* ``planned``: built by :func:`list_schedule` for the split at hand, with its real
  durations, transfers and memory: a rank runs the input gradient whose gradient has
  arrived, else the next forward if its memory in flight allows, else a weight gradient (the
  filler).  Uneven stages and slow links are what it adapts to.
"""

from __future__ import annotations

import heapq
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import mul
from typing import Any, Literal

from planner.errors import InputError
from planner.schema import SCHEDULE_CHUNKS, SCHEDULE_PLACEMENT, Placement, Schedule

ActionKind = Literal["F", "B", "I", "W"]
ACTION_KINDS: tuple[ActionKind, ...] = ("F", "B", "I", "W")
#: torch.distributed.pipelining's class of each schedule whose order this module reproduces
#: exactly (the runtime may use it instead of loading the action list)
TORCH_CLASSES: dict[Schedule, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
#: schedules whose backward is split into input and weight gradients
SPLIT_BACKWARD: frozenset[Schedule] = frozenset({"zb-h1", "zb-h2", "zbv", "dualpipev", "interleaved-zb", "planned"})

_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


class ScheduleError(InputError):
    """A schedule that is malformed, does not suit its shape, or cannot run (it deadlocks); an
    :class:`~planner.errors.InputError`, so a plan file with a bad action list gets a clear error."""


@dataclass(frozen=True, order=True)
class Action:
    """One computation: ``kind`` of ``stage`` on ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        """``"2I5"`` -> ``Action(2, "I", 5)`` (torch's ``_Action.from_str`` for compute actions)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"action {text!r} is not of the form <stage><F|B|I|W><micro-batch>, e.g. '2F5' or '0W3'"
            )
        return Action(int(match.group(1)), match.group(2), int(match.group(3)))  # type: ignore[arg-type]


Orders = list[list[Action]]


# --------------------------------------------------------------------------- placement


def placement_of(schedule: Schedule) -> Placement:
    return SCHEDULE_PLACEMENT[schedule]


def stage_rank(placement: Placement, stage: int, num_ranks: int, virtual_stages: int) -> int:
    """The rank that runs ``stage`` (see the module doc)."""
    k, v = num_ranks, virtual_stages
    if placement == "loop":
        return stage % k
    if placement == "contiguous":
        return stage // v
    chunk, pos = divmod(stage, k)
    return pos if chunk % 2 == 0 else k - 1 - pos


def stage_ranks(placement: Placement, num_ranks: int, virtual_stages: int) -> list[int]:
    """The rank of every stage."""
    return [stage_rank(placement, s, num_ranks, virtual_stages) for s in range(num_ranks * virtual_stages)]


def rank_stages(placement: Placement, num_ranks: int, virtual_stages: int) -> list[list[int]]:
    """Each rank's stages, in increasing order (its chunk j is ``rank_stages(...)[r][j]``)."""
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for s, r in enumerate(stage_ranks(placement, num_ranks, virtual_stages)):
        out[r].append(s)
    return out


# --------------------------------------------------------------------------- shapes


def check_schedule_shape(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    """Raise :class:`ScheduleError` naming the constraint when (schedule, K, M, v) cannot run."""
    k, m, v = num_ranks, num_microbatches, virtual_stages
    if k < 1 or m < 1 or v < 1:
        raise ScheduleError(f"K, M and v must be >= 1, got K={k} M={m} v={v}")
    chunks = SCHEDULE_CHUNKS[schedule]
    if chunks == "1" and v != 1:
        raise ScheduleError(
            f"{v} chunks per rank need schedule 'interleaved-1f1b' or 'interleaved-zb' (or 2 chunks: "
            f"'zbv', 'dualpipev'), not {schedule!r}, which runs one stage per rank"
        )
    if chunks == "2" and v != 2:
        raise ScheduleError(f"{schedule} runs exactly 2 chunks per rank (the V placement), got v={v}: use v=2")
    if schedule in ("1f1b", "zb-h1") and m < k:
        raise ScheduleError(
            f"{schedule} needs at least as many micro-batches as pipeline stages (the rule of "
            f"torch.distributed.pipelining's Schedule1F1B): M={m} < K={k}; use M >= {k} or schedule "
            f"'gpipe' or 'zb-h2'"
        )
    if schedule == "interleaved-1f1b" and m % k != 0:
        raise ScheduleError(
            f"interleaved-1f1b needs the micro-batch count to be a multiple of the pipeline degree "
            f"(Megatron-LM's rule): M={m} is not a multiple of K={k}; use M={m + (-m) % k}"
        )
    if schedule == "interleaved-zb" and m % max(1, m // k) != 0:
        rounds = max(1, m // k)
        raise ScheduleError(
            f"interleaved-zb runs the micro-batches in max(1, M // K) = {rounds} rounds of equal size "
            f"(torch's ScheduleInterleavedZeroBubble): M={m} is not a multiple of {rounds}; use a "
            f"multiple of K={k}"
        )
    if schedule in ("zbv", "dualpipev") and k < 2:
        raise ScheduleError(f"{schedule} folds the pipeline into a V over K >= 2 ranks, got K={k}")
    if schedule == "dualpipev" and m < 2 * k:
        raise ScheduleError(
            f"dualpipev needs at least as many micro-batches as stages, M >= 2K (torch's "
            f"ScheduleDualPipeV): M={m} < 2K={2 * k}; use M >= {2 * k} or schedule 'zbv'"
        )


# --------------------------------------------------------------------------- templates


def schedule_actions(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Orders:
    """Each rank's actions for a named schedule (not ``planned``, which needs durations:
    :func:`list_schedule`).  Checks the shape first (:func:`check_schedule_shape`)."""
    k, m, v = num_ranks, num_microbatches, virtual_stages
    check_schedule_shape(schedule, k, m, v)
    if schedule == "gpipe":
        return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(k)]
    if schedule == "1f1b":
        return [_one_f_one_b(m, r, k - r - 1) for r in range(k)]
    if schedule == "interleaved-1f1b":
        return [_interleaved_1f1b(k, m, v, r) for r in range(k)]
    if schedule in ("zb-h1", "interleaved-zb"):
        return [_zb1p(k, m, v, r) for r in range(k)]
    if schedule == "zb-h2":
        return zb_h2_actions(k, m)
    if schedule == "zbv":
        return [_zbv(k, m, r) for r in range(k)]
    if schedule == "dualpipev":
        return [_dualpipev(k, m, r) for r in range(k)]
    raise ScheduleError(
        "schedule 'planned' is built for each split by list_schedule (it needs the stages' "
        "durations and memory), not from a template"
    )


def _one_f_one_b(m: int, stage: int, warmup: int) -> list[Action]:
    warmup = min(warmup, m)
    out = [Action(stage, "F", i) for i in range(warmup)]
    f = warmup
    for b in range(m):
        if f < m:
            out.append(Action(stage, "F", f))
            f += 1
        out.append(Action(stage, "B", b))
    return out


def _interleaved_1f1b(k: int, m: int, v: int, r: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (groups of K micro-batches per chunk)."""
    fwd, bwd = [], []
    for i in range(m * v):
        group, within = divmod(i, k * v)
        chunk = (i // k) % v
        mb = group * k + within % k
        fwd.append(Action(chunk * k + r, "F", mb))
        bwd.append(Action((v - 1 - chunk) * k + r, "B", mb))
    warmup = min((k - r - 1) * 2 + (v - 1) * k, m * v)
    out = fwd[:warmup]
    f = warmup
    for b in range(len(bwd)):
        if f < len(fwd):
            out.append(fwd[f])
            f += 1
        out.append(bwd[b])
    return out


def _zb1p(k: int, m: int, v: int, r: int) -> list[Action]:
    """torch's ScheduleInterleavedZeroBubble (ZB1P) on rank ``r``, its None steps dropped.

    Rounds of ``mbpr = M // max(1, M // K)`` micro-batches go through chunk 0, chunk 1, ...;
    ``(v-1)·mbpr + K-1-r`` warm-up forwards; then a forward and an input gradient in turn,
    each input gradient followed, from the ``r``-th on, by the weight gradient of the oldest
    one still pending; the last ``r`` weight gradients at the end.
    """
    rounds = max(1, m // k)
    mbpr = m // rounds
    warmup = min((v - 1) * mbpr + (k - 1 - r), m * v)
    total = m * v
    f_next = [0] * (k * v)
    i_next = [0] * (k * v)
    w_next = [0] * (k * v)
    pending: list[int] = []  # stages of the input gradients, in order, for their weight gradients
    w_done = 0
    out: list[Action] = []

    def f_stage(op: int) -> int:
        return ((op // mbpr) % v) * k + r

    def b_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // mbpr) % v) * k + r

    def emit(stage: int, kind: ActionKind, counter: list[int]) -> None:
        out.append(Action(stage, kind, counter[stage]))
        counter[stage] += 1

    for op in range(total):
        if op < warmup:
            emit(f_stage(op), "F", f_next)
            continue
        emit(f_stage(op), "F", f_next)
        s = b_stage(op)
        emit(s, "I", i_next)
        pending.append(s)
        if op - warmup >= r:
            emit(pending[w_done], "W", w_next)
            w_done += 1
    for op in range(total, total + warmup):
        s = b_stage(op)
        emit(s, "I", i_next)
        pending.append(s)
        if op - warmup >= r:
            emit(pending[w_done], "W", w_next)
            w_done += 1
    while w_done < len(pending):
        emit(pending[w_done], "W", w_next)
        w_done += 1
    return out


def _zbv(k: int, m: int, r: int) -> list[Action]:
    """torch's ScheduleZBVZeroBubble on rank ``r`` (stages ``r`` and ``2K-1-r``)."""
    n = max(2 * k - 1, m)
    s0, s1 = r, 2 * k - 1 - r
    cnt = {(s, kind): 0 for s in (s0, s1) for kind in ACTION_KINDS}
    out: list[Action] = []

    def emit(stage: int, kind: ActionKind, mb: int | None = None) -> None:
        key = (stage, kind)
        i = cnt[key] if mb is None else mb
        out.append(Action(stage, kind, i))
        cnt[key] = i + 1

    for _ in range(2 * (k - r) - 1):
        emit(s0, "F")
    for _ in range(r):
        emit(s1, "F")
        emit(s0, "F")
    for _ in range(k - r):
        emit(s1, "F")
        emit(s1, "I")
        emit(s1, "W")
    while cnt[s1, "F"] < cnt[s0, "F"] or cnt[s0, "F"] < n:
        if cnt[s0, "F"] < n:
            emit(s0, "F")
        emit(s0, "I")
        emit(s0, "W")
        emit(s1, "F")
        emit(s1, "I")
        emit(s1, "W")
    w0, w1 = cnt[s0, "I"], cnt[s1, "I"]
    for _ in range(r):
        emit(s0, "I")
        emit(s1, "I")
    for _ in range(k - r):
        emit(s0, "I")
        emit(s0, "W", w0)
        w0 += 1
    while w1 < cnt[s1, "I"]:
        emit(s1, "W", w1)
        w1 += 1
    while w0 < cnt[s0, "I"]:
        emit(s0, "W", w0)
        w0 += 1
    # torch runs n >= 2K-1 micro-batches and drops those past M
    return [a for a in out if a.microbatch < m]


def _dualpipev(k: int, m: int, r: int) -> list[Action]:
    """torch's ScheduleDualPipeV on rank ``r``, each overlapped forward+backward pair as its
    forward, then its backward."""
    s0, s1 = r, 2 * k - 1 - r
    nxt: dict[tuple[int, str], int] = {}
    weights: deque[tuple[int, int]] = deque()
    out: list[Action] = []

    def add(stage: int, kind: ActionKind) -> None:
        key = (stage, "I" if kind == "B" else kind)
        mb = nxt.get(key, 0)
        out.append(Action(stage, kind, mb))
        nxt[key] = mb + 1
        if kind == "B":
            nxt[stage, "W"] = nxt.get((stage, "W"), 0) + 1
        elif kind == "I":
            weights.append((stage, mb))

    def weight() -> None:
        if weights:
            stage, mb = weights.popleft()
            out.append(Action(stage, "W", mb))

    for _ in range((k - r - 1) * 2):
        add(s0, "F")
    for _ in range(r + 1):
        add(s0, "F")
        add(s1, "F")
    for _ in range(k - r - 1):
        add(s1, "I")
        weight()
        add(s1, "F")
    for _ in range(m - 2 * k + r + 1):
        add(s0, "F")  # overlapped pairs: forward, then backward
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    for _ in range(k - r - 1):
        add(s1, "B")
        add(s1, "F")
        add(s0, "B")
    zb = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            zb = True
        add(s1, "I" if zb else "B")
        if i == steps // 2 and r % 2 == 0:
            zb = True
        add(s0, "I" if zb else "B")
    for _ in range(k - r - 1):
        weight()
        add(s0, "I" if zb else "B")
    for _ in range(r + 1):
        weight()
    return out


def zb_h2_actions(num_ranks: int, num_microbatches: int) -> Orders:
    """ZB-H2: :func:`list_schedule` at unit times (F = I = W = 1, free transfers) with at
    most ``2K-1`` micro-batches (forwarded, or awaiting their weight gradient) on every rank,
    the paper's memory; rank r then warms up with ``2(K-r)-1`` forwards and defers its
    weight gradients to fill the gaps."""
    k, m = num_ranks, num_microbatches
    one = [1.0] * k
    orders, _ = list_schedule(
        m,
        forward_ms=one,
        input_ms=one,
        weight_ms=one,
        transfer_ms=[0.0] * (k - 1),
        held_forward=one,
        held_weight=one,
        live=[0.0] * k,
        capacity=[float(2 * k - 1)] * k,
    )
    return orders


# --------------------------------------------------------------------------- list scheduling


def list_schedule(
    num_microbatches: int,
    *,
    forward_ms: Sequence[float],
    input_ms: Sequence[float],
    weight_ms: Sequence[float],
    transfer_ms: Sequence[float],
    held_forward: Sequence[float],
    held_weight: Sequence[float],
    live: Sequence[float],
    capacity: Sequence[float],
) -> tuple[Orders, float]:
    """A greedy schedule of one stage per rank (stage s on rank s) and its makespan.

    Whenever a rank is free it runs, in this order of preference: the input gradient ``I`` of
    its oldest micro-batch whose gradient has arrived (it unblocks the previous stage); the
    next forward, if its input has arrived and its memory allows; else a weight gradient ``W``
    (the filler: nobody waits for it).  Micro-batches go through each stage in order.

    Memory: a forward holds ``held_forward[s]`` bytes until its input gradient, which holds
    ``held_weight[s]`` until its weight gradient; an input gradient needs ``live[s]`` more
    while it runs (the re-materialized activations of a recomputing stage).  A forward is
    admitted only if, with it, the rank's bytes plus the headroom its own input gradient will
    need stay within ``capacity[s]``; when memory blocks, pending weight gradients run first
    to free it.  So the rank's walk (:func:`memory_points`) stays within ``capacity``, as long
    as one micro-batch fits at all.

    ``input_ms`` includes any recompute.  The makespan is what :mod:`planner.simulator` gives
    for the returned lists (a test checks it).
    """
    k, m = len(forward_ms), num_microbatches
    inf = float("inf")
    free = [0.0] * k  # when each rank finishes its last action
    dec = [0.0] * k  # when each rank next decides
    f_arrive: list[list[float]] = [[0.0] * m if s == 0 else [inf] * m for s in range(k)]
    g_arrive: list[list[float]] = [[inf] * m for _ in range(k)]
    next_f = [0] * k
    next_i = [0] * k
    waiting_w: list[deque[int]] = [deque() for _ in range(k)]
    held = [0.0] * k
    done = [0] * k
    orders: Orders = [[] for _ in range(k)]
    heap = [(0.0, s) for s in range(k)]
    last = k - 1

    def wake(q: int, at: float) -> None:
        t = max(at, free[q])
        if t < dec[q]:
            dec[q] = t
            heapq.heappush(heap, (t, q))

    while heap:
        t, s = heapq.heappop(heap)
        if t != dec[s] or done[s] == 3 * m:
            continue
        # every rank's next decision is at or after t: all arrivals before t are known
        hf, hw, lv, cap = held_forward[s], held_weight[s], live[s], capacity[s]
        i_mb = next_i[s]
        can_i = i_mb < next_f[s] and g_arrive[s][i_mb] <= t
        f_mb = next_f[s]
        can_f = f_mb < m and f_arrive[s][f_mb] <= t
        headroom = max(lv, hw - hf, 0.0)
        choice: ActionKind | None = None
        if can_i:
            choice = "W" if waiting_w[s] and held[s] + headroom > cap else "I"
        elif can_f and held[s] + hf + headroom <= cap:
            choice = "F"
        elif waiting_w[s]:
            choice = "W"
        elif can_f and i_mb == f_mb:
            # nothing held (every forward's input gradient ran and no weight gradient waits; not
            # ``held == 0``, which float rounding of the adds and subtracts can miss): one
            # micro-batch always runs (whether it fits is the caller's test)
            choice = "F"
        if choice is None:
            # nothing to do now: wait for the next known arrival (or for another rank)
            nxt = inf
            if i_mb < next_f[s]:
                nxt = min(nxt, g_arrive[s][i_mb])
            if f_mb < m and not (held[s] + hf + headroom > cap and i_mb < f_mb):
                nxt = min(nxt, f_arrive[s][f_mb])
            dec[s] = max(nxt, t) if nxt < inf else inf
            if dec[s] < inf:
                heapq.heappush(heap, (dec[s], s))
            continue
        if choice == "F":
            end = t + forward_ms[s]
            orders[s].append(Action(s, "F", f_mb))
            next_f[s] += 1
            held[s] += hf
            if s < last:
                f_arrive[s + 1][f_mb] = end + transfer_ms[s]
                wake(s + 1, f_arrive[s + 1][f_mb])
            else:
                g_arrive[s][f_mb] = end
        elif choice == "I":
            end = t + input_ms[s]
            orders[s].append(Action(s, "I", i_mb))
            next_i[s] += 1
            held[s] += hw - hf
            waiting_w[s].append(i_mb)
            if s > 0:
                g_arrive[s - 1][i_mb] = end + transfer_ms[s - 1]
                wake(s - 1, g_arrive[s - 1][i_mb])
        else:
            w_mb = waiting_w[s].popleft()
            end = t + weight_ms[s]
            orders[s].append(Action(s, "W", w_mb))
            held[s] -= hw
        done[s] += 1
        free[s] = end
        dec[s] = end
        heapq.heappush(heap, (end, s))
    if any(d != 3 * m for d in done):  # pragma: no cover - the greedy always progresses
        raise ScheduleError("the list schedule deadlocked")
    return orders, max(free, default=0.0)


# --------------------------------------------------------------------------- text forms


def format_actions(orders: Sequence[Sequence[Action]]) -> list[str]:
    """One string per rank (the plan's ``actions``): ``"0F0 0F1 0I0 0W0 ..."``."""
    return [" ".join(str(a) for a in acts) for acts in orders]


def parse_actions(lines: Sequence[str]) -> Orders:
    """The inverse of :func:`format_actions`."""
    return [[Action.parse(tok) for tok in line.split()] for line in lines]


def to_csv(orders: Sequence[Sequence[Action]]) -> str:
    """torch's ``compute_only`` CSV (``_PipelineScheduleRuntime._load_csv``): one row per
    rank, one action per cell."""
    return "".join(",".join(str(a) for a in acts) + "\n" for acts in orders)


def format_orders(orders: Sequence[Sequence[Action]]) -> str:
    """Compact text form, one rank a line: ``rank 0: 0F0 0F1 0B0 ...``."""
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(orders))


# --------------------------------------------------------------------------- checks


def validate_actions(
    orders: Sequence[Sequence[Action]], *, num_stages: int, num_microbatches: int, stage_to_rank: Sequence[int] | None = None
) -> list[int]:
    """Check the lists as torch's ``_validate_schedule`` does (each stage on one rank; every
    micro-batch forwarded once; a ``B``, or an ``I`` and a ``W``, per micro-batch; ``B``/``I``
    after the forward, ``W`` after the ``I``, on the rank's own order) and return the stage to
    rank mapping.  Whether the ranks can run them together (no deadlock) is the simulator's
    test."""
    owner: dict[int, int] = {}
    seen: dict[tuple[int, str], set[int]] = {}
    for r, acts in enumerate(orders):
        for a in acts:
            if not 0 <= a.stage < num_stages or not 0 <= a.microbatch < num_microbatches:
                raise ScheduleError(
                    f"rank {r}: action {a} is outside {num_stages} stages x {num_microbatches} micro-batches"
                )
            if owner.setdefault(a.stage, r) != r:
                raise ScheduleError(f"stage {a.stage} is run by two ranks ({owner[a.stage]} and {r})")
            got = seen.setdefault((a.stage, a.kind), set())
            if a.microbatch in got:
                raise ScheduleError(f"rank {r}: action {a} appears twice")
            if a.kind in ("B", "I") and a.microbatch not in seen.get((a.stage, "F"), set()):
                raise ScheduleError(f"rank {r}: {a} runs before the forward {a.stage}F{a.microbatch}")
            if a.kind == "W" and a.microbatch not in seen.get((a.stage, "I"), set()):
                raise ScheduleError(f"rank {r}: {a} runs before its input gradient {a.stage}I{a.microbatch}")
            got.add(a.microbatch)
    for s in range(num_stages):
        f = seen.get((s, "F"), set())
        b = seen.get((s, "B"), set())
        i = seen.get((s, "I"), set())
        w = seen.get((s, "W"), set())
        if len(f) != num_microbatches or i != w or b & i or len(b | i) != num_microbatches:
            raise ScheduleError(
                f"stage {s} must run each of the {num_microbatches} micro-batches forward once and "
                f"backward once (B, or I then W): it has {len(f)} F, {len(b)} B, {len(i)} I, {len(w)} W"
            )
    mapping = [owner[s] for s in range(num_stages)]
    if stage_to_rank is not None and list(stage_to_rank) != mapping:
        raise ScheduleError(f"the actions put the stages on ranks {mapping}, not on {list(stage_to_rank)}")
    return mapping


# --------------------------------------------------------------------------- memory walk


@dataclass(frozen=True)
class MemoryPoint:
    """A moment of a rank's walk: per chunk (the rank's stages in increasing order), the
    micro-batches forwarded and not yet through their ``B``/``I`` (``forward``), those
    through their ``I`` and waiting for their ``W`` (``weight``), and the chunk whose
    ``B``/``I`` is running (``live``, -1 between actions)."""

    forward: tuple[int, ...]
    weight: tuple[int, ...]
    live: int = -1

    @cached_property
    def coef(self) -> tuple[int, ...]:
        """``forward + weight``, what :func:`peak_bytes` multiplies."""
        return self.forward + self.weight

    def dominated_by(self, other: MemoryPoint) -> bool:
        return (
            (self.live == -1 or self.live == other.live)
            and all(a <= b for a, b in zip(self.forward, other.forward, strict=True))
            and all(a <= b for a, b in zip(self.weight, other.weight, strict=True))
        )


class RankWalk:
    """The undominated :class:`MemoryPoint` s of one rank's walk (iterable as points), with
    a fast :meth:`peak`."""

    def __init__(self, points: Sequence[MemoryPoint]) -> None:
        self.points = tuple(points)
        self._arrays: tuple[Any, Any, Any] | None = None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int) -> MemoryPoint:
        return self.points[i]

    def peak(self, held_forward: Sequence[float], held_weight: Sequence[float], live: Sequence[float]) -> float:
        """:func:`peak_bytes` of these points (vectorized when there are many)."""
        if len(self.points) < 8:
            return _peak(self.points, held_forward, held_weight, live)
        import numpy as np  # only here: the service plans small shapes without it

        if self._arrays is None:
            coef = np.array([p.coef for p in self.points], dtype=float)
            live_idx = np.array([p.live for p in self.points])
            self._arrays = (coef, np.maximum(live_idx, 0), live_idx >= 0)
        coef, idx, has = self._arrays
        totals = coef @ np.array([*held_forward, *held_weight], dtype=float)
        totals = totals + np.where(has, np.asarray(live, dtype=float)[idx], 0.0)
        return max(0.0, float(totals.max()))


def memory_points(orders: Sequence[Sequence[Action]], rank_stage_lists: Sequence[Sequence[int]]) -> list[RankWalk]:
    """Walk each rank's actions and keep the moments memory can peak at (after a run of
    forwards, during each ``B``/``I``, after each ``I``), without those another one dominates.

    With per chunk ``held_forward`` (its activations, or only its input when it recomputes),
    ``held_weight`` (what its ``W`` still needs) and ``live`` (re-materialized activations
    during a recomputing ``B``/``I``), the rank's peak is :func:`peak_bytes`: F adds the
    stage's activations, I frees the part W does not need, W (or B) frees the rest."""
    out = []
    for acts, stages in zip(orders, rank_stage_lists, strict=True):
        local = {s: j for j, s in enumerate(stages)}
        nf = [0] * len(stages)
        nw = [0] * len(stages)
        seen: set[tuple[tuple[int, ...], tuple[int, ...], int]] = set()
        for i, a in enumerate(acts):
            j = local[a.stage]
            if a.kind == "F":
                nf[j] += 1
                # a moment only where the forwards stop (the counts only grow until then)
                if i + 1 == len(acts) or acts[i + 1].kind != "F":
                    seen.add((tuple(nf), tuple(nw), -1))
            elif a.kind == "W":
                nw[j] -= 1
            else:
                seen.add((tuple(nf), tuple(nw), j))
                nf[j] -= 1
                if a.kind == "I":
                    nw[j] += 1
                    # (a forward, backward or input gradient next holds at least as much)
                    if i + 1 == len(acts) or acts[i + 1].kind == "W":
                        seen.add((tuple(nf), tuple(nw), -1))
        out.append(RankWalk(_undominated([MemoryPoint(f, w, lv) for f, w, lv in seen])))
    return out


def _undominated(points: list[MemoryPoint]) -> list[MemoryPoint]:
    """The points no other one dominates (few: the walk repeats itself in the steady state).
    A moment between actions is also dominated by a moment during one (any live chunk) with
    at least its counts; a moment during a chunk's backward only by one during the same
    chunk's."""
    order = sorted(points, key=lambda p: (p.live == -1, -(sum(p.forward) + sum(p.weight)), p.forward, p.weight, p.live))
    if len(order) < 48:
        kept: list[MemoryPoint] = []
        for p in order:
            if not any(p.dominated_by(q) for q in kept):
                kept.append(p)
        return kept
    import numpy as np  # only here: long walks

    # the same scan against the kept points only (few), as arrays: a point any other dominates
    # is dominated by a kept one too (dominance is transitive, and the order puts every point
    # after those that dominate it)
    width = len(order[0].coef)
    kept_rows = np.empty((len(order), width))
    kept_lives = np.empty(len(order), dtype=int)
    out: list[MemoryPoint] = []
    for p in order:
        n = len(out)
        if n:
            ge = (kept_rows[:n] >= np.asarray(p.coef)).all(axis=1)
            if p.live != -1:
                ge &= kept_lives[:n] == p.live
            if ge.any():
                continue
        kept_rows[n] = p.coef
        kept_lives[n] = p.live
        out.append(p)
    return out


def peak_bytes(
    points: Iterable[MemoryPoint], held_forward: Sequence[float], held_weight: Sequence[float], live: Sequence[float]
) -> float:
    """The largest activation bytes of a rank over its walk (per chunk byte figures)."""
    if isinstance(points, RankWalk):
        return points.peak(held_forward, held_weight, live)
    return _peak(points, held_forward, held_weight, live)


def _peak(
    points: Iterable[MemoryPoint], held_forward: Sequence[float], held_weight: Sequence[float], live: Sequence[float]
) -> float:
    values = (*held_forward, *held_weight)
    best = 0.0
    for p in points:
        total = sum(map(mul, p.coef, values))
        if p.live >= 0:
            total += live[p.live]
        if total > best:
            best = total
    return best


def closed_form_walks(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[RankWalk] | None:
    """Each rank's memory moments without listing the actions, where a closed form holds:
    GPipe holds M micro-batches and 1F1B ``min(K-r, M)``, each then running a backward (exact,
    tested against the walk); interleaved 1F1B is bounded by its warm-up count
    ``min((K-r-1)·2 + (v-1)·K + 1, M·v)`` of its largest chunk plus one live chunk (the older
    cost model's form, an upper bound of the walk).  None for the other schedules."""
    k, m, v = num_ranks, num_microbatches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        counts = [m if schedule == "gpipe" else min(k - r, m) for r in range(k)]
        return [RankWalk([MemoryPoint((c,), (0,), 0)]) for c in counts]
    if schedule == "interleaved-1f1b":
        out = []
        for r in range(k):
            n = min((k - r - 1) * 2 + (v - 1) * k + 1, m * v)
            pts = [
                MemoryPoint(tuple(n if i == j else 0 for i in range(v)), (0,) * v, live)
                for j in range(v)
                for live in range(v)
            ]
            out.append(RankWalk(pts))
        return out
    return None


def walk_microbatches(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> int:
    """A micro-batch count whose memory walk has the same undominated points as
    ``num_microbatches``' (so the same peak for any chunk bytes), listed with fewer actions.

    Interleaved 1F1B runs its micro-batches in rounds of K through the v chunks; past the
    warm-up its steady state repeats round after round, and the cool-down is the same for every
    M (a multiple of K), so from 2K micro-batches on every M has the points of M = 2K: a walk of
    4·K²·v actions instead of 2·M·K·v (a test compares the full walks).  The count itself for
    every other schedule."""
    k, m = num_ranks, num_microbatches
    if schedule == "interleaved-1f1b" and virtual_stages > 1 and m > 2 * k and m % k == 0:
        return 2 * k
    return m


def first_backward_counts(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[tuple[int, ...]]:
    """Closed form, per rank and chunk, of the micro-batches forwarded before the rank's first
    ``B``/``I`` starts (counted with the one it starts on): a moment of every split's walk, so
    the bounds may use it as a lower bound of memory in flight (a test checks it against
    :func:`memory_points`).  ``planned`` adapts to memory: one micro-batch."""
    k, m, v = num_ranks, num_microbatches, virtual_stages
    out: list[tuple[int, ...]] = []
    for r in range(k):
        if schedule == "gpipe":
            out.append((m,))
        elif schedule in ("1f1b", "zb-h1"):
            out.append((min(k - r, m),))
        elif schedule == "zb-h2":
            out.append((min(2 * (k - r) - 1, m),))
        elif schedule == "planned":
            out.append((1,))
        elif schedule in ("interleaved-1f1b", "interleaved-zb"):
            if schedule == "interleaved-1f1b":
                per, warmup = k, min((k - r - 1) * 2 + (v - 1) * k, m * v)
            else:
                per = m // max(1, m // k)
                warmup = min((v - 1) * per + (k - 1 - r), m * v)
            n = min(warmup + 1, m * v)
            full, rest = divmod(n, per * v)
            out.append(tuple(min(m, full * per + min(per, max(0, rest - j * per))) for j in range(v)))
        else:  # zbv, dualpipev: chunk 0 then chunk 1 (stages r and 2K-1-r)
            out.append((min(2 * k - r - 1, m), min(r + 1, m)))
    return out


def forwards_before_chunk(schedule: Schedule, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> list[tuple[int, ...]]:
    """Closed form, per rank and chunk ``j``, of the forwards of *each* earlier chunk the rank
    runs before the first forward of chunk ``j`` (nothing else runs before it in any of the
    templates): the bounds' "a later chunk starts late" term.  Chunk 0: 0.  A test checks it
    against the lists."""
    k, m, v = num_ranks, num_microbatches, virtual_stages
    if schedule == "interleaved-1f1b":
        per = min(k, m)
    elif schedule == "interleaved-zb":
        per = min(m // max(1, m // k), m)
    elif schedule in ("zbv", "dualpipev"):
        return [(0, min(2 * (k - r) - 1, m)) for r in range(k)]
    else:
        return [(0,) * v for _ in range(k)]
    return [(0,) + (per,) * (v - 1) for _ in range(k)]
