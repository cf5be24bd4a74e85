"""The final polish: a hill climb on the best plan's stage boundaries, on the simulated step."""

from __future__ import annotations

import time

from planner.search.space import fixed_ranges
from planner.search.state import SearchState, consider
from planner.splits.recompute import with_recompute

#: share of the work budget the final boundary polish may use
POLISH_SHARE = 0.15


def polish(search: SearchState) -> None:
    """Hill-climb the best plan's boundaries one layer at a time on the simulated step.

    The greedy splits minimise a bound, not the simulated makespan; moving a boundary by
    one layer, keeping the move when the simulated step drops, closes part of that
    difference.  Uses at most POLISH_SHARE of the work budget.
    """
    if search.best is None:
        return
    stop_work = search.work + POLISH_SHARE * search.work_budget
    cfg, split, groups = search.best
    sm = search.stage_model(cfg)
    if fixed_ranges(search.options) is not None:
        return
    improved = True
    while improved:
        improved = False
        cfg, split, groups = search.best
        bounds = [r[0] for r in split.ranges] + [sm.L]
        for i in range(1, len(bounds) - 1):
            for delta in (-1, 1):
                if search.work > stop_work or time.perf_counter() > search.wall_stop:
                    return
                moved = list(bounds)
                moved[i] += delta
                if not moved[i - 1] < moved[i] < moved[i + 1]:
                    continue
                ranges = tuple((moved[j], moved[j + 1]) for j in range(len(moved) - 1))
                candidate = with_recompute(search, sm, groups, ranges, split.groups)
                if candidate is None:
                    continue
                before = search.best_step
                search.work += len(ranges)
                consider(search, sm, groups, candidate)
                if search.best_step < before * (1 - 1e-12):
                    improved = True
                    break
            if improved:
                break
