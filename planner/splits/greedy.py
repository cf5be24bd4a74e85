"""Greedy splits of a one-chunk configuration (v = 1), with the exact memory model.

:func:`greedy_split` cuts the layers farthest-reach: every stage takes as many layers as keep
its bound (``in_f + M·work + idle + max(out_b, allreduce)``) within ``t`` and fit memory
exactly.  :func:`greedy_candidates` bisects on ``t`` for the least time at which the greedy
covers every layer, per device order and in up to three variants (plain; with the schedule's
fill and drain waits in the stage test; for 1F1B, also keeping the steady state's transfer
cycles within the period), and offers each split found (simulated, see
:func:`planner.search.state.consider`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from planner.bounds.relaxed import idle_bound
from planner.cost import boundary_transfer_ms
from planner.search.model import Split, StageModel, bisect_feasible, farthest, recompute_options
from planner.search.space import Config, Group
from planner.search.state import SearchState, consider


def greedy_split(
    search: SearchState,
    sm: StageModel,
    groups: Sequence[Group],
    order: Sequence[int],
    t: float,
    *,
    idle: bool = False,
    window: bool = False,
) -> Split | None:
    """Farthest-reach split with every stage's bound ``<= t`` and exact memory (v = 1).

    ``idle``: count the schedule's forced waits (:func:`planner.bounds.relaxed.idle_bound`) in
    each stage's bound, so that stages with long downstream paths take less work.

    ``window`` (1F1B): also keep the steady state's ping-pong cycles within the period.  In
    1F1B, ranks ``s..u`` pass micro-batches back and forth, so every ``u - s + 1`` of them
    cost that window ``sum(c) + 2·sum(x)`` (work per micro-batch and the transfers inside
    it, both ways); a slow link between two full stages stretches the whole pipeline's
    period by its transfer time.  Each stage's slack (``(t - bound) / M``, the period it
    leaves unused) must cover the transfers of every window ending at it, so stages beside
    a slow link take a little less work.
    """
    cfg = sm.cfg
    smax = max(g.speed for g in groups)
    k, m, n = cfg.pipeline_degree, cfg.num_microbatches, sm.L
    a = 0
    in_f = out_b = 0.0
    out_ranges: list[tuple[int, int]] = []
    rcs: list[bool] = []
    # most transfer time (2x per boundary, less the slack) of any window ending at the last stage
    owed = 0.0
    use_window = window and cfg.schedule == "1f1b"
    for s in range(k):
        g = groups[order[s]]
        lo_b, hi_b = (n, n) if s == k - 1 else (a + 1, n - (k - s - 1))
        best_b, best_rc, best_value = None, False, 0.0

        for rc in recompute_options(search.options, s):

            def value(
                b: int, g: Group = g, rc: bool = rc, a: int = a, s: int = s, in_f: float = in_f, out_b: float = out_b
            ) -> float:
                wait = idle_bound(sm, a, b, rc, s, g.speed, smax) if idle else 0.0
                return sm.stage_value(in_f, out_b, a, b, rc, g.speed, sm.allreduce(a, b, g)) + wait

            def ok(
                b: int, g: Group = g, rc: bool = rc, a: int = a, s: int = s, value: Callable[[int], float] = value,
                owed: float = owed,
            ) -> bool:
                val = value(b)
                if val > t or (use_window and (t - val) / m < owed):
                    return False
                return math.ceil(sm.memory(a, b, rc, s)) <= g.limit_bytes

            b = farthest(ok, lo_b, hi_b)
            if b is not None and (best_b is None or b > best_b):
                best_b, best_rc, best_value = b, rc, value(b)
        if best_b is None:
            return None
        out_ranges.append((a, best_b))
        rcs.append(best_rc)
        f = (sm.F[best_b] - sm.F[a]) / g.speed
        redo = (sm.R[best_b] - sm.R[a]) / g.speed if best_rc else 0.0
        bw = (sm.gradient_prefix(best_b) - sm.gradient_prefix(a)) / g.speed + redo
        x = 0.0
        if s < k - 1:
            nxt = groups[order[s + 1]]
            x = boundary_transfer_ms(
                sm.costs, [(a, best_b), (best_b, best_b + 1)], [list(g.devices), list(nxt.devices)], search.cluster
            )[0]
        in_f += f + x
        out_b += bw + x
        owed = 2 * x - (t - best_value) / m + max(0.0, owed)
        a = best_b
    return Split(tuple(out_ranges), tuple(rcs), tuple(order[:k]))


def greedy_candidates(
    search: SearchState, sm: StageModel, cfg: Config, groups: list[Group], orders: Sequence[tuple[int, ...]], lb: float
) -> float | None:
    """Greedy splits at the smallest feasible bound, per device order; the best is offered."""
    best_here: float | None = None
    # with the schedule's waits in the stage test (1F1B, GPipe) as a second candidate: the
    # plain test ignores the fill and drain, which the simulated step pays
    # and, for 1F1B, with the steady state's transfer cycles too (greedy_split's ``window``)
    variants = [(False, False)]
    if cfg.schedule in ("1f1b", "gpipe") and cfg.pipeline_degree > 1:
        variants.append((True, False))
        if cfg.schedule == "1f1b":
            variants.append((True, True))
    for order in orders:
        for idle, window in variants:

            def feasible(t: float, order: tuple[int, ...] = order, idle: bool = idle, window: bool = window) -> bool:
                search.work += cfg.pipeline_degree * 2 * math.log2(sm.L + 1)
                return greedy_split(search, sm, groups, order, t, idle=idle, window=window) is not None

            if not feasible(math.inf):
                continue
            t = bisect_feasible(feasible, lb)[1]
            split = greedy_split(search, sm, groups, order, t, idle=idle, window=window)
            if split is None:
                split = greedy_split(search, sm, groups, order, math.inf, idle=idle, window=window)
            if split is None:
                continue
            step = consider(search, sm, groups, split)
            best_here = step if best_here is None else min(best_here, step)
    return best_here
