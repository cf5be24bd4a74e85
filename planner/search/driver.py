"""The planner's driver: the fastest plan that fits, with a proven bound on its distance to optimal.

``solve(profile, cluster, training, options)`` (re-exported as :func:`planner.solver.solve`)
searches the data-parallel degree D, the pipeline degree K, the micro-batch count M (and so
the micro-batch size), the schedule (gpipe, 1f1b, interleaved-1f1b with v chunks), the stage
boundaries, recompute per stage, and, on heterogeneous clusters, which devices take which
pipeline position.

Method (best-first branch and bound over configurations, :func:`_branch_and_bound`):

1. Every configuration (D, K, M, schedule, v) the options allow
   (:func:`planner.search.space.enumerate_configs`) gets a closed-form lower bound
   (:func:`planner.bounds.work.cheap_bound`: work, fill, all-reduce, the recompute that memory
   forces, indivisible layers, pinned ranks, the last stage).  The ``INCUMBENT_TRIES`` that
   promise most (the balanced-split estimate) are solved first; then the configuration with
   the smallest bound always advances next, and configurations whose bound reaches the best
   step time found are skipped.
2. Advancing a configuration first computes its strong bound: for v = 1 the exact bottleneck
   of a relaxed stage test (:func:`planner.bounds.relaxed.relaxed_bound`), for v > 1 the
   memory bounds (:func:`planner.bounds.memory.memory_bounds`); either may prove that nothing
   fits.  Once a plan is known, one test at its step time decides whether the configuration
   can beat it at all.  Configurations too large to simulate stop there.
3. Then it searches for a plan (:mod:`planner.splits`).  Small chains are enumerated
   completely, in bound order, so their optimum is exact (:mod:`planner.splits.exhaustive`).
   Longer ones (v = 1) get greedy splits with the exact memory model
   (:mod:`planner.splits.greedy`); interleaved configurations get time-balanced,
   memory-aware and per-chunk-recompute chunks (:mod:`planner.splits.interleaved`); user-fixed
   ranges only choose recompute (:mod:`planner.splits.fixed`).  Every candidate is simulated
   only if its split bound can beat the best plan (:func:`planner.search.state.consider`).
4. The baselines' splits are candidates too (:mod:`planner.splits.baseline_seed`), so the plan
   is never worse than any of them, and a hill climb moves the best plan's boundaries one layer
   at a time (:mod:`planner.splits.polish`).
5. Open one-chunk configurations are tightened (:mod:`planner.search.tighten`): the boundary
   table of :mod:`planner.bounds.chain_dp` on homogeneous clusters, then CP-SAT
   (:mod:`planner.bounds.cpsat`).

The returned plan comes out of :func:`planner.costmodel.estimate`.  ``optimal`` (gap 0) is
reported only when every configuration was solved to optimality or excluded by a bound;
otherwise the status is ``feasible`` and ``gap`` is ``(step - bound) / step`` for the
smallest bound still open.  When nothing fits, :func:`planner.infeasible.diagnose` says why.

Where things live (each module imports only those above it in this list, besides the schema,
cost model and simulator; :mod:`planner.splits.baseline_seed` also uses :mod:`planner.baselines`,
and this module :mod:`planner.infeasible`, which tests through ``feasibility``):

* ``planner/search/space.py`` — the configuration space: ``Config``, device groups,
  ``enumerate_configs``, fixed ranges, device orders.
* ``planner/search/model.py`` — the split model: ``Split``, ``StageModel`` (a stage's time and
  memory from prefix sums), ``quick_step`` (exact simulated step), ``farthest``,
  ``bisect_feasible``.
* ``planner/bounds/split.py`` — the lower bound of one split, and least transfers.
* ``planner/search/state.py`` — ``SearchState`` (incumbent, open bounds, caches, work
  counter) and ``consider``.
* ``planner/bounds/`` — the configuration bounds, one family per module: ``knapsack.py``
  (shared tables), ``chunk_memory.py`` (per-chunk memory, whole-layer runs, outliers),
  ``memory.py`` (forced recompute, static memory), ``work.py`` (work, fill, all-reduce,
  pinned ranks: ``cheap_bound``), ``relaxed.py`` (relaxed bottleneck and forced idle, v = 1),
  ``chain_dp.py`` (the boundary table, v = 1), ``cpsat.py`` (the CP-SAT model).
* ``planner/splits/`` — split searches: ``recompute.py``, ``fixed.py``, ``greedy.py``,
  ``interleaved.py``, ``exhaustive.py``, ``polish.py``, ``baseline_seed.py``.
* ``planner/search/tighten.py`` — raising open bounds after the search.
* ``planner/search/feasibility.py`` — "does any split fit?", the public API of
  :mod:`planner.infeasible`.
* this module — ``solve`` and the branch and bound.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence

from planner.bounds.memory import memory_bounds
from planner.bounds.relaxed import relaxed_bound, relaxed_memory_fits
from planner.bounds.work import cheap_bound
from planner.costmodel import estimate, static_bytes
from planner.infeasible import diagnose
from planner.schema import Cluster, Plan, PlanOptions, Profile, SolverInfo, TrainingSetup
from planner.search.model import StageModel, work_total
from planner.search.space import (
    Config,
    Group,
    device_orders,
    enumerate_configs,
    fixed_ranges,
    make_groups,
)
from planner.search.state import SearchState
from planner.search.tighten import tighten_chains, tighten_cpsat
from planner.splits.baseline_seed import seed_with_baselines
from planner.splits.exhaustive import enumerate_splits
from planner.splits.fixed import solve_fixed
from planner.splits.greedy import greedy_candidates
from planner.splits.interleaved import interleaved_candidates
from planner.splits.polish import polish

#: configurations solved in order of promise before the search turns best-first
INCUMBENT_TRIES = 6
#: share of the work budget the configuration search may use
SEARCH_SHARE = 0.6
#: work units (about one simulated action, or one stage test) per second of time limit
WORK_PER_SECOND = 400_000.0
#: wall-clock safety net: stop searching after this multiple of the time limit regardless
WALL_SAFETY = 3.0
#: least time CP-SAT gets to tighten open bounds (seconds, within the time limit)
TIGHTEN_MIN_S = 0.25
#: configurations whose schedule has more actions (2 x M x stages) are not simulated
SIM_ACTION_LIMIT = 300_000


def solve(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions | None = None,
) -> Plan:
    """The plan with the lowest predicted step time whose every stage fits its device.

    Raises :class:`planner.errors.InputError` for contradictory options and
    :class:`planner.errors.InfeasibleError` (with ``details``: ``layer``, ``layer_bytes``,
    ``min_memory_bytes``, ``min_devices``) when nothing fits.
    """
    options = options or PlanOptions()
    start = time.perf_counter()
    configs = enumerate_configs(profile, cluster, training, options)
    search = SearchState(profile, cluster, training, options, deadline=start + options.time_limit_s)
    # Budgets count work, not seconds, so that the same input gives the same plan on any
    # machine and load; WORK_PER_SECOND makes them match the time limit on a 2-core host.
    # The configuration search stops at SEARCH_SHARE of it, leaving room for the baselines'
    # candidates, the polish, CP-SAT and the final estimate.
    search.work_budget = options.time_limit_s * WORK_PER_SECOND
    search.wall_stop = start + WALL_SAFETY * options.time_limit_s
    _branch_and_bound(search, configs)
    seed_with_baselines(search, configs)
    polish(search)
    tighten_chains(search)
    if search.best is None:
        raise diagnose(profile, cluster, training, options)
    # CP-SAT gets what is left of the budget (at least TIGHTEN_MIN_S), in its deterministic time
    left = max(0.0, search.work_budget - search.work) / WORK_PER_SECOND
    tighten_cpsat(search, budget_s=max(TIGHTEN_MIN_S, min(left, options.time_limit_s)))
    cfg, split, groups = search.best
    bound = min([search.best_step, *search.open_bounds, *(b for b, _ in search.open_configs.values())])
    # the search compares plans without the calibrated fixed overhead (every plan pays it);
    # the gap is relative to the full step
    overhead = profile.step_overhead_ms
    full = search.best_step + overhead
    gap = max(0.0, (search.best_step - bound) / full) if full > 0 else 0.0
    if gap <= 1e-9:
        status, gap = "optimal", 0.0
    else:
        status = "feasible"
    message = (
        f"{len(configs)} configurations: {search.pruned} excluded by bounds, "
        f"{search.infeasible} proven not to fit, "
        f"{max(0, search.visited - search.pruned_after_visit - search.infeasible_after_visit)} solved"
        + (f"; {search.too_big} too large to simulate" if search.too_big else "")
        + ("; time limit reached" if search.timed_out else "")
    )
    plan = estimate(
        profile,
        cluster,
        training,
        list(split.ranges),
        num_microbatches=cfg.num_microbatches,
        schedule=cfg.schedule,
        recompute=list(split.recompute),
        data_parallel=cfg.data_parallel,
        pipeline_degree=cfg.pipeline_degree,
        devices=[list(groups[g].devices) for g in split.groups],
        solver=SolverInfo(status=status, gap=gap, wall_time_s=0.0, message=message),
    )
    if abs(plan.predicted.step_time_ms - full) > 1e-6 * max(1.0, full):
        raise AssertionError(  # pragma: no cover - quick_step and estimate are tested equal
            f"internal error: the solver predicted {search.best_step} ms but estimate gives "
            f"{plan.predicted.step_time_ms} ms; please report this input"
        )
    wall = time.perf_counter() - start
    return plan.model_copy(
        update={"solver": SolverInfo(status=status, gap=gap, wall_time_s=wall, message=message)}
    )


def _branch_and_bound(search: SearchState, configs: Sequence[Config]) -> None:
    """Best-first branch and bound over the configurations, in three levels of effort.

    Level 0 is :func:`cheap_bound`, for every configuration.  Level 1 is the configuration's
    strong bound (v = 1: :func:`relaxed_bound`; v > 1: :func:`memory_bounds`), or its proof
    that nothing fits.  Level 2 is the search for a plan (:func:`enumerate_splits`, the greedy
    splits), after which a configuration is solved or stays open at its bound.

    First the ``INCUMBENT_TRIES`` configurations that promise most (the textbook step time
    of a balanced split) go through every level, so that a good plan prunes the rest; then
    the configuration with the smallest bound is always the next to advance a level, since
    it alone decides the proven gap.  The search stops when the smallest bound reaches the
    best plan (optimal) or at SEARCH_SHARE of the work budget; what is left stays open at
    its bound.
    """
    entries = []
    group_cache: dict[tuple[int, int], list[Group]] = {}
    for cfg in configs:
        key = (cfg.data_parallel, cfg.pipeline_degree)
        if key not in group_cache:
            group_cache[key] = make_groups(search.cluster, search.training, *key)
        groups = group_cache[key]
        if not static_fits(search, cfg, groups):
            search.infeasible += 1
            continue
        entries.append((cheap_bound(search, cfg, groups), cfg, groups))
    promising = sorted(entries, key=lambda e: (max(e[0], _promise(search, e[1], e[2])), e[1]))
    started: set[Config] = set()
    for cheap, cfg, groups in promising:
        if search.best is not None and len(started) >= INCUMBENT_TRIES:
            break
        if search.best is not None and _out_of_budget(search):
            break
        started.add(cfg)
        if cheap >= search.best_step:
            search.pruned += 1
            continue
        first = _advance(search, cfg, groups, cheap, 0)
        if first is not None:
            _advance(search, cfg, groups, *first)
    heap = [(cheap, 0, cfg, groups) for cheap, cfg, groups in entries if cfg not in started]
    heapq.heapify(heap)
    while heap:
        bound, level, cfg, groups = heapq.heappop(heap)
        if bound >= search.best_step:
            search.pruned += 1 + len(heap)
            return
        if search.best is not None and _out_of_budget(search):
            search.timed_out = True
            for bound_, _, cfg_, groups_ in [(bound, level, cfg, groups), *heap]:
                if bound_ >= search.best_step:
                    search.pruned += 1
                else:
                    search.open_configs[cfg_] = (bound_, groups_)
            return
        nxt = _advance(search, cfg, groups, bound, level)
        if nxt is not None:
            heapq.heappush(heap, (nxt[0], nxt[1], cfg, groups))


def _advance(
    search: SearchState, cfg: Config, groups: list[Group], bound: float, level: int
) -> tuple[float, int] | None:
    """Take ``cfg`` from ``level`` to the next one (see :func:`_branch_and_bound`).

    Returns its new (bound, level) while it needs more work, or None once it is settled:
    solved, pruned, proven not to fit, or left open (``search.open_configs``) at its bound.
    """
    g = search.training.global_batch_size
    fixed = fixed_ranges(search.options) is not None
    too_big = 2 * cfg.num_microbatches * cfg.num_stages > SIM_ACTION_LIMIT
    sm = StageModel(search.costs_at(cfg.microbatch_size(g)), cfg, search.training)
    if level == 0:
        search.visited += 1
        if too_big:
            search.too_big += 1
        if fixed:
            if too_big:
                search.open_configs[cfg] = (bound, groups)
            else:
                solve_fixed(search, sm, cfg, groups, device_orders(groups), bound)
            return None
        lb: float | None
        if cfg.virtual_stages == 1:
            lb = relaxed_bound(search, sm, groups, bound, cutoff=search.best_step)
        else:
            lb = memory_bounds(search, cfg, groups, lo=bound)
            if lb == math.inf or not relaxed_memory_fits(search, sm, groups):
                lb = None
        if lb is None:
            search.infeasible += 1
            search.infeasible_after_visit += 1
            return None
        if lb >= search.best_step:
            search.pruned += 1
            search.pruned_after_visit += 1
            return None
        if too_big:
            search.open_configs[cfg] = (lb, groups)  # its bound is all it gets
            return None
        return lb, 1
    orders = device_orders(groups)
    if enumerate_splits(search, sm, cfg, groups, bound):
        return None
    if cfg.virtual_stages == 1:
        step = greedy_candidates(search, sm, cfg, groups, orders, bound)
        best_here = math.inf if step is None else step
    else:
        best_here = interleaved_candidates(search, sm, groups, orders)
    if best_here > bound * (1 + 1e-9):
        search.open_configs[cfg] = (bound, groups)
    return None


def _out_of_budget(search: SearchState) -> bool:
    return search.work > SEARCH_SHARE * search.work_budget or time.perf_counter() > search.wall_stop


def _promise(search: SearchState, cfg: Config, groups: Sequence[Group]) -> float:
    """Step time of a perfectly balanced split: W (M + (K-1)/v) / (K·speed)."""
    costs = search.costs_at(cfg.microbatch_size(search.training.global_batch_size))
    w = work_total(costs)
    k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
    speed = sum(g.speed for g in groups) / len(groups)
    return w * (m + (k - 1) / v) / (k * speed)


def static_fits(search: SearchState, cfg: Config, groups: Sequence[Group]) -> bool:
    """False when the parameters, gradients and optimizer state alone cannot fit the K ranks
    (each rank's share is at most its largest device's usable memory)."""
    total = static_bytes(search.profile_param_bytes, search.training)
    return total <= sum(g.limit_bytes for g in groups)
