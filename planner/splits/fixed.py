"""The user's own stage ranges (``--stages 0:4,4:8,...``): only recompute and the device order are left to choose."""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.search.model import Split, StageModel
from planner.search.space import Config, Group, fixed_ranges
from planner.search.state import SearchState, consider
from planner.splits.recompute import with_recompute


def fixed_split(search: SearchState, sm: StageModel, groups: Sequence[Group], order: Sequence[int]) -> Split | None:
    """The user's ranges with the cheapest recompute flags that fit."""
    ranges = fixed_ranges(search.options)
    assert ranges is not None
    stage_groups = tuple(order[sm.owner[s]] for s in range(len(ranges)))
    return with_recompute(search, sm, groups, tuple(ranges), stage_groups)


def solve_fixed(
    search: SearchState, sm: StageModel, cfg: Config, groups: list[Group], orders: Sequence[tuple[int, ...]], cheap: float
) -> None:
    best_here = math.inf
    for order in orders:
        split = fixed_split(search, sm, groups, order)
        if split is None:
            continue
        best_here = min(best_here, consider(search, sm, groups, split))
    if best_here == math.inf:
        search.infeasible += 1
    elif len(orders) > 1 and len(orders) < math.factorial(cfg.pipeline_degree):
        search.open_bounds.append(cheap)  # device orders were not all tried
