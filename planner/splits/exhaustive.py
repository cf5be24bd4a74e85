"""Every split of a small configuration, so that its optimum is exact.

A chain of L layers cut into n stages has C(L-1, n-1) splits; when that times the device
orders is at most ``ENUMERATE_LIMIT`` (:func:`enumerable`), :func:`enumerate_splits` gives each
its recompute flags, sorts the fitting ones by their lower bound
(:func:`planner.bounds.split.split_lower_bound`) and simulates them in that order until the
bound reaches the best plan.  With one chunk per rank the recompute flags are exact
(:func:`planner.splits.recompute.with_recompute`); with several, every inclusion-minimal
choice per rank is tried (:func:`planner.splits.recompute.recompute_variants`).

Small instances are exact: for a model of at most ``SMALL_LAYERS`` layers the limit rises to
``SMALL_LIMIT``, which covers every configuration of L <= 16 layers (at most C(15, 7) = 6,435
splits) on a homogeneous cluster or on up to 4 devices of mixed kinds placed in any of the
4! orders (at most 24 x C(15, 3) = 10,920 splits with K <= 4 stages, interleaved chunks of
K <= 4 ranks up to 6,435 x 2).  So with L <= 16 and K <= 4 every configuration is either
enumerated or excluded by a valid bound, and the plan is ``optimal`` with gap 0.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sequence

from planner.bounds.split import split_lower_bound
from planner.search.model import Split, StageModel, recompute_options
from planner.search.space import Config, Group, device_orders, distinct_orders
from planner.search.state import SearchState, consider
from planner.splits.recompute import recompute_variants, with_prefix_recompute, with_recompute

#: enumerate every split of a configuration when there are at most this many
ENUMERATE_LIMIT = 400
#: models of at most this many layers are small instances ...
SMALL_LAYERS = 16
#: ... whose configurations are enumerated up to this many splits (times device orders)
SMALL_LIMIT = 16_384


def enumerable(num_layers: int, num_stages: int, num_orders: int, *, small_instances: bool = True) -> bool:
    """Few enough splits (times device orders) to try them all (``small_instances``: with the
    higher limit of small models)."""
    count = math.comb(num_layers - 1, num_stages - 1) * num_orders
    small = small_instances and num_layers <= SMALL_LAYERS
    return count <= ENUMERATE_LIMIT or (small and count <= SMALL_LIMIT)


def fitting_splits(
    search: SearchState, sm: StageModel, groups: Sequence[Group], orders: Sequence[tuple[int, ...]]
) -> Iterator[Split]:
    """Every split of ``sm.cfg`` that fits memory (cheapest recompute), order by order."""
    n = sm.cfg.num_stages
    for order in orders:
        for cuts in itertools.combinations(range(1, sm.L), n - 1):
            bounds = (0, *cuts, sm.L)
            ranges = tuple((bounds[i], bounds[i + 1]) for i in range(n))
            split = with_recompute(search, sm, groups, ranges, tuple(order[sm.owner[s]] for s in range(n)))
            if split is not None:
                yield split


def all_recompute_splits(
    search: SearchState, sm: StageModel, groups: Sequence[Group], orders: Sequence[tuple[int, ...]]
) -> Iterator[Split]:
    """Every split with every recompute choice that fits: for ``planned``, whose list
    schedule adapts to memory, recompute may pay for itself (more micro-batches in flight),
    so the cheapest choice is not always the fastest."""
    n = sm.cfg.num_stages
    for order in orders:
        stage_groups = tuple(order[sm.owner[s]] for s in range(n))
        for cuts in itertools.combinations(range(1, sm.L), n - 1):
            bounds = (0, *cuts, sm.L)
            ranges = tuple((bounds[i], bounds[i + 1]) for i in range(n))
            variants = recompute_variants(search, sm, groups, ranges, stage_groups, every=True)
            yield from variants or ()


def enumerate_splits(search: SearchState, sm: StageModel, cfg: Config, groups: list[Group], lb: float) -> bool:
    """Solve ``cfg`` by enumerating every split in bound order; False if there are too many.

    Exact unless the cluster has too many distinct device orders to try them all, or a split
    has too many recompute variants, in which case ``lb`` stays open.
    """
    n = cfg.num_stages
    orders = device_orders(groups)
    if not enumerable(sm.L, n, len(orders)):
        return False
    if len(orders) > 1 and not distinct_orders(groups, limit=24):
        search.open_bounds.append(lb)
    if cfg.virtual_stages > 1:
        _enumerate_interleaved(search, sm, groups, orders, lb)
        return True
    splits = (
        all_recompute_splits(search, sm, groups, orders)
        if cfg.schedule == "planned"
        else fitting_splits(search, sm, groups, orders)
    )
    candidates = []
    for i, split in enumerate(splits):
        if i % CLOCK_EVERY == 0 and _past_time_limit(search):
            search.open_bounds.append(lb)  # cut short by the time limit: the bound stays open
            return True
        candidates.append((split_lower_bound(sm, search.cluster, groups, split), split))
    if not candidates:
        search.infeasible += 1
        return True
    candidates.sort(key=lambda c: (c[0], c[1].ranges, c[1].groups))
    for i, (lb_split, split) in enumerate(candidates):
        if lb_split >= search.best_step:
            break
        if i % CLOCK_EVERY == 0 and _past_time_limit(search):
            search.open_bounds.append(lb_split)
            return True
        consider(search, sm, groups, split)
    return True


#: how many splits an enumeration takes between two looks at the clock
CLOCK_EVERY = 64


def _past_time_limit(search: SearchState) -> bool:
    """Whether the solve's wall-clock limit has passed (an enumeration then stops and leaves
    its configuration's bound open, so the status says feasible, never optimal)."""
    return time.perf_counter() > search.wall_stop


