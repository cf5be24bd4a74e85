"""Splits of an interleaved configuration (v > 1): K·v chunks, chunk j on rank j mod K.

Cuts per device order, each offered as a candidate by :func:`interleaved_candidates`:

* :func:`interleaved_split`: chunks balanced by time (min-max work), then recompute where
  memory needs it;
* the same with ``memory_aware``: when the balanced chunks need recompute, cut again with each
  rank's memory in the test, so ranks holding many micro-batches take smaller chunks;
* :func:`interleaved_mixed_split`: chunks cut with recompute chosen per chunk, whichever
  reaches farther, at the smallest per-chunk budget that covers every layer;
* :func:`planner.splits.vshape.vshape_candidates` (V placements): ranks balanced exactly by a
  DP over the cuts near even shares;
* :func:`interleaved_rank_split`: chunks cut for balanced *ranks* without recompute: each
  chunk takes the nearest whole-layer share of what its rank has left of a per-rank budget,
  keeps room for the parameter state of its rank's later chunks, and stops where memory
  does; a memory-bound rank's shortfall goes to the ranks after it (random layers at scale,
  where the first ranks' warm-up fills their memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.cost import static_bytes
from planner.search.model import (
    Split,
    StageModel,
    bisect_feasible,
    farthest,
    recompute_options,
    work_total,
)
from planner.search.space import Group
from planner.search.state import SearchState, consider
from planner.splits.recompute import with_prefix_recompute, with_recompute
from planner.splits.vshape import vshape_candidates


def interleaved_candidates(
    search: SearchState, sm: StageModel, groups: list[Group], orders: Sequence[tuple[int, ...]]
) -> float:
    """Offer the interleaved splits of the first three device orders (the per-chunk
    recompute and the rank-balanced splits only for the first); the best step time among
    them (inf if none)."""
    best_here = math.inf
    for i_order, order in enumerate(orders[:3]):
        tried: list[Split] = []
        for variant in ("balanced", "memory-aware", "mixed", "ranks", "v-ranks"):
            if variant in ("mixed", "ranks", "v-ranks") and i_order > 0:
                continue
            splits: list[Split | None]
            if variant == "v-ranks":
                splits = [*vshape_candidates(search, sm, groups, order)]
            elif variant == "mixed":
                splits = [interleaved_mixed_split(search, sm, groups, order)]
            elif variant == "ranks":
                splits = [*interleaved_rank_split(search, sm, groups, order)]
            else:
                splits = [interleaved_split(search, sm, groups, order, memory_aware=variant == "memory-aware")]
            for split in splits:
                if split is None or split in tried:
                    continue
                tried.append(split)
                best_here = min(best_here, consider(search, sm, groups, split))
                if any(split.recompute):  # the same chunks, each rank checkpointing its first ones
                    prefix = with_prefix_recompute(search, sm, groups, split.ranges, split.groups)
                    if prefix is not None and prefix not in tried:
                        tried.append(prefix)
                        best_here = min(best_here, consider(search, sm, groups, prefix))
    return best_here


def interleaved_split(
    search: SearchState, sm: StageModel, groups: Sequence[Group], order: Sequence[int], *, memory_aware: bool = False
) -> Split | None:
    """Balance the K·v chunks' work (min-max), then recompute where memory needs it.

    ``memory_aware``: when the balanced chunks need recompute, cut instead with each rank's
    memory in the test (without recompute first), so that ranks holding many micro-batches
    take smaller chunks rather than recomputing.
    """
    cfg = sm.cfg
    n = cfg.num_stages
    speeds = [groups[order[sm.owner[s]]].speed for s in range(n)]

    def cut(t: float) -> tuple[tuple[int, int], ...] | None:
        a = 0
        out = []
        for s in range(n):
            lo_b, hi_b = (sm.L, sm.L) if s == n - 1 else (a + 1, sm.L - (n - s - 1))
            sp = speeds[s]
            def fits(b: int, a: int = a, sp: float = sp) -> bool:
                return sm.work_ms(a, b, False, sp) <= t

            b = farthest(fits, lo_b, hi_b)
            if b is None:
                return None
            out.append((a, b))
            a = b
        return tuple(out)

    def feasible(t: float) -> bool:
        search.work += n * math.log2(sm.L + 1)
        return cut(t) is not None

    total = work_total(sm.costs)
    t = bisect_feasible(feasible, total / (n * max(speeds)))[1]
    ranges = cut(t)
    if ranges is None:  # pragma: no cover - bisect returns a feasible value
        return None
    stage_groups = tuple(order[sm.owner[s]] for s in range(n))
    split = with_recompute(search, sm, groups, ranges, stage_groups)
    if split is not None and not (memory_aware and any(split.recompute)):
        return split
    # the time-balanced chunks do not fit (or need recompute): cut again with each rank's
    # memory in the test, allowing chunks up to 3x the balanced time
    for rc in sorted(set(recompute_options(search.options, 0)) & {False, True}):
        if isinstance(search.options.recompute, list):
            break
        for step in range(16):
            search.work += 2 * n * math.log2(sm.L + 1)
            ranges_m = _memory_aware_cut(sm, groups, stage_groups, t * 3 ** (step / 15), rc)
            if ranges_m is not None:
                if step > 0 and memory_aware:
                    # the scan overshoots: a larger budget than needed lets the early chunks
                    # run far and starves the last ones, so bisect back to the smallest budget
                    lo, hi = t * 3 ** ((step - 1) / 15), t * 3 ** (step / 15)
                    for _ in range(10):
                        mid = (lo + hi) / 2
                        search.work += 2 * n * math.log2(sm.L + 1)
                        found = _memory_aware_cut(sm, groups, stage_groups, mid, rc)
                        if found is None:
                            lo = mid
                        else:
                            hi, ranges_m = mid, found
                return with_recompute(search, sm, groups, ranges_m, stage_groups)
    return None


def interleaved_mixed_split(
    search: SearchState, sm: StageModel, groups: Sequence[Group], order: Sequence[int]
) -> Split | None:
    """Interleaved chunks cut with recompute chosen per chunk (:func:`_mixed_cut`), at the
    smallest per-chunk budget (scan, then bisection) for which the cut covers every layer."""
    if search.options.recompute is not None:
        return None  # the user fixed recompute: the other splits follow it
    cfg = sm.cfg
    n = cfg.num_stages
    stage_groups = tuple(order[sm.owner[s]] for s in range(n))
    speeds = [groups[g].speed for g in stage_groups]
    t0 = work_total(sm.costs) / (n * max(speeds))
    found: tuple[tuple[tuple[int, int], ...], tuple[bool, ...]] | None = None
    prev = t0
    for step in range(9):
        t = t0 * 2 ** (step / 3)
        search.work += 4 * n * math.log2(sm.L + 1)
        found = _mixed_cut(sm, groups, stage_groups, t)
        if found is not None:
            if step > 0:
                lo, hi = prev, t
                for _ in range(10):
                    mid = (lo + hi) / 2
                    search.work += 4 * n * math.log2(sm.L + 1)
                    again = _mixed_cut(sm, groups, stage_groups, mid)
                    if again is None:
                        lo = mid
                    else:
                        hi, found = mid, again
            break
        prev = t
    if found is None:
        return None
    return with_recompute(search, sm, groups, found[0], stage_groups)


def _mixed_cut(
    sm: StageModel, groups: Sequence[Group], stage_groups: tuple[int, ...], t: float
) -> tuple[tuple[tuple[int, int], ...], tuple[bool, ...]] | None:
    """Farthest-reach chunks, each with or without recompute (whichever reaches farther),
    such that rank ``r``'s work after its j-th chunk is at most ``(j + 1)·t`` (a chunk that
    memory keeps small leaves its slack to the rank's later chunks) and the rank fits memory."""
    k, n = sm.cfg.pipeline_degree, sm.cfg.num_stages
    own: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    own_rc: list[list[bool]] = [[] for _ in range(k)]
    done = [0.0] * k
    out: list[tuple[int, int]] = []
    rcs: list[bool] = []
    a = 0
    for s in range(n):
        r = sm.owner[s]
        g = groups[stage_groups[s]]
        lo_b, hi_b = (sm.L, sm.L) if s == n - 1 else (a + 1, sm.L - (n - s - 1))
        budget = (len(own[r]) + 1) * t - done[r]
        best_b, best_rc = None, False
        for rc in (False, True):

            def fits(
                b: int, a: int = a, r: int = r, g: Group = g, rc: bool = rc, budget: float = budget
            ) -> bool:
                if sm.work_ms(a, b, rc, g.speed) > budget:
                    return False
                return math.ceil(sm.memory_upper(r, [*own[r], (a, b)], [*own_rc[r], rc])) <= g.limit_bytes

            b = farthest(fits, lo_b, hi_b)
            if b is not None and (best_b is None or b > best_b):
                best_b, best_rc = b, rc
        if best_b is None:
            return None
        own[r].append((a, best_b))
        own_rc[r].append(best_rc)
        done[r] += sm.work_ms(a, best_b, best_rc, g.speed)
        out.append((a, best_b))
        rcs.append(best_rc)
        a = best_b
    return tuple(out), tuple(rcs)


