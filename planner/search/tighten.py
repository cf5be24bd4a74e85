"""Tightening after the search: raise the bounds of the configurations still open.

Run by :func:`planner.search.driver.solve` once the branch and bound, the baselines' splits
and the polish are done; each may also find a better plan, which it offers.

1. :func:`tighten_chains` (homogeneous clusters, one chunk per device): the boundary table of
   :mod:`planner.bounds.chain_dp`, by bisection on the step time, smallest bound first.
2. :func:`tighten_cpsat`: the CP-SAT model of :mod:`planner.bounds.cpsat` for the one-chunk
   configurations left (heterogeneous clusters, small models), hinted by the best split known.
"""

from __future__ import annotations

import heapq
import math
import time

from planner.bounds.chain_dp import MAX_CELLS, chain_cells, chain_split
from planner.bounds.cpsat import MAX_MODEL_SIZE, PER_CONFIG_S, config_bound
from planner.search.model import Split, split_memory_ok
from planner.search.space import Config, fixed_ranges
from planner.search.state import SearchState, consider
from planner.splits.recompute import with_recompute

#: share of the work budget the boundary tables of :mod:`planner.bounds.chain_dp` may use
CHAIN_SHARE = 0.2
#: work units per entry of those tables (measured: about 7·10^6 entries a second), and per stage
CHAIN_WORK = 0.06
CHAIN_STAGE_WORK = 100
#: relative width at which a configuration's table bisection stops
CHAIN_TOL = 2e-4


def tighten_chains(search: SearchState) -> None:
    """Raise the bounds of open one-chunk configurations with the boundary table of
    :mod:`planner.bounds.chain_dp` (homogeneous clusters), smallest bound first, and offer the
    split the table finds at each time it can reach.

    Each step tests one time ``t`` between the configuration's bound and the smallest time
    known to be reachable: the first test is at the best step time (if nothing reaches it,
    the configuration is excluded), then bisection.  The configuration with the smallest
    bound always goes next, since it alone decides the gap; the loop stops at a
    configuration the table cannot take, at ``CHAIN_TOL``, or at ``CHAIN_SHARE`` of the work.
    """
    if not search.cluster.homogeneous or fixed_ranges(search.options) is not None or not search.open_configs:
        return
    stop = search.work + CHAIN_SHARE * search.work_budget
    reachable: dict[Config, float] = {}
    heap = [(bound, cfg) for cfg, (bound, _) in search.open_configs.items()]
    heapq.heapify(heap)
    while heap:
        bound, cfg = heapq.heappop(heap)
        if search.open_configs.get(cfg, (None,))[0] != bound:
            continue  # stale entry
        groups = search.open_configs[cfg][1]
        if bound >= search.best_step * (1 - 1e-9):
            del search.open_configs[cfg]
            search.pruned += 1
            continue
        if cfg.virtual_stages != 1 or cfg in search.chain_done:
            return  # the smallest bound cannot rise here, so neither can the gap
        if search.costs_at(cfg.microbatch_size(search.training.global_batch_size)).activation_slack > 0:
            return  # the table sums activations by prefix: not valid with negative kept inputs
        if search.work > stop or time.perf_counter() > search.wall_stop:
            return
        sm = search.stage_model(cfg)
        hi = min(reachable.get(cfg, math.inf), search.best_step * (1 - 1e-9))
        t = hi if cfg not in reachable else (bound + hi) / 2
        cells = chain_cells(sm, groups, t)
        cost = CHAIN_WORK * cells + CHAIN_STAGE_WORK * cfg.pipeline_degree
        if cells > MAX_CELLS or search.work + cost > stop:
            return  # too large for what is left of the budget: the bound stays where it is
        search.work += cost
        found = chain_split(sm, groups, search.cluster, search.training, search.options, t)
        if found is None:
            bound = t  # no split reaches t: the configuration's bound rises to it
            if cfg in reachable and reachable[cfg] - bound <= CHAIN_TOL * bound:
                search.chain_done.add(cfg)
        else:
            reachable[cfg] = t
            split = Split(found[0], found[1], tuple(range(cfg.pipeline_degree)))
            if split_memory_ok(sm, groups, split):
                consider(search, sm, groups, split)
            if t - bound <= CHAIN_TOL * t:
                search.chain_done.add(cfg)
        if bound >= search.best_step * (1 - 1e-9):
            del search.open_configs[cfg]
            search.pruned += 1
            continue
        search.open_configs[cfg] = (bound, groups)
        heapq.heappush(heap, (bound, cfg))


def tighten_cpsat(search: SearchState, *, budget_s: float) -> None:
    """Raise the bounds of open configurations with CP-SAT, best first, within ``budget_s``
    of CP-SAT's deterministic time (about seconds)."""
    left = budget_s

    open_items = sorted(search.open_configs.items(), key=lambda e: (e[1][0], e[0]))

    def can_model(cfg: Config) -> bool:
        # measured: CP-SAT (one worker) neither finds solutions nor moves the bound of
        # interleaved or large models within seconds; their bounds stay open.  Bounds the
        # boundary table of planner.bounds.chain_dp settled are its own model's, tightened further
        return (
            cfg.virtual_stages == 1
            and cfg not in search.chain_done
            and search.costs_at(cfg.microbatch_size(search.training.global_batch_size)).activation_slack == 0
            and cfg.num_stages * (search.profile.num_layers + 1) <= MAX_MODEL_SIZE
        )

    # the global bound cannot rise above the smallest bound CP-SAT cannot work on
    floor = min([*search.open_bounds, *(b for c, (b, _) in open_items if not can_model(c))], default=math.inf)
    for cfg, (lb, groups) in open_items:
        if lb >= floor:
            break
        remaining = left
        if lb >= search.best_step * (1 - 1e-9):
            del search.open_configs[cfg]
            continue
        if remaining <= 0.05:
            break
        if not can_model(cfg):
            continue
        sm = search.stage_model(cfg)
        hint = search.best_split_of.get(cfg)
        bound, ranges, _, _, used = config_bound(
            sm, groups, hint=hint, time_limit_s=min(PER_CONFIG_S, remaining),
            options_recompute=search.options.recompute,
        )
        left -= used
        if ranges is not None:
            split = with_recompute(search, sm, groups, ranges, tuple(sm.owner))
            if split is not None and split_memory_ok(sm, groups, split):
                consider(search, sm, groups, split)
        if bound is None:
            search.infeasible += 1
            del search.open_configs[cfg]
        elif bound > lb:
            if bound >= search.best_step * (1 - 1e-9):
                del search.open_configs[cfg]
            else:
                search.open_configs[cfg] = (bound, groups)
