"""Recompute flags for given stage ranges: only where memory needs them.

:func:`with_recompute` turns ranges into a :class:`planner.search.model.Split` that fits
memory, or None.  Every split search ends with it (the fixed, interleaved and enumerated
splits, the polish, the baselines' splits, CP-SAT's), and so does the feasibility test of
:mod:`planner.search.feasibility`.

With one stage per rank (v = 1) its choice is exact: recompute only where the stage cannot
fit without it.  With v chunks per rank it picks the fitting set of chunks that adds the least
forward time, which need not give the fastest schedule.  :func:`recompute_variants` gives
every candidate that can be fastest instead: the step time is non-decreasing in every action's
duration (each rank runs its actions in a fixed order, each starting when its rank and its
inputs are ready), and recompute only lengthens backwards, so only the inclusion-minimal
fitting sets of each rank can be optimal; their product over the ranks is exact.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from planner.cost import rank_memory_from_terms, rank_memory_terms
from planner.search.model import Split, StageModel, conservative, planned_memory, recompute_options
from planner.search.space import Group
from planner.search.state import SearchState


def with_recompute(
    search: SearchState, sm: StageModel, groups: Sequence[Group], ranges: tuple[tuple[int, int], ...], stage_groups: tuple[int, ...]
) -> Split | None:
    """Recompute only where needed: per stage (v = 1) or per rank (all its chunks, v > 1)."""
    n = len(ranges)
    search.work += n
    rcs = [False] * n
    for own in sm.rank_stages:
        choices = [tuple(recompute_options(search.options, s)) for s in own]
        # try no recompute first, then everything the options allow, cheapest first
        combos = sorted(
            itertools.product(*choices),
            key=lambda c: sum(sm.R[ranges[s][1]] - sm.R[ranges[s][0]] for s, x in zip(own, c, strict=True) if x),
        )
        fit = RankFit(search, sm, [ranges[s] for s in own], sm.owner[own[0]], groups[stage_groups[own[0]]].limit_bytes)
        found = next((combo for combo in combos[:CHEAPEST_COMBOS] if fit.fits(combo)), None)
        if found is None and len(combos) > CHEAPEST_COMBOS:
            # many chunks per rank (2^v sets): the cheapest sets recompute too little; add chunks
            # one at a time, each time the one that lowers the rank's peak most
            search.work += len(own) ** 2
            found = fit.greedy(choices)
        if found is None:
            return None
        for s, x in zip(own, found, strict=True):
            rcs[s] = x
    return Split(ranges, tuple(rcs), stage_groups)


def with_prefix_recompute(
    search: SearchState, sm: StageModel, groups: Sequence[Group], ranges: tuple[tuple[int, int], ...], stage_groups: tuple[int, ...]
) -> Split | None:
    """Megatron's and Llama 3's choice for several chunks per rank: each rank checkpoints its
    first n chunks, the least n that fits (None where recomputing every chunk the options allow
    does not fit, or where the options fix recompute).  The earliest chunks hold the most
    micro-batches in flight, and their recompute falls where the schedule can hide it: on Llama
    3 405B's layout it is 2 % faster than the set :func:`with_recompute` grows by memory alone,
    so the searches offer both."""
    if sm.cfg.virtual_stages == 1 or search.options.recompute is not None:
        return None
    rcs = [False] * len(ranges)
    search.work += len(ranges)
    for own in sm.rank_stages:
        fit = RankFit(search, sm, [ranges[s] for s in own], sm.owner[own[0]], groups[stage_groups[own[0]]].limit_bytes)
        n = next((n for n in range(len(own) + 1) if fit.fits([j < n for j in range(len(own))])), None)
        if n is None:
            return None
        for j, s in enumerate(own):
            rcs[s] = j < n
    return Split(ranges, tuple(rcs), stage_groups)


#: recompute sets of a rank tried cheapest first (by added forward time) before the greedy
#: fallback of :meth:`RankFit.greedy`
CHEAPEST_COMBOS = 16


class RankFit:
    """One rank's chunks against its memory limit, as the split searches test recompute sets:
    the closed form of :func:`rank_peak`, and where that is conservative
    (:func:`planner.search.model.conservative`) and over the limit, the schedule's own walk, as
    :func:`planner.cost.estimate` walks it (the closed form counts every warm-up forward at the
    largest chunk's footprint: with the head's logits in the last chunk it can be several times
    the walk's peak).  The rank's memory terms are made once."""

    def __init__(
        self, search: SearchState, sm: StageModel, chunks: Sequence[tuple[int, int]], rank: int, limit_bytes: int
    ) -> None:
        self.search, self.sm, self.chunks, self.rank, self.limit = search, sm, list(chunks), rank, limit_bytes
        self.terms = rank_memory_terms(sm.costs, self.chunks, sm.training)
        self.conservative = conservative(sm.cfg, sm.L)

    def peak(self, recompute: Sequence[bool]) -> float:
        """The peak bytes the fit test compares with the limit."""
        sm = self.sm
        if sm.cfg.schedule == "planned":
            return planned_memory(self.terms, recompute[0])
        mem = rank_memory_from_terms(self.terms, recompute, sm.points[self.rank])
        if math.ceil(mem) > self.limit and self.conservative:
            mem = rank_memory_from_terms(self.terms, recompute, self.search.exact_points_of(sm.cfg)[self.rank])
        return mem

    def fits(self, recompute: Sequence[bool]) -> bool:
        return math.ceil(self.peak(recompute)) <= self.limit

    def greedy(self, choices: Sequence[tuple[bool, ...]]) -> tuple[bool, ...] | None:
        """A fitting recompute set grown greedily from the least the options allow (``choices``
        per chunk, False first when allowed): each step adds the chunk whose recompute lowers
        the peak most (ties: the one adding the least forward time).  None when recomputing
        every free chunk does not fit (then no set does: recompute only lowers what a chunk
        holds); otherwise at most v(v+1)/2 memory walks."""
        combo = [c[0] for c in choices]
        free = [j for j, c in enumerate(choices) if len(c) > 1]
        if not self.fits([x or j in free for j, x in enumerate(combo)]):
            return None
        fwd = [self.sm.R[b] - self.sm.R[a] for a, b in self.chunks]
        peak = self.peak(combo)
        while math.ceil(peak) > self.limit:
            trials = [(self.peak([*combo[:j], True, *combo[j + 1:]]), fwd[j], j) for j in free if not combo[j]]
            peak, _, j = min(trials)
            combo[j] = True
        return tuple(combo)


def rank_peak(sm: StageModel, chunks: Sequence[tuple[int, int]], recompute: Sequence[bool], rank: int) -> float:
    """Exact peak bytes of ``rank`` holding ``chunks`` with these recompute flags (its
    schedule's memory walk; for ``planned``, the one micro-batch it needs and keeps to)."""
    terms = rank_memory_terms(sm.costs, chunks, sm.training)
    if sm.cfg.schedule == "planned":
        return planned_memory(terms, recompute[0])
    return rank_memory_from_terms(terms, recompute, sm.points[rank])


#: most recompute variants of one split (product over ranks) before giving up on exactness
VARIANT_LIMIT = 256


def _minimal_fitting(
    sm: StageModel, ranges: tuple[tuple[int, int], ...], own: list[int],
    choices: list[tuple[bool, ...]], limit_bytes: int, rank: int, *, every: bool = False,
) -> list[tuple[bool, ...]]:
    """The inclusion-minimal recompute sets of one rank's chunks that fit, smallest first
    (supersets of a fitting set are never evaluated; with ``every``, all fitting sets)."""

    chunks = [ranges[s] for s in own]

    def fits(combo: tuple[bool, ...]) -> bool:
        return math.ceil(rank_peak(sm, chunks, combo, rank)) <= limit_bytes

    least = tuple(c[0] for c in choices)  # recompute_options lists False first when allowed
    free = [j for j, c in enumerate(choices) if len(c) > 1]
    found: list[frozenset[int]] = []
    for size in range(len(free) + 1):
        for subset in itertools.combinations(free, size):
            chosen = frozenset(subset)
            if not every and any(f <= chosen for f in found):
                continue
            if fits(tuple(x or j in chosen for j, x in enumerate(least))):
                found.append(chosen)
    return [tuple(x or j in f for j, x in enumerate(least)) for f in found]


def recompute_variants(
    search: SearchState,
    sm: StageModel,
    groups: Sequence[Group],
    ranges: tuple[tuple[int, int], ...],
    stage_groups: tuple[int, ...],
    *,
    cache: dict[tuple[int, int, tuple[tuple[int, int], ...]], list[tuple[bool, ...]]] | None = None,
    every: bool = False,
) -> list[Split] | None:
    """Every split of these ranges that can be the fastest (see the module doc): one per
    combination of each rank's inclusion-minimal fitting recompute sets.  ``[]`` when some rank
    cannot fit; None when there are more than ``VARIANT_LIMIT``, or when no set fits a
    conservative closed form (:class:`RankFit`), which proves nothing (then not exact).

    ``every``: every fitting set, not only the minimal ones (for ``planned``, whose order
    depends on memory, so recompute can make it faster).

    ``cache`` keeps each rank's minimal sets by (rank, memory limit, its chunks' ranges) across
    the splits of one configuration, where the same chunks recur."""
    n = len(ranges)
    per_rank: list[tuple[list[int], list[tuple[bool, ...]]]] = []
    count = 1
    for r, own in enumerate(sm.rank_stages):
        choices = [tuple(recompute_options(search.options, s)) for s in own]
        limit = groups[stage_groups[own[0]]].limit_bytes
        key = (r, limit, tuple(ranges[s] for s in own))
        if cache is not None and key in cache:
            minimal = cache[key]
        else:
            search.work += n
            minimal = _minimal_fitting(sm, ranges, own, choices, limit, r, every=every)
            if cache is not None:
                cache[key] = minimal
        if not minimal:
            # under a conservative closed form, "nothing fits" is not proven: the schedule's own
            # walk may fit (with_recompute tests it), so the variants are not exact
            return None if conservative(sm.cfg, sm.L) else []
        count *= len(minimal)
        if count > VARIANT_LIMIT:
            return None
        per_rank.append((own, minimal))
    out = []
    for pick in itertools.product(*(minimal for _, minimal in per_rank)):
        rcs = [False] * n
        for (own, _), combo in zip(per_rank, pick, strict=True):
            for s, x in zip(own, combo, strict=True):
                rcs[s] = x
        out.append(Split(ranges, tuple(rcs), stage_groups))
    return out
