"""Every split of a small configuration, so that its optimum is exact.

A chain of L layers cut into n stages has C(L-1, n-1) splits; when that times the device
orders is at most ``ENUMERATE_LIMIT`` (:func:`enumerable`), :func:`enumerate_splits` gives each
its recompute flags (:func:`planner.splits.recompute.with_recompute`), sorts the fitting ones
by their lower bound (:func:`planner.bounds.split.split_lower_bound`) and simulates them in
that order until the bound reaches the best plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from planner.bounds.split import split_lower_bound
from planner.search.model import Split, StageModel
from planner.search.space import Config, Group, device_orders, distinct_orders
from planner.search.state import SearchState, consider
from planner.splits.recompute import with_recompute

#: enumerate every split of a configuration when there are at most this many
ENUMERATE_LIMIT = 400


def enumerable(num_layers: int, num_stages: int, num_orders: int) -> bool:
    """Few enough splits (times device orders) to try them all."""
    return math.comb(num_layers - 1, num_stages - 1) * num_orders <= ENUMERATE_LIMIT


def fitting_splits(
    search: SearchState, sm: StageModel, groups: Sequence[Group], orders: Sequence[tuple[int, ...]]
) -> Iterator[Split]:
    """Every split of ``sm.cfg`` that fits memory (cheapest recompute), order by order."""
    n, k = sm.cfg.num_stages, sm.cfg.pipeline_degree
    for order in orders:
        for cuts in itertools.combinations(range(1, sm.L), n - 1):
            bounds = (0, *cuts, sm.L)
            ranges = tuple((bounds[i], bounds[i + 1]) for i in range(n))
            split = with_recompute(search, sm, groups, ranges, tuple(order[s % k] for s in range(n)))
            if split is not None:
                yield split


def enumerate_splits(search: SearchState, sm: StageModel, cfg: Config, groups: list[Group], lb: float) -> bool:
    """Solve ``cfg`` by enumerating every split in bound order; False if there are too many.

    Exact unless the cluster has too many distinct device orders to try them all, in which
    case ``lb`` stays open.
    """
    n = cfg.num_stages
    orders = device_orders(groups)
    if not enumerable(sm.L, n, len(orders)):
        return False
    if len(orders) > 1 and not distinct_orders(groups, limit=24):
        search.open_bounds.append(lb)
    candidates: list[tuple[float, Split]] = [
        (split_lower_bound(sm, search.cluster, groups, split), split)
        for split in fitting_splits(search, sm, groups, orders)
    ]
    if not candidates:
        search.infeasible += 1
        return True
    candidates.sort(key=lambda c: (c[0], c[1].ranges, c[1].groups))
    for lb_split, split in candidates:
        if lb_split >= search.best_step:
            break
        consider(search, sm, groups, split)
        if cfg.virtual_stages > 1 and any(split.recompute):
            # recompute is chosen per rank by the forward time it adds, not by simulation:
            # exact only without recompute, so the configuration's bound stays open
            search.open_bounds.append(lb)
    return True
