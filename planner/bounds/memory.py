"""Memory bounds of a configuration: the recompute that memory forces, over the whole model.

* :func:`memory_work_bound` (every configuration, part of :func:`planner.bounds.work.cheap_bound`):
  ranks holding many micro-batches in flight keep few activations, so a knapsack over the
  layers' work per activation byte (:class:`planner.bounds.knapsack.Knapsack`) gives the work
  that must be recomputed, at ``1 + phi`` times its cost.
* :func:`static_memory_bound`: the same with each rank's parameter state taken out of its memory.
* :func:`memory_bounds`: the strong bound of an interleaved configuration, the larger of
  :func:`static_memory_bound` and the chunk-by-chunk bound of :mod:`planner.bounds.chunk_memory`.

Each is a lower bound of the step time of every split of the configuration (infinite when
nothing fits); ``tests/planner/test_bounds.py`` checks them against exhaustive search.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.bounds.chunk_memory import chunk_memory_bound
from planner.bounds.knapsack import knapsack_at, recompute_freedom, state_per_work
from planner.cost import static_bytes
from planner.search.model import StageModel
from planner.search.space import Config, Group
from planner.search.state import SearchState


def memory_work_bound(search: SearchState, cfg: Config, groups: Sequence[Group]) -> float:
    """A lower bound of any split of ``cfg`` that counts the recompute memory forces.

    When rank ``r`` starts its first backward it holds ``n_{r,j}`` micro-batches of each chunk
    j (:func:`planner.schedules.first_backward_counts`), so the activation bytes its chunks
    without recompute keep satisfy ``sum_j n_{r,j}·a_j <= limit`` and total at most ``A_r =
    limit / n_r`` with ``n_r = min_j n_{r,j}`` (``limit``: the largest usable memory of any
    group).
    Work of a recomputed layer costs ``1 + phi`` times its forward + backward
    (``phi = min r / (f + b)``, ``r`` what its recompute re-runs).  Rank ``r`` runs ``M`` micro-batches within ``T``, so it
    does at most ``t_r = T · speed_r / M`` of work (counting recompute).  For any set ``S`` of
    ranks, the work done without recompute is at most ``sum_{r in S} t_r`` plus the knapsack
    value (most work per activation byte, fractional) of the other ranks' capacities
    ``sum_{r not in S} A_r``; the rest of the model ``W`` is recomputed.  Taking ``S`` = the j
    ranks with the largest ``A_r`` and the j fastest speeds (valid for every assignment of
    groups to positions), covering ``W`` needs, for every j,

        T >= M · ((1 + phi)·W - phi·kappa_j) / (sum(speed) + phi·sigma_j)

    with ``kappa_j`` the knapsack value of the K - j smallest capacities and ``sigma_j`` the
    sum of the j largest speeds.  Without recompute allowed, ``T >= M (W - kappa_j) / sigma_j``
    (infinite when ``kappa_0 < W``: nothing fits).  Transfers, bubbles and all-reduce only
    add to the step time, so they are left out.
    """
    b = cfg.microbatch_size(search.training.global_batch_size)
    knap = knapsack_at(search, b)
    k, m = cfg.pipeline_degree, cfg.num_microbatches
    limit = max(g.limit_bytes for g in groups)
    held = rank_counts(cfg, search.profile.num_layers)
    caps = sorted((limit / n for n in held), reverse=True)
    speeds = sorted((g.speed for g in groups), reverse=True)
    ssum = sum(speeds)
    keep_allowed, allow_rc = recompute_freedom(search.options)
    all_rc = not keep_allowed
    w, phi = knap.work, knap.phi
    if all_rc:
        return m * (1 + phi) * w / ssum
    best = 0.0
    suffix = 0.0  # sum of the K - j smallest capacities, j from K down to 0
    sigma = [0.0]
    for sp in speeds:
        sigma.append(sigma[-1] + sp)
    # every rank's parameters, gradients and optimizer state take memory that its
    # activations cannot use: the ranks outside S hold at least static - j·limit of it, which
    # costs them at least 1 / n_max activation bytes per byte
    static = static_bytes(search.profile_param_bytes, search.training)
    n_max = max(held)
    for j in range(k, -1, -1):
        if j < k:
            suffix += caps[j]
        kappa = knap.value(max(0.0, suffix - max(0.0, static - j * limit) / n_max))
        if allow_rc:
            best = max(best, m * ((1 + phi) * w - phi * kappa) / (ssum + phi * sigma[j]))
        elif kappa < w * (1 - 1e-12):
            if sigma[j] <= 0:
                return math.inf
            best = max(best, m * (w - kappa) / sigma[j])
    return best


def static_memory_bound(search: SearchState, cfg: Config, groups: Sequence[Group]) -> float:
    """:func:`memory_work_bound` with each rank's parameter state taken out of its memory.

    A rank holding work ``y_r`` (forward + backward at speed 1 of its layers) keeps at least
    ``sigma·y_r`` bytes of parameters, gradients and optimizer state (``sigma``: least state
    bytes per unit of work over the layers), so its chunks without recompute keep at most
    ``a_r = (limit - sigma·y_r) / n_r`` activation bytes (``n_r`` as in :func:`memory_work_bound`).  The work done without recompute,
    over all ranks, is at most the knapsack value of ``sum a_r``, and so at most
    ``alpha + beta·sum a_r`` for any line ``(alpha, beta)`` of the concave knapsack curve.
    A rank with work ``y_r`` of which ``z_r`` is recomputed needs ``y_r + phi·z_r <= t_r =
    T·speed/M``.  Hence ``sum_r (y_r - z_r) + gamma_r·y_r <= C`` with ``gamma_r = beta·sigma/n_r``
    and ``C = alpha + beta·limit·sum 1/n_r``: each rank's use of ``C`` is convex piecewise
    linear in ``y_r`` (``gamma_r`` per unit up to ``t_r/(1+phi)``, all recomputed, then
    ``1 + gamma_r + 1/phi``), so the most work the ranks can cover within ``T`` is a
    fractional greedy over those pieces.  The bound is the least ``T`` (bisection) at which
    it reaches the model's work ``W``; the largest over a few knapsack lines is returned
    (infinite when no ``T`` covers ``W``: nothing fits).  Heterogeneous speeds use the
    fastest for every rank.
    """
    b = cfg.microbatch_size(search.training.global_batch_size)
    knap = knapsack_at(search, b)
    costs = search.costs_at(b)
    k, m = cfg.pipeline_degree, cfg.num_microbatches
    limit = max(g.limit_bytes for g in groups)
    smax = max(g.speed for g in groups)
    inflight = [c.joint for c in search.memory_counts(cfg)]
    sigma = state_per_work(costs, search.training)
    keep_allowed, allow_rc = recompute_freedom(search.options)
    if not keep_allowed:
        return 0.0  # everything recomputed: memory_work_bound already counts it exactly
    w, phi = knap.work, knap.phi
    if w <= 0:
        return 0.0
    inv = sum(1.0 / n for n in inflight)
    a_star = limit * inv
    lines = knap.tangents([a_star * theta for theta in (1.0, 0.5, 0.15)])

    best = 0.0
    for alpha, beta in sorted(lines):
        cap = alpha + beta * limit * inv
        gammas = [beta * sigma / n for n in inflight]

        def coverable(t: float, cap: float = cap, gammas: list[float] = gammas) -> float:
            pieces: list[tuple[float, float]] = []
            for g_r in gammas:
                if not allow_rc:
                    pieces.append((1 + g_r, t))
                elif phi <= 0:
                    pieces.append((g_r, t))
                else:
                    pieces.append((g_r, t / (1 + phi)))
                    pieces.append((1 + g_r + 1 / phi, t - t / (1 + phi)))
            pieces.sort()
            left, total = cap, 0.0
            for cost, amount in pieces:
                if cost <= 0:
                    total += amount
                    continue
                take = min(amount, left / cost)
                total += take
                left -= take * cost
                if left <= 0:
                    break
            return total

        def per_rank(t: float, alpha: float = alpha, beta: float = beta) -> float:
            total = 0.0
            for n in inflight:
                big_p = alpha + beta * limit / n
                big_q = beta * sigma / n
                y_cap = limit / sigma if sigma > 0 else math.inf
                if big_p - big_q * t >= t:
                    y = t
                elif not allow_rc:
                    y = big_p / (1 + big_q)
                elif phi <= 0:
                    y = t
                else:
                    y = (t + phi * big_p) / (1 + phi + phi * big_q)
                    if big_p - big_q * y < 0:
                        y = t / (1 + phi)
                total += max(0.0, min(y, t, y_cap))
            return total

        for cover in (coverable, per_rank):
            # per-rank budget t = T·smax/M; coverage is nondecreasing in t
            lo, hi = 0.0, w / k
            while cover(hi) < w * (1 - 1e-12):
                if hi > w * 1e6:
                    return math.inf
                lo, hi = hi, hi * 2
            for _ in range(40):
                if hi - lo <= 1e-9 * hi:
                    break
                mid = (lo + hi) / 2
                if cover(mid) >= w * (1 - 1e-12):
                    hi = mid
                else:
                    lo = mid
            best = max(best, lo * m / smax)
    return best


def rank_counts(cfg: Config, num_layers: int) -> list[float]:
    """Per rank, a count such that the activation bytes its kept chunks hold total at most
    ``limit / count`` (:meth:`planner.search.model.StageModel.joint_of`, at least 1)."""
    return [max(1.0, j) for j in StageModel.joint_of(cfg, num_layers)]


def memory_bounds(search: SearchState, cfg: Config, groups: Sequence[Group], *, lo: float = 0.0) -> float:
    """The larger of ``lo``, :func:`static_memory_bound` and
    :func:`planner.bounds.chunk_memory.chunk_memory_bound`
    (infinite when either proves that nothing fits), with their work counted; a bound at or
    above the best step time so far comes back as that step time."""
    search.work += 800 * cfg.pipeline_degree
    bound = max(lo, static_memory_bound(search, cfg, groups))
    if bound == math.inf or bound >= search.best_step:
        return bound
    return max(bound, chunk_memory_bound(search, cfg, groups, lo=bound, cutoff=search.best_step))