def _enumerate_interleaved(
    search: SearchState, sm: StageModel, groups: list[Group], orders: Sequence[tuple[int, ...]], lb: float
) -> None:
    """Every split of a several-chunk configuration, each with every recompute variant.

    Splits are taken in the order of their bound without recompute (the least any of their
    variants can take, as recompute only adds time), so the search stops at the first split
    whose every variant loses to the best plan."""
    n = sm.cfg.num_stages
    least = tuple(recompute_options(search.options, s)[0] for s in range(n))
    bases: list[tuple[float, Split]] = []
    for order in orders:
        stage_groups = tuple(order[sm.owner[s]] for s in range(n))
        for ranges in _promising_ranges(sm, [groups[g].speed for g in stage_groups], least, search.best_step):
            if len(bases) % CLOCK_EVERY == 0 and _past_time_limit(search):
                search.open_bounds.append(lb)
                return
            base = Split(ranges, least, stage_groups)
            bases.append((split_lower_bound(sm, search.cluster, groups, base), base))
    search.work += len(bases) * n
    if not bases:  # every split's partial bound reached the best plan
        search.pruned += 1
        search.pruned_after_visit += 1
        return
    bases.sort(key=lambda c: (c[0], c[1].ranges, c[1].groups))
    fits_any = False
    cache: dict[tuple[int, int, tuple[tuple[int, int], ...]], list[tuple[bool, ...]]] = {}
    for i, (lb_base, base) in enumerate(bases):
        if lb_base >= search.best_step:
            return
        if i % CLOCK_EVERY == 0 and _past_time_limit(search):
            search.open_bounds.append(lb_base)
            return
        variants = recompute_variants(search, sm, groups, base.ranges, base.groups, cache=cache)
        if variants is None:  # too many to try: the cheapest one, and the bound stays open
            search.open_bounds.append(lb)
            split = with_recompute(search, sm, groups, base.ranges, base.groups)
            prefix = with_prefix_recompute(search, sm, groups, base.ranges, base.groups)
            variants = [x for x in (split, prefix) if x is not None]
        for split in variants:
            fits_any = True
            consider(search, sm, groups, split)
    if not fits_any:
        search.infeasible += 1


def _promising_ranges(
    sm: StageModel, speeds: Sequence[float], recompute: Sequence[bool], cutoff: float
) -> Iterator[tuple[tuple[int, int], ...]]:
    """Every split into ``len(speeds)`` stages whose partial bound stays below ``cutoff``.

    The partial bound, stage by stage from the first: for each rank, the forwards that reach
    its first stage plus M times the forward and backward of its stages so far.  It never
    exceeds :func:`planner.bounds.split.split_lower_bound` of the finished split (which adds
    transfers, the rest of the rank's stages, waits and the all-reduce), so a split it drops
    could not beat ``cutoff``.
    """
    n, k, m, num_layers = len(speeds), sm.cfg.pipeline_degree, sm.cfg.num_microbatches, sm.L
    F, B, R = sm.F, sm.B, sm.R
    work = [0.0] * k
    reach = [0.0] * k  # forwards before each rank's first stage
    bounds = [0] * (n + 1)

    def extend(s: int, a: int, fwd_before: float) -> Iterator[tuple[tuple[int, int], ...]]:
        r = sm.owner[s]
        if s == sm.rank_stages[r][0]:
            reach[r] = fwd_before
        stops = [num_layers] if s == n - 1 else range(a + 1, num_layers - (n - s - 1) + 1)
        for b in stops:
            f = (F[b] - F[a]) / speeds[s]
            w = m * (f + (B[b] - B[a] + (R[b] - R[a] if recompute[s] else 0.0)) / speeds[s])
            if reach[r] + work[r] + w >= cutoff:
                continue
            bounds[s + 1] = b
            if s == n - 1:
                yield tuple((bounds[i], bounds[i + 1]) for i in range(n))
                continue
            work[r] += w
            yield from extend(s + 1, b, fwd_before + f)
            work[r] -= w

    yield from extend(0, 0, 0.0)
