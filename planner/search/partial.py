"""Partial recompute: checkpoint only as many of a stage's layers as memory needs.

The searches decide recompute per stage, all of its layers or none
(:mod:`planner.splits.recompute`); their bounds cover exactly those plans.  A stage that
recomputes may fit with fewer of its layers checkpointed: the first N of them (Megatron's
``--recompute-method block --recompute-num-layers N``), the others keeping their activations,
saving the forwards of the rest in every backward (AdaPipe, Sun et al. ASPLOS'24, reports up to
1.32x from choosing it).  :func:`partial_recompute` takes the searched plan and finds the
least N, one for every recomputing stage (Megatron's flags take one N for all), whose plan
still fits every device: a bisection on N, each candidate priced by
:func:`planner.cost.reestimate` (memory falls as N grows: a checkpointed layer keeps its input
instead of its activations).  A partial plan is kept only when it fits and is faster.

**The bound.**  Plans with partial recompute (any count per stage) are in the space too, so the
searches' bound, which covers whole-stage recompute only, is not enough: a partial plan can beat
it (the brute-force test finds such instances in a quarter of small random ones).  Every partial
plan is at least as slow as the same plan without recompute, and fits wherever it fits with more
memory, so the fastest plan of the *relaxed* problem, unlimited memory and no recompute, is a
lower bound of every plan, partial or not.  :func:`relaxed_bound` proves a bound of it with a
search of its own (:data:`RELAXED_SHARE` of the time limit); the plan's gap is measured against
the smaller of the two bounds.  That search is skipped where the least mesh family's work spread
over every device (:func:`planner.search.axes.work_floor`, valid for partial plans too: recompute
only adds work) already reaches the searched bound: then the searched bound is below a bound of
every partial plan, and holds as it is (the Llama 3 rows' 16k-device relaxed search cost 3.5 s).  Where memory does not bind, the relaxed bound is the searched
one's equal and nothing is lost; where it binds hard, the gap honestly widens.
"""

from __future__ import annotations

from planner.cost import ScheduleTemplates, plan_fits, reestimate
from planner.errors import InfeasibleError, SearchCutShortError
from planner.limits import MAX_MEMORY_BYTES
from planner.schema import Cluster, Device, Plan, PlanOptions, Profile, SolverInfo, TrainingSetup
from planner.search.axes import solve as search
from planner.search.axes import work_floor

#: the relaxed problem's search time, as a share of the user's time limit (the search of the
#: plan itself has the rest: :func:`searched_options`)
RELAXED_SHARE = 0.2


def partial_allowed(options: PlanOptions) -> bool:
    """Whether the plan may checkpoint part of a stage (not when recompute is fixed or off)."""
    return options.partial_recompute and options.recompute is None


def searched_options(options: PlanOptions) -> PlanOptions:
    """The options of the plan's own search: the time limit less the relaxed bound's share when
    partial recompute is allowed (the two searches' limits add up to the user's)."""
    if not partial_allowed(options):
        return options
    return options.model_copy(update={"time_limit_s": options.time_limit_s * (1 - RELAXED_SHARE)})


def partial_recompute(plan: Plan, profile: Profile, options: PlanOptions) -> Plan:
    """``plan`` with the fewest checkpointed layers per recomputing stage that fit, when faster
    (else ``plan``); the solver fields are the caller's to set."""
    if not partial_allowed(options):
        return plan
    lengths = [s.stop - s.start for s in plan.stages if s.recompute]
    if not lengths or max(lengths) <= 1:
        return plan
    templates = ScheduleTemplates()

    def priced(n: int) -> Plan:
        counts = [min(n, s.stop - s.start) if s.recompute else 0 for s in plan.stages]
        return reestimate(plan, profile, recompute_layers=counts, solver=plan.solver, templates=templates)

    lo, hi = 1, max(lengths)  # hi: every layer (the plan itself); find the least n that fits
    best: Plan | None = None
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = priced(mid)
        if plan_fits(candidate):
            best, hi = candidate, mid
        else:
            lo = mid + 1
    if best is None or best.predicted.step_time_ms >= plan.predicted.step_time_ms * (1 - 1e-9):
        return plan
    return best


def relaxed_bound(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions,
    *,
    templates: ScheduleTemplates | None = None,
) -> float:
    """A lower bound of every plan of the options' space, partial recompute included: the bound
    the search proves for unlimited memory and no recompute (0 when it finds nothing).
    ``templates``: the plan's own search's schedule templates (the same shapes recur)."""
    # (each distinct device copied once: a shorthand cluster's 16k devices stay one shared
    # object, which the mesh search's per-group clusters rely on to stay cheap)
    copies: dict[int, Device] = {}
    for d in cluster.devices:
        if id(d) not in copies:
            copies[id(d)] = d.model_copy(update={"memory_bytes": MAX_MEMORY_BYTES})
    roomy = cluster.model_copy(update={"devices": [copies[id(d)] for d in cluster.devices]})
    relaxed = options.model_copy(update={
        "recompute": False, "selective_recompute": False, "partial_recompute": False,
        "time_limit_s": RELAXED_SHARE * options.time_limit_s,
    })
    try:
        plan = search(profile, roomy, training, relaxed, templates=templates)
    except SearchCutShortError as cut:  # (out of time: the bound of what it left open)
        return float(cut.details["bound_ms"])
    except InfeasibleError:
        return 0.0
    return plan.predicted.step_time_ms * (1 - plan.solver.gap)


def with_partial_recompute(
    plan: Plan,
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions,
    *,
    templates: ScheduleTemplates | None = None,
) -> Plan:
    """The searched ``plan``, partially recomputed where that is faster, with its gap against a
    bound valid for partial plans too (the smaller of the search's and :func:`relaxed_bound`)."""
    if not partial_allowed(options):
        return plan
    best = partial_recompute(plan, profile, options)
    searched = plan.predicted.step_time_ms * (1 - plan.solver.gap)
    # every plan, partial or not, does at least the least family's work: where that already
    # reaches the searched bound, the searched bound holds for partial plans too (no search needed)
    floor = work_floor(profile, cluster, training, options)
    relaxed = floor if floor >= searched * (1 - 1e-9) else max(
        floor, relaxed_bound(profile, cluster, training, options, templates=templates))
    bound = min(searched, relaxed)
    step = best.predicted.step_time_ms
    gap = max(0.0, (step - bound) / step) if step > 0 else 0.0
    status = "optimal" if gap <= 1e-9 else "feasible"
    notes = []
    if best is not plan:
        n = max(s.recompute_layers or 0 for s in best.stages)
        notes.append(
            f"partial recompute: the first {n} layer(s) of each recomputing stage checkpointed "
            f"({step:.4g} ms, was {plan.predicted.step_time_ms:.4g})"
        )
    if relaxed < searched * (1 - 1e-9):
        notes.append("bound: the relaxed problem's (unlimited memory, no recompute), which covers partial recompute")
    message = "; ".join([plan.solver.message, *notes]) if notes else plan.solver.message
    solver = SolverInfo(status=status, gap=0.0 if status == "optimal" else gap,
                        wall_time_s=plan.solver.wall_time_s, message=message)
    return best.model_copy(update={"solver": solver})
