"""Rank-balanced chunks for the V-shaped schedules (zbv, dualpipev).

Under the V placement rank ``r`` holds chunk ``r`` on the way down and chunk ``2K-1-r`` on the
way back, so its load is set by four cuts: ``c[r]``, ``c[r+1]``, ``c[2K-1-r]`` and
``c[2K-r]``.  Taking the ranks from the outside in (rank 0 holds the first and the last chunk,
rank K-1 the two around the turn), each rank adds one cut on either leg: a ladder, which a DP
over the pair of open cuts solves exactly.  :func:`vshape_balanced_split` runs that min-max DP
over a few whole-layer positions around each cut's even share (every chunk ``tau / 2`` of
work, ``tau`` each rank's share), so each rank's total lands as close to ``tau`` as whole
layers allow, with the chunks near even.

A split cut for even chunks (min-max chunk work) leaves each rank the sum of its two chunks'
deviations: with random layers at scale (1,024 layers, 32 ranks) the busiest rank is 2-5 %
over the mean, where this DP's is within about half a percent.  The zero-bubble V schedules
lose little else, so the rank balance is most of their step time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.search.model import Split, StageModel
from planner.search.space import Group
from planner.search.state import SearchState
from planner.splits.recompute import with_recompute

#: whole-layer positions the DP tries on either side of each cut's even share
VSHAPE_WINDOW = 4
#: the chunk spreads offered: each chunk's work within this fraction of its even share (the
#: V schedules stall on uneven chunks too: on random layers at scale, no limit gives the most
#: even ranks and a slower step than 0.1)
VSHAPE_SPREADS = (0.1, 0.15)
V_SCHEDULES = frozenset({"zbv", "dualpipev"})


def vshape_candidates(search: SearchState, sm: StageModel, groups: Sequence[Group], order: Sequence[int]) -> list[Split]:
    """The distinct :func:`vshape_balanced_split` splits, one per spread of ``VSHAPE_SPREADS``."""
    out: list[Split] = []
    for spread in VSHAPE_SPREADS:
        split = vshape_balanced_split(search, sm, groups, order, chunk_spread=spread)
        if split is not None and split not in out:
            out.append(split)
    return out


def vshape_balanced_split(
    search: SearchState, sm: StageModel, groups: Sequence[Group], order: Sequence[int], *,
    window: int = VSHAPE_WINDOW, chunk_spread: float | None = None,
) -> Split | None:
    """:func:`balanced_v_cuts` for this configuration's V placement, with recompute only where
    memory needs it (:func:`with_recompute`); None for other placements, when the options fix
    recompute on, when the model has fewer layers than chunks, or when nothing fits."""
    cfg = sm.cfg
    k, n, L = cfg.pipeline_degree, cfg.num_stages, sm.L
    if cfg.schedule not in V_SCHEDULES or n != 2 * k or L < n or search.options.recompute not in (None, False):
        return None
    stage_groups = tuple(order[sm.owner[s]] for s in range(n))
    # numpy runs the DP's k (2w+1)^4 steps about a hundred to a work unit (~5 ms at K = 32, w = 4)
    search.work += k * (2 * window + 1) ** 4 / 100
    cuts = balanced_v_cuts(
        [sm.F[i] + sm.B[i] for i in range(L + 1)], [groups[stage_groups[r]].speed for r in range(k)],
        window=window, chunk_spread=chunk_spread,
    )
    if cuts is None:
        return None
    ranges = tuple((cuts[s], cuts[s + 1]) for s in range(n))
    return with_recompute(search, sm, groups, ranges, stage_groups)


def balanced_v_cuts(
    prefix_work: Sequence[float], rank_speed: Sequence[float], *, window: int = VSHAPE_WINDOW,
    chunk_spread: float | None = None,
) -> list[int] | None:
    """The 2K + 1 cuts of a V split (``K = len(rank_speed)``; rank ``r`` holds chunks ``r``
    and ``2K-1-r``) whose busiest rank takes least time, among cuts within ``window`` layers of
    the even shares (each chunk ``tau·speed_r / 2`` of work) and, with ``chunk_spread``, chunks
    within that fraction of their even share; ties go to the smaller sum of squared deviations
    from ``tau`` (greedily: exact for the busiest rank, a heuristic for the rest).  The turn
    (chunks K-1 and K, both rank K-1's) is cut at the nearest layer to equal halves.
    ``prefix_work[i]``: the work of layers ``0..i-1`` at speed 1.  None when no cut qualifies."""
    k = len(rank_speed)
    n = 2 * k
    prefix = np.asarray(prefix_work, dtype=float)
    L = len(prefix) - 1
    if L < n:
        return None
    speed = list(rank_speed)
    owner = [s if s < k else n - 1 - s for s in range(n)]
    tau = float(prefix[-1]) / sum(speed)
    even = [0]
    acc = 0.0
    for s in range(n - 1):
        acc += tau * speed[owner[s]] / 2
        even.append(_nearest(prefix, acc, even[-1] + 1, L - (n - s - 1)))
    even.append(L)

    def options(s: int) -> np.ndarray:
        """Candidate positions of cut ``s`` (the start of stage ``s``)."""
        if s in (0, n):
            return np.array([even[s]])
        lo, hi = max(s, even[s] - window), min(L - (n - s), even[s] + window)
        return np.arange(lo, hi + 1)

    # state after rank r: (c[r+1], c[2K-1-r]) options; value (busiest so far, sum of squares)
    left, right = options(0), options(n)
    worst = np.zeros((1, 1))
    squares = np.zeros((1, 1))
    back: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for r in range(k - 1):
        new_l, new_r = options(r + 1), options(n - 1 - r)
        # axes [i, j, p, q]: rank r's chunks left[i]..new_l[p] and new_r[q]..right[j]
        down = prefix[new_l][None, None, :, None] - prefix[left][:, None, None, None]
        back_leg = prefix[right][None, :, None, None] - prefix[new_r][None, None, None, :]
        load = (down + back_leg) / speed[r]
        ok = (
            (new_l[None, None, :, None] > left[:, None, None, None])
            & (new_r[None, None, None, :] < right[None, :, None, None])
            & (new_l[None, None, :, None] + 1 < new_r[None, None, None, :])
        )
        if chunk_spread is not None:
            half = tau * speed[r] / 2
            ok &= (np.abs(down - half) <= chunk_spread * half) & (np.abs(back_leg - half) <= chunk_spread * half)
        top = np.where(ok, np.maximum(worst[:, :, None, None], load), np.inf)
        sq = (squares[:, :, None, None] + (load - tau) ** 2).reshape(-1, len(new_l), len(new_r))
        flat_top = top.reshape(sq.shape)
        worst = flat_top.min(axis=0)
        tie = np.where(flat_top <= worst[None] * (1 + 1e-12), sq, np.inf)
        arg = tie.argmin(axis=0)
        squares = np.take_along_axis(sq, arg[None], axis=0)[0]
        back.append((left, right, arg))
        left, right = new_l, new_r
    # rank K-1: the turn, chunks left[i]..c[K] and c[K]..right[j]
    load = (prefix[right][None, :] - prefix[left][:, None]) / speed[k - 1]
    top = np.where(right[None, :] - left[:, None] >= 2, np.maximum(worst, load), np.inf)
    if not np.isfinite(top).any():
        return None
    tie = np.where(top <= top.min() * (1 + 1e-12), squares + (load - tau) ** 2, np.inf)
    i, j = divmod(int(tie.argmin()), tie.shape[1])
    cuts = [0] * (n + 1)
    cuts[n] = L
    cuts[k - 1], cuts[k + 1] = int(left[i]), int(right[j])
    for r in range(k - 2, -1, -1):
        prev_l, prev_r, arg = back[r]
        i, j = divmod(int(arg[i, j]), len(prev_r))
        cuts[r], cuts[n - r] = int(prev_l[i]), int(prev_r[j])
    cuts[k] = _nearest(prefix, (prefix[cuts[k - 1]] + prefix[cuts[k + 1]]) / 2, cuts[k - 1] + 1, cuts[k + 1] - 1)
    return cuts


def _nearest(prefix: np.ndarray, x: float, lo: int, hi: int) -> int:
    """The whole-layer position in [lo, hi] whose prefix work is nearest to ``x``."""
    i = min(max(int(np.searchsorted(prefix, x)), lo), hi)
    if i > lo and abs(prefix[i - 1] - x) <= abs(prefix[i] - x):
        i -= 1
    return i