def _memory_aware_cut(
    sm: StageModel, groups: Sequence[Group], stage_groups: tuple[int, ...], t: float, rc: bool
) -> tuple[tuple[int, int], ...] | None:
    """Farthest-reach chunks with work <= t whose rank (all its chunks so far) fits memory."""
    k, n = sm.cfg.pipeline_degree, sm.cfg.num_stages
    own: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    out = []
    a = 0
    for s in range(n):
        r = sm.owner[s]
        g = groups[stage_groups[s]]
        lo_b, hi_b = (sm.L, sm.L) if s == n - 1 else (a + 1, sm.L - (n - s - 1))

        def fits(b: int, a: int = a, r: int = r, g: Group = g) -> bool:
            if sm.work_ms(a, b, rc, g.speed) > t:
                return False
            chunks = [*own[r], (a, b)]
            return math.ceil(sm.memory_upper(r, chunks, [rc] * len(chunks))) <= g.limit_bytes

        b = farthest(fits, lo_b, hi_b)
        if b is None:
            return None
        own[r].append((a, b))
        out.append((a, b))
        a = b
    return tuple(out)



#: per-rank budgets :func:`interleaved_rank_split` tries: the balanced share times 1 + i·STEP
RANK_SPLIT_STEP = 0.002
RANK_SPLIT_TRIES = 32
#: of the cuts found, this many with the least loaded busiest rank are offered
RANK_SPLIT_KEEP = 2


