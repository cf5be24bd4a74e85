"""The planner's driver: the fastest plan that fits, with a proven bound on its distance to optimal.

``solve(profile, cluster, training, options)`` (re-exported as :func:`planner.solver.solve`)
searches the data-parallel degree D, the pipeline degree K, the micro-batch count M (and so
the micro-batch size), the schedule (gpipe, 1f1b, interleaved-1f1b with v chunks, the
zero-bubble zb-h1, zb-h2, zbv, dualpipev and interleaved-zb, and ``planned``: the orders of
:mod:`planner.schedules`), the stage boundaries, recompute per stage, and, on heterogeneous
clusters, which devices take which pipeline position.

Method (best-first branch and bound over configurations, :func:`_branch_and_bound`), in two
rounds: the classic schedules (gpipe, 1f1b, interleaved-1f1b) first, then the newer ones
starting from the best plan so far (with ``NEW_SHARE`` more of the budget; the best classic
split under the newer schedules of the same shape is their first candidate).  In a large
space (more than ``NEW_CONFIG_LIMIT`` configurations of the newer schedules) those are tried
only on the D, K and M of the best classic plan, and not beyond ``NEW_ACTION_LIMIT``
actions a step: the space, and the proven gap, then cover that (the message says how many
were left out).  In each round:

1. Every configuration (D, K, M, schedule, v) the options allow
   (:func:`planner.search.space.enumerate_configs`) gets a closed-form lower bound
   (:func:`planner.bounds.work.cheap_bound`: work, fill, all-reduce, the recompute that memory
   forces, indivisible layers, pinned ranks, the last stage).  The ``INCUMBENT_TRIES`` that
   promise most (the balanced-split estimate; the ``ONE_CHUNK_TRIES`` best one-chunk ones
   among them first) are solved first; then the configuration with
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
   memory-aware, per-chunk-recompute and rank-balanced chunks
   (:mod:`planner.splits.interleaved`); user-fixed
   ranges only choose recompute (:mod:`planner.splits.fixed`).  Every candidate is simulated
   only if its split bound can beat the best plan (:func:`planner.search.state.consider`).
4. The baselines' splits are candidates too (:mod:`planner.splits.baseline_seed`), so the plan
   is never worse than any of them, and a hill climb moves the best plan's boundaries one layer
   at a time (:mod:`planner.splits.polish`).
5. Open one-chunk configurations are tightened (:mod:`planner.search.tighten`): the boundary
   table of :mod:`planner.bounds.chain_dp` on homogeneous clusters, then CP-SAT
   (:mod:`planner.bounds.cpsat`).

The returned plan comes out of :func:`planner.cost.estimate`.  ``optimal`` (gap 0) is
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
from dataclasses import dataclass

from planner.bounds.memory import memory_bounds
from planner.bounds.relaxed import relaxed_bound, relaxed_memory_fits
from planner.bounds.work import cheap_bound
from planner.cost import (
    Layout,
    ScheduleTemplates,
    estimate,
    lower_bound_ms,
    profile_in_dtype,
    static_bytes,
)
from planner.errors import InfeasibleError, SearchCutShortError
from planner.infeasible import diagnose
from planner.schema import Cluster, Plan, PlanOptions, Profile, Schedule, SolverInfo, TrainingSetup
from planner.search.model import work_total
from planner.search.space import (
    SIM_ACTION_LIMIT,
    Config,
    Group,
    device_orders,
    enumerate_configs,
    fixed_ranges,
    make_groups,
)
from planner.search.state import SearchState, consider
from planner.search.tighten import tighten_chains, tighten_cpsat
from planner.splits.baseline_seed import seed_with_baselines, seed_with_stack_rule
from planner.splits.exhaustive import enumerate_splits
from planner.splits.fixed import solve_fixed
from planner.splits.greedy import greedy_candidates
from planner.splits.interleaved import interleaved_candidates
from planner.splits.polish import polish
from planner.splits.recompute import with_recompute
from planner.splits.vshape import V_SCHEDULES, vshape_candidates

#: configurations solved in order of promise before the search turns best-first: this many of
#: the classic schedules (gpipe, 1f1b, interleaved-1f1b), then of the others
INCUMBENT_TRIES = 6
INCUMBENT_TRIES_NEW = 3
#: of those tries, this many go to the most promising one-chunk configurations first
ONE_CHUNK_TRIES = 3
#: work units of one configuration's cheap bound (counted for the newer schedules)
CHEAP_WORK = 150
#: with more configurations of the newer schedules than this, they are tried only on the
#: (D, K, M) of the ``NEW_SHAPES`` best classic plans
NEW_CONFIG_LIMIT = 600
NEW_SHAPES = 1
#: ... and only where a step has at most this many actions (3·M·K·v): longer ones are left out
NEW_ACTION_LIMIT = 40_000
CLASSIC = frozenset({"gpipe", "1f1b", "interleaved-1f1b"})
#: share of the work budget the configuration search may use (for the classic schedules)
SEARCH_SHARE = 0.6
#: share of the work budget the zero-bubble and planned schedules get after the classic ones
NEW_SHARE = 0.25
#: work units (about one simulated action, or one stage test) per second of time limit
WORK_PER_SECOND = 400_000.0
#: wall-clock safety net: stop searching after this multiple of the time limit regardless
WALL_SAFETY = 3.0
#: level 0 reads the clock every this many configurations (their cheap bounds, under the wall-clock net)
LEVEL0_CLOCK_EVERY = 64
#: pipeline degrees :func:`seed_plan` tries (the fewest that fit; the solve tries more)
SEED_DEGREES = 2
#: least time CP-SAT gets to tighten open bounds (seconds, within the time limit)
TIGHTEN_MIN_S = 0.25


def solve(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions | None = None,
    *,
    templates: ScheduleTemplates | None = None,
    explain: bool = True,
) -> Plan:
    """The plan with the lowest predicted step time whose every stage fits its device.
    ``templates``: schedule templates to share with the caller's other estimates
    (:class:`planner.cost.ScheduleTemplates`).

    Raises :class:`planner.errors.InputError` for contradictory options and
    :class:`planner.errors.InfeasibleError` (with ``details``: ``layer``, ``layer_bytes``,
    ``min_memory_bytes``, ``min_devices``) when nothing fits; with ``explain=False`` (a caller
    that only needs to know, like the mesh search's sub-solves) without the diagnosis, whose
    searches can take longer than the solve.
    """
    options = options or PlanOptions()
    start = time.perf_counter()
    profile = profile_in_dtype(profile, training.dtype)  # memory in the bytes of the plan's dtype
    configs = enumerate_configs(profile, cluster, training, options)
    search = SearchState(profile, cluster, training, options, deadline=start + options.time_limit_s)
    if templates is not None:
        search.templates = templates
    # Budgets count work, not seconds, so that the same input gives the same plan on any
    # machine and load; WORK_PER_SECOND makes them match the time limit on a 2-core host.
    # The configuration search stops at SEARCH_SHARE of it, leaving room for the baselines'
    # candidates, the polish, CP-SAT and the final estimate.
    search.work_budget = options.time_limit_s * WORK_PER_SECOND
    search.wall_stop = start + WALL_SAFETY * options.time_limit_s
    _branch_and_bound(search, configs)
    seed_with_baselines(search, configs)
    seed_with_stack_rule(search)
    polish(search)
    tighten_chains(search)
    if search.best is None:
        if search.timed_out:
            raise cut_short(search, len(configs), options.time_limit_s)
        if not explain:
            raise InfeasibleError("no plan fits (not diagnosed: explain=False)")
        raise diagnose(profile, cluster, training, options)
    # CP-SAT gets what is left of the budget (at least TIGHTEN_MIN_S), in its deterministic time
    left = max(0.0, search.work_budget - search.work) / WORK_PER_SECOND
    tighten_cpsat(search, budget_s=max(TIGHTEN_MIN_S, min(left, options.time_limit_s)))
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
        + (
            f"; {search.restricted} zero-bubble or planned ones left out (a large space: tried on the best "
            "classic plans' D, K and M only)"
            if search.restricted
            else ""
        )
        + ("; time limit reached" if search.timed_out else "")
    )
    plan = _best_plan(search, SolverInfo(status=status, gap=gap, wall_time_s=0.0, message=message), templates=templates)
    if abs(plan.predicted.step_time_ms - full) > 1e-6 * max(1.0, full):
        raise AssertionError(  # pragma: no cover - quick_step and estimate are tested equal
            f"internal error: the solver predicted {search.best_step} ms but estimate gives "
            f"{plan.predicted.step_time_ms} ms; please report this input"
        )
    wall = time.perf_counter() - start
    return plan.model_copy(
        update={"solver": SolverInfo(status=status, gap=gap, wall_time_s=wall, message=message)}
    )


def cut_short(search: SearchState, configs: int, time_limit_s: float) -> SearchCutShortError:
    """The error of a search whose time ran out before it found any plan: nothing is proven
    not to fit, so it says so, with the bound of what it left open and the fix."""
    left = [*search.open_bounds, *(b for b, _ in search.open_configs.values())]
    bound = min(left, default=0.0) + search.profile.step_overhead_ms
    return SearchCutShortError(
        f"no plan found within the time limit of {time_limit_s:g} s ({search.infeasible} of {configs} "
        f"configurations proven not to fit, the others not examined before the wall-clock net of "
        f"{WALL_SAFETY:g} x the limit: a loaded machine, or a large problem); nothing says none fits: "
        f"raise the time limit (--time-limit {max(2 * time_limit_s, 10):g})",
        {"bound_ms": bound, "time_limit_s": time_limit_s, "configurations": configs},
    )


def _best_plan(search: SearchState, solver: SolverInfo, *, templates: ScheduleTemplates | None = None) -> Plan:
    """The search's best candidate as a plan (priced by :func:`estimate`)."""
    assert search.best is not None
    cfg, split, groups = search.best
    return estimate(
        search.profile, search.cluster, search.training,
        Layout(
            list(split.ranges),
            num_microbatches=cfg.num_microbatches,
            schedule=cfg.schedule,
            recompute=list(split.recompute),
            data_parallel=cfg.data_parallel,
            pipeline_degree=cfg.pipeline_degree,
            devices=[list(groups[g].devices) for g in split.groups],
        ),
        solver=solver,
        templates=templates,
    )


@dataclass(frozen=True)
class SeedSplit:
    """A configuration and split of the D x K problem, unpriced (what :func:`seed_split` finds)."""

    ranges: list[tuple[int, int]]
    recompute: list[bool]
    num_microbatches: int
    schedule: Schedule
    data_parallel: int
    pipeline_degree: int
    #: per stage, its devices (one per replica)
    devices: list[list[int]]

    @classmethod
    def of(cls, plan: Plan) -> SeedSplit:
        """The split of ``plan`` (to price it again, e.g. on a wider mesh)."""
        return cls(
            ranges=[(st.start, st.stop) for st in plan.stages],
            recompute=[st.recompute for st in plan.stages],
            num_microbatches=plan.num_microbatches,
            schedule=plan.schedule,
            data_parallel=plan.data_parallel_degree,
            pipeline_degree=plan.pipeline_degree,
            devices=[list(st.devices) for st in plan.stages],
        )


def seed_split(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions | None = None,
    *,
    templates: ScheduleTemplates | None = None,
) -> SeedSplit | None:
    """Megatron's hand rule (:func:`planner.splits.baseline_seed.seed_with_stack_rule`) at the
    :data:`SEED_DEGREES` smallest pipeline degrees, with no search: a few simulations, so that
    the mesh search holds a plan of a family before a loaded machine's clock runs out.  The
    fastest configuration of the rule that fits, or ``None``; the caller prices it (it proves
    nothing)."""
    options = options or PlanOptions()
    start = time.perf_counter()
    profile = profile_in_dtype(profile, training.dtype)
    search = SearchState(profile, cluster, training, options, deadline=start + options.time_limit_s)
    if templates is not None:
        search.templates = templates
    search.work_budget = options.time_limit_s * WORK_PER_SECOND
    # (no wall-clock net: the rule is a few simulations at SEED_DEGREES degrees, and the promise
    # that a plan never loses to it must not depend on how loaded the machine is)
    seed_with_stack_rule(search, degrees=SEED_DEGREES)
    if search.best is None:
        return None
    cfg, split, groups = search.best
    return SeedSplit(
        ranges=list(split.ranges),
        recompute=list(split.recompute),
        num_microbatches=cfg.num_microbatches,
        schedule=cfg.schedule,
        data_parallel=cfg.data_parallel,
        pipeline_degree=cfg.pipeline_degree,
        devices=[list(groups[g].devices) for g in split.groups],
    )


def _branch_and_bound(search: SearchState, configs: Sequence[Config]) -> None:
    """Best-first branch and bound over the configurations, in three levels of effort.

    Level 0 is :func:`cheap_bound`, for every configuration.  Level 1 is the configuration's
    strong bound (v = 1: :func:`relaxed_bound`; v > 1: :func:`memory_bounds`), or its proof
    that nothing fits.  Level 2 is the search for a plan (:func:`enumerate_splits`, the greedy
    splits), after which a configuration is solved or stays open at its bound.

    Two rounds: first the classic schedules (gpipe, 1f1b, interleaved-1f1b) with
    ``SEARCH_SHARE`` of the work budget, then the zero-bubble and planned ones, starting
    from the best plan found, with ``NEW_SHARE`` more (or ``SEARCH_SHARE`` when only those
    are allowed).  In each round the ``INCUMBENT_TRIES`` configurations that promise most
    (the textbook step time of a balanced split) go through every level first, so that a
    good plan prunes the rest; then the configuration with the smallest bound is always the
    next to advance a level, since it alone decides the proven gap.  A round stops when its
    smallest bound reaches the best plan or at its share of the budget; what is left stays
    open at its bound.
    """
    group_cache: dict[tuple[int, int], list[Group]] = {}

    def level0(cfgs: Sequence[Config], *, counted: bool) -> list[tuple[float, Config, list[Group]]]:
        out = []
        for i, cfg in enumerate(cfgs):
            if i % LEVEL0_CLOCK_EVERY == 0 and time.perf_counter() > search.wall_stop:
                # out of time before every configuration has its cheap bound: the rest stay
                # open at the bound of all the work spread over every device (valid for each)
                floor = lower_bound_ms(search.profile, search.cluster, search.training) - search.profile.step_overhead_ms
                search.open_bounds.append(floor)
                search.timed_out = True
                break
            groups = groups_of(search, cfg, group_cache)
            if not static_fits(search, cfg, groups):
                search.infeasible += 1
                continue
            if counted:
                search.work += CHEAP_WORK
            out.append((cheap_bound(search, cfg, groups), cfg, groups))
        return out

    classic = level0([c for c in configs if c.schedule in CLASSIC], counted=False)
    if classic:
        _round(search, classic, INCUMBENT_TRIES, SEARCH_SHARE)
    others = [c for c in configs if c.schedule not in CLASSIC]
    if classic:
        _vshape_on_best(search, others, group_cache)
    if classic and len(others) > NEW_CONFIG_LIMIT:
        # a large space: the newer schedules on the meshes and micro-batch counts of the best
        # classic plans only, and not on very long pipelines (the space the search then
        # covers, and its gap)
        shapes = sorted(search.best_step_of.items(), key=lambda e: (e[1], e[0]))
        keep = list(dict.fromkeys((c.data_parallel, c.pipeline_degree, c.num_microbatches) for c, _ in shapes))[:NEW_SHAPES]
        others = [
            c for c in others
            if (c.data_parallel, c.pipeline_degree, c.num_microbatches) in keep
            and 3 * c.num_microbatches * c.num_stages <= NEW_ACTION_LIMIT
        ]
        search.restricted = len(configs) - len(others) - len([c for c in configs if c.schedule in CLASSIC])
    newer = level0(others, counted=bool(classic))
    if newer:
        if classic:
            _reschedule_best(search, newer)
        _round(search, newer, INCUMBENT_TRIES_NEW if classic else INCUMBENT_TRIES,
               SEARCH_SHARE + NEW_SHARE if classic else SEARCH_SHARE)


def _vshape_on_best(search: SearchState, configs: Sequence[Config], group_cache: dict[tuple[int, int], list[Group]]) -> None:
    """The V-shaped zero-bubble schedules (zbv, dualpipev) on the best classic plan's D, K and
    M, with their rank-balanced splits (:func:`planner.splits.vshape.vshape_candidates`): a
    few simulations, also where the newer schedules' full search is left out (random layers at
    scale, where the V schedules' small bubble and even ranks beat every classic plan)."""
    if search.best is None:
        return
    best_cfg = search.best[0]
    shape = (best_cfg.data_parallel, best_cfg.pipeline_degree, best_cfg.num_microbatches)
    for cfg in configs:
        if time.perf_counter() > search.wall_stop:
            return  # (a heuristic on top: the configurations keep their place in the next round)
        if cfg.schedule not in V_SCHEDULES or (cfg.data_parallel, cfg.pipeline_degree, cfg.num_microbatches) != shape:
            continue
        if 2 * cfg.num_microbatches * cfg.num_stages > SIM_ACTION_LIMIT:
            continue
        groups = groups_of(search, cfg, group_cache)
        if not static_fits(search, cfg, groups):
            continue
        search.work += CHEAP_WORK
        if cheap_bound(search, cfg, groups) >= search.best_step:
            continue
        sm = search.stage_model(cfg)
        for split in vshape_candidates(search, sm, groups, device_orders(groups)[0]):
            consider(search, sm, groups, split)
            if time.perf_counter() > search.wall_stop:
                return


def _reschedule_best(search: SearchState, entries: list[tuple[float, Config, list[Group]]]) -> None:
    """The best classic plan's split under the newer schedules of the same shape (same D, K,
    M and chunks; recompute where their memory needs it): a strong first incumbent for them."""
    if search.best is None:
        return
    best_cfg, best_split, _ = search.best
    for cheap, cfg, groups in entries:
        if cheap >= search.best_step or (cfg.data_parallel, cfg.pipeline_degree, cfg.num_microbatches) != (
            best_cfg.data_parallel, best_cfg.pipeline_degree, best_cfg.num_microbatches
        ):
            continue
        if cfg.num_stages != best_cfg.num_stages or 3 * cfg.num_microbatches * cfg.num_stages > SIM_ACTION_LIMIT:
            continue
        sm = search.stage_model(cfg)
        split = with_recompute(search, sm, groups, best_split.ranges, tuple(best_split.groups[s] for s in range(cfg.num_stages)))
        if split is not None and tuple(sm.owner) == tuple(range(cfg.pipeline_degree)) * cfg.virtual_stages:
            consider(search, sm, groups, split)


def _round(
    search: SearchState, entries: list[tuple[float, Config, list[Group]]], tries: int, share: float
) -> None:
    """One round of :func:`_branch_and_bound` over ``entries`` (their cheap bounds), until
    ``share`` of the work budget."""
    promising = sorted(entries, key=lambda e: (max(e[0], _promise(search, e[1], e[2])), e[1]))
    # the most promising one-chunk configurations go first: the textbook promise of the
    # interleaved ones ignores the memory their warm-up holds, and when that forces recompute
    # or uneven chunks, a plan of every try may lose to a plain pipeline's (random layers at
    # scale); one-chunk plans are cheap to find and bound the rest
    one_chunk = [e for e in promising if e[1].virtual_stages == 1][:ONE_CHUNK_TRIES]
    promising = one_chunk + [e for e in promising if e not in one_chunk]
    started: set[Config] = set()
    for cheap, cfg, groups in promising:
        if search.best is not None and len(started) >= tries:
            break
        if search.best is not None and _out_of_budget(search, share):
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
        if search.best is not None and _out_of_budget(search, share):
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
    fixed = fixed_ranges(search.options) is not None
    too_big = 2 * cfg.num_microbatches * cfg.num_stages > SIM_ACTION_LIMIT
    sm = search.stage_model(cfg)
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


def _out_of_budget(search: SearchState, share: float = SEARCH_SHARE) -> bool:
    return search.work > share * search.work_budget or time.perf_counter() > search.wall_stop


#: the textbook bubble of each schedule, in units of 1F1B's (K-1)/v micro-batches (the zero
#: bubble paper: ZB-H1 about a third of it, ZB-H2 and the V schedules less), for ordering only
BUBBLE_SHARE = {
    "gpipe": 1.0, "1f1b": 1.0, "interleaved-1f1b": 1.0, "zb-h1": 0.4, "interleaved-zb": 0.4,
    "zb-h2": 0.25, "zbv": 0.25, "dualpipev": 0.25, "planned": 0.3,
}


def _promise(search: SearchState, cfg: Config, groups: Sequence[Group]) -> float:
    """Step time of a perfectly balanced split: W (M + share·(K-1)/v) / (K·speed)."""
    costs = search.costs_at(cfg.microbatch_size(search.training.global_batch_size))
    w = work_total(costs)
    k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
    speed = sum(g.speed for g in groups) / len(groups)
    return w * (m + BUBBLE_SHARE[cfg.schedule] * (k - 1) / v) / (k * speed)


def groups_of(search: SearchState, cfg: Config, cache: dict[tuple[int, int], list[Group]]) -> list[Group]:
    """The device groups of ``cfg``'s D and K (made once per pair, kept in ``cache``)."""
    key = (cfg.data_parallel, cfg.pipeline_degree)
    if key not in cache:
        cache[key] = make_groups(search.cluster, search.training, *key)
    return cache[key]


def static_fits(search: SearchState, cfg: Config, groups: Sequence[Group]) -> bool:
    """False when the parameters, gradients and optimizer state alone cannot fit the K ranks
    (each rank's share is at most its largest device's usable memory)."""
    total = static_bytes(search.profile_param_bytes, search.training)
    return total <= sum(g.limit_bytes for g in groups)
