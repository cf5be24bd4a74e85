"""Recompute flags for given stage ranges: only where memory needs them.

:func:`with_recompute` turns ranges into a :class:`planner.search.model.Split` that fits
memory, or None.  Every split search ends with it (the fixed, interleaved and enumerated
splits, the polish, the baselines' splits, CP-SAT's), and so does the feasibility test of
:mod:`planner.search.feasibility`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from planner.costmodel import rank_memory_bytes
from planner.search.model import Split, StageModel, recompute_options
from planner.search.space import Group
from planner.search.state import SearchState


def with_recompute(
    search: SearchState, sm: StageModel, groups: Sequence[Group], ranges: tuple[tuple[int, int], ...], stage_groups: tuple[int, ...]
) -> Split | None:
    """Recompute only where needed: per stage (v = 1) or per rank (all its chunks, v > 1)."""
    k = sm.cfg.pipeline_degree
    n = len(ranges)
    search.work += n
    rcs = [False] * n
    for r in range(k):
        own = [s for s in range(n) if s % k == r]
        choices = [tuple(recompute_options(search.options, s)) for s in own]
        found = False
        # try no recompute first, then everything the options allow, cheapest first
        combos = sorted(
            itertools.product(*choices),
            key=lambda c: sum(sm.F[ranges[s][1]] - sm.F[ranges[s][0]] for s, x in zip(own, c, strict=True) if x),
        )
        for combo in combos[:16]:
            mem = rank_memory_bytes(
                sm.costs, [ranges[s] for s in own], list(combo), sm.training, inflight=sm.inflight[r]
            )
            if math.ceil(mem) <= groups[stage_groups[own[0]]].limit_bytes:
                for s, x in zip(own, combo, strict=True):
                    rcs[s] = x
                found = True
                break
        if not found:
            return None
    return Split(ranges, tuple(rcs), stage_groups)