def interleaved_rank_split(
    search: SearchState, sm: StageModel, groups: Sequence[Group], order: Sequence[int]
) -> list[Split]:
    """Chunks without recompute whose ranks' loads are balanced (:func:`_rank_cut`), for
    per-rank budgets from the balanced share up (whether a cut covers every layer is not
    monotone in the budget, so a grid, not a bisection); the ``RANK_SPLIT_KEEP`` cuts whose
    busiest rank works least, with recompute where exact memory still needs it."""
    if search.options.recompute not in (None, False):
        return []
    cfg = sm.cfg
    n = cfg.num_stages
    stage_groups = tuple(order[sm.owner[s]] for s in range(n))
    speeds = [groups[g].speed for g in stage_groups]
    t0 = work_total(sm.costs) / (cfg.pipeline_degree * max(speeds))
    found: dict[tuple[tuple[int, int], ...], float] = {}
    for i in range(RANK_SPLIT_TRIES):
        search.work += 2 * n * math.log2(sm.L + 1)
        ranges = _rank_cut(sm, groups, stage_groups, t0 * (1 + i * RANK_SPLIT_STEP))
        if ranges is not None and ranges not in found:
            found[ranges] = max(
                sum(sm.work_ms(*ranges[s], False, speeds[s]) for s in own) for own in sm.rank_stages
            )
    out = []
    for ranges in sorted(found, key=lambda r: (found[r], r))[:RANK_SPLIT_KEEP]:
        split = with_recompute(search, sm, groups, ranges, stage_groups)
        if split is not None:
            out.append(split)
    return out


def _rank_cut(
    sm: StageModel, groups: Sequence[Group], stage_groups: tuple[int, ...], budget: float
) -> tuple[tuple[int, int], ...] | None:
    """Chunks in order, no recompute: chunk ``j`` of rank ``r`` takes the whole-layer end
    nearest to ``(budget - load_r) / (v - j)`` of work, no further than its rank's memory
    allows (the closed-form upper bound of :meth:`StageModel.memory_upper`, with room kept for
    the parameter state of the rank's later chunks at the model's average); the last chunk
    takes the rest and must keep its rank within ``budget``.  None when that fails."""
    k, n, v = sm.cfg.pipeline_degree, sm.cfg.num_stages, sm.cfg.virtual_stages
    own: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    load = [0.0] * k
    out: list[tuple[int, int]] = []
    per_chunk_params = sm.PP[-1] / n
    a = 0
    for s in range(n):
        r = sm.owner[s]
        g = groups[stage_groups[s]]
        j = len(own[r])
        reserve = static_bytes(per_chunk_params * (v - 1 - j), sm.training)

        def fits(b: int, a: int = a, r: int = r, g: Group = g, reserve: float = reserve) -> bool:
            chunks = [*own[r], (a, b)]
            return math.ceil(sm.memory_upper(r, chunks, [False] * len(chunks))) + reserve <= g.limit_bytes

        if s == n - 1:
            b = sm.L
            if not fits(b) or load[r] + sm.work_ms(a, b, False, g.speed) > budget:
                return None
        else:
            mem_b = farthest(fits, a + 1, sm.L - (n - s - 1))
            if mem_b is None:
                return None
            share = (budget - load[r]) / (v - j)

            def under(b: int, a: int = a, g: Group = g, share: float = share) -> bool:
                return sm.work_ms(a, b, False, g.speed) <= share

            b = farthest(under, a + 1, mem_b) or a + 1
            if b < mem_b and abs(sm.work_ms(a, b + 1, False, g.speed) - share) < abs(sm.work_ms(a, b, False, g.speed) - share):
                b += 1
        load[r] += sm.work_ms(a, b, False, g.speed)
        own[r].append((a, b))
        out.append((a, b))
        a = b
    return tuple(out)
