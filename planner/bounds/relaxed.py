"""The relaxed bottleneck bound of a one-chunk configuration, and the schedule's forced waits.

:func:`relaxed_bound` is the strong bound of a v = 1 configuration (level 1 of
:mod:`planner.search.driver`): the least ``t`` such that some split (and device order) has
every stage pass a relaxed test at ``t``, stage by stage the split bound of :mod:`planner.bounds.split`
(``in_f + idle + max(M·work + allreduce, M·pre_gradient + out_b)``, see
:meth:`planner.search.model.StageModel.stage_value`) with a memory lower bound that is
monotone in both ends.  Because the
test is monotone in the stage's end, a farthest-reach greedy decides it exactly, and a binary
search on ``t`` finds the bound.  :func:`idle_bound` is the wait that 1F1B's and GPipe's
fixed order forces on a stage (its downstream path at the fastest speed, without the later
stages' recompute: :mod:`planner.bounds.chain_dp` counts those exactly), counted only where
it keeps the test monotone.  :func:`relaxed_memory_fits` proves that nothing fits (any v).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.search.model import StageModel, bisect_feasible, farthest, recompute_options
from planner.search.space import Group
from planner.search.state import SearchState

#: relative precision of the configuration bounds' binary search (the bound only loses this much)
BOUND_REL_TOL = 2e-5


def relaxed_bound(
    search: SearchState, sm: StageModel, groups: Sequence[Group], lo: float, *, cutoff: float = math.inf
) -> float | None:
    """min over splits (and device orders) of ``max_s LB_s`` with a relaxed memory test.

    Returns None when even the relaxation does not fit memory: then no split of this
    configuration fits.  Only for v = 1.  With a finite ``cutoff`` (the best step time so
    far), a bound at or above it is returned as ``cutoff`` after one test, since then only
    "not better" matters.
    """
    cfg = sm.cfg
    kinds = sorted({g.kind for g in groups}, reverse=True)
    kind_groups = [next(g for g in groups if g.kind == kd) for kd in kinds]
    smax = max(g.speed for g in groups)
    k = cfg.pipeline_degree
    # the paths into and out of stage s cross the boundaries too
    xfers = search.transfers_at(sm.costs.microbatch_size, groups)

    def feasible(t: float) -> bool:
        search.work += cfg.pipeline_degree * len(kind_groups) * 2 * math.log2(sm.L + 1)
        a = 0
        for s in range(k):
            lo_b, hi_b = a, sm.L
            reach = a  # an empty stage is allowed in the relaxation
            in_f = sm.F[a] / smax + xfers.up[s]
            out_b = sm.gradient_prefix(a) / smax + xfers.up[s]
            for g in kind_groups:
                for rc in recompute_options(search.options, s):

                    def ok(
                b: int, g: Group = g, rc: bool = rc, a: int = a, s: int = s, in_f: float = in_f, out_b: float = out_b
            ) -> bool:
                        if b == a:
                            return True
                        wait = idle_bound(sm, a, b, rc, s, g.speed, smax, transfers=xfers.down[s])
                        value = sm.stage_value(in_f, out_b, a, b, rc, g.speed, sm.allreduce(a, b, g)) + wait
                        return value <= t and sm.memory_relaxed(a, b, rc, s) <= g.limit_bytes

                    b = farthest(ok, lo_b, hi_b)
                    if b is not None and b > reach:
                        reach = b
            a = reach
        return a == sm.L

    if not feasible(math.inf):
        return None
    if cutoff < math.inf and cutoff > lo and not feasible(cutoff):
        return cutoff  # no split reaches below the cutoff (the greedy test is exact)
    # only ``lo`` is used (a valid bound at any precision), so a coarser tolerance is enough
    return bisect_feasible(feasible, lo, rel_tol=BOUND_REL_TOL)[0]


def idle_bound(
    sm: StageModel,
    a: int,
    b: int,
    rc: bool,
    s: int,
    speed: float,
    smax: float,
    *,
    transfers: float = 0.0,
) -> float:
    """The schedule's forced wait on stage ``s`` = [a, b) (see :mod:`planner.bounds.split`),
    counted only where it keeps the stage test monotone (so the greedy stays exact).

    1F1B: ``max(0, downstream - w·backward)`` with ``w = min(K-s-1, M)``, monotone when
    ``M >= w + 1``, plus the wait for the first backward ``max(0, downstream - w·forward)``
    when ``M >= w + 2`` (then one more layer adds ``M·c_l`` to the work and takes at most
    ``(2 + w)·c_l`` off the two waits, so the test stays monotone); GPipe:
    ``max(0, downstream - (M-1)·forward)``, always monotone; ZB-H1: the first-backward wait
only, on the forward and input-gradient path (its drain is filled with weight gradients),
monotone since ``M >= w + 1``; other schedules: 0.  The downstream path is the
    later layers' forward + backward at the fastest speed without recompute, plus
    ``transfers`` (a lower bound of the later boundaries' transfers, both ways: constant in
    ``b``, so the test stays monotone).
    """
    cfg = sm.cfg
    m = cfg.num_microbatches
    if cfg.schedule == "zb-h1":
        # the first input gradient waits for the forward and input-gradient path downstream,
        # while the rank runs only its w = K-s-1 warm-up forwards (the drain is W's filler)
        w = min(cfg.pipeline_degree - s - 1, m)
        if m < w + 1:
            return 0.0
        down_g = (sm.F[-1] + sm.G[-1] - sm.F[b] - sm.G[b]) / smax + transfers
        return max(0.0, down_g - w * (sm.F[b] - sm.F[a]) / speed)
    down = (sm.F[-1] + sm.B[-1] - sm.F[b] - sm.B[b]) / smax + transfers
    if cfg.schedule == "1f1b":
        w = min(cfg.pipeline_degree - s - 1, m)
        if m < w + 1:
            return 0.0
        f = sm.F[b] - sm.F[a]
        bw = (sm.B[b] - sm.B[a] + (sm.R[b] - sm.R[a] if rc else 0.0)) / speed
        idle = max(0.0, down - w * bw)
        if m >= w + 2:
            idle += max(0.0, down - w * f / speed)
        return idle
    if cfg.schedule == "gpipe":
        return max(0.0, down - (m - 1) * (sm.F[b] - sm.F[a]) / speed)
    return 0.0


def relaxed_memory_fits(search: SearchState, sm: StageModel, groups: Sequence[Group]) -> bool:
    """False only when no split of the configuration fits memory (any v).

    Relaxation: each chunk alone must fit its rank's largest device (a rank holds at least
    that chunk), with the monotone memory lower bound and empty chunks allowed; the
    farthest-reach greedy decides it exactly.
    """
    cfg = sm.cfg
    search.work += cfg.num_stages * 2 * math.log2(sm.L + 1)
    limit = max(g.limit_bytes for g in groups)
    a = 0
    for j in range(cfg.num_stages):
        reach = a
        for rc in recompute_options(search.options, j):

            def ok(b: int, rc: bool = rc, a: int = a, j: int = j) -> bool:
                return b == a or sm.memory_relaxed(a, b, rc, j) <= limit

            b = farthest(ok, a, sm.L)
            if b is not None and b > reach:
                reach = b
        a = reach
    return a == sm.L
