"""Does some split of a configuration fit memory?  The search's public test for diagnosis.

:func:`config_fits` answers with the very split searches :func:`planner.search.driver.solve`
runs (every split when the chain is small enough to enumerate; else the user's fixed ranges,
the interleaved split or the farthest-reach greedy with exact memory), so a fix that
:mod:`planner.infeasible` suggests on its strength is one ``solve`` accepts.
"""

from __future__ import annotations

import math

from planner.cost import LayerCosts
from planner.schema import Cluster, PlanOptions, Profile, TrainingSetup
from planner.search.space import Config, device_orders, fixed_ranges, make_groups
from planner.search.state import SearchState
from planner.splits.exhaustive import enumerable, fitting_splits
from planner.splits.fixed import fixed_split
from planner.splits.greedy import greedy_split
from planner.splits.interleaved import interleaved_split


def config_fits(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions,
    cfg: Config,
    costs: LayerCosts,
) -> bool:
    """True when the solver would find a split of ``cfg`` that fits memory.

    ``costs`` are the layer costs at ``cfg``'s micro-batch size (callers share them
    between configurations).
    """
    search = SearchState(
        profile, cluster, training, options, deadline=math.inf, costs={costs.microbatch_size: costs}
    )
    groups = make_groups(cluster, training, cfg.data_parallel, cfg.pipeline_degree)
    sm = search.stage_model(cfg)
    orders = device_orders(groups)
    fixed = fixed_ranges(options) is not None
    if not fixed and enumerable(sm.L, cfg.num_stages, len(orders), small_instances=False):
        # the solver enumerates such chains: so does this test.  (It also enumerates the
        # longer chains of small models; there the greedy below may miss a fitting split, so
        # a fix suggested on its strength can ask for more than needed, never for too little:
        # every split it finds is one the solver's enumeration finds too.)
        return next(fitting_splits(search, sm, groups, orders), None) is not None
    for order in orders:
        if fixed:
            split = fixed_split(search, sm, groups, order)
        elif cfg.virtual_stages > 1:
            split = interleaved_split(search, sm, groups, order)
        else:
            split = greedy_split(search, sm, groups, order, math.inf)
        if split is not None:
            return True
    return False
