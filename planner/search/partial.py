"""Partial recompute: checkpoint only as many of a stage's layers as memory needs.

The searches decide recompute per stage, all of its layers or none
(:mod:`planner.splits.recompute`); their bounds cover exactly those plans.  A stage that
recomputes may fit with fewer of its layers checkpointed: the first N of them (Megatron's
``--recompute-method block --recompute-num-layers N``), the others keeping their activations,
saving the forwards of the rest in every backward (AdaPipe, Sun et al. ASPLOS'24, reports up to
1.32x from choosing it per stage).  :func:`partial_recompute` takes the searched plan and finds,
for each pipeline rank, the least N whose stages still fit its device (0: that rank stops
recomputing): the ranks' bisections on N run in the same rounds, each round's counts priced by
one :func:`planner.cost.reestimate` (memory falls as N grows: a checkpointed layer keeps its
input instead of its activations).  Under 1F1B the first ranks keep more micro-batches in
flight, so they checkpoint more than the last.  Megatron's flags take one N for every stage:
its export says so and offers the largest.  A partial plan is kept only when it fits and is
faster.

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
    """``plan`` with the fewest checkpointed layers on each pipeline rank's recomputing stages that
    fit, when faster (else ``plan``); the solver fields are the caller's to set.

    Each rank's count is bisected on its own (the stages a rank runs, its interleaved chunks,
    share one count ``n``: each checkpoints its first ``min(n, its layers)``), all ranks in the
    same rounds, one estimate a round: a rank's memory depends on its own counts only (what it
    keeps per micro-batch in flight), and fewer checkpointed layers never slow a stage, so each
    rank's least count that fits is also the fastest.  1F1B's first ranks keep more micro-batches
    in flight than its last, so they checkpoint more (AdaPipe's per-stage choice; Megatron's
    ``--recompute-num-layers`` takes one count, and its export says so).  The plan with every
    chosen count is estimated once more and kept only if it fits."""
    if not partial_allowed(options):
        return plan
    full = [s.checkpointed_layers for s in plan.stages]
    if max(full, default=0) <= 1:
        return plan
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(plan.stages):
        if full[i] > 0:
            groups.setdefault(tuple(s.devices), []).append(i)
    ranks = list(groups.values())
    hi = [max(full[i] for i in g) for g in ranks]  # the plan's own counts fit
    lo = [0] * len(ranks)
    templates = ScheduleTemplates()

    def counts(per_rank: list[int]) -> list[int]:
        out = [0] * len(full)
        for g, n in zip(ranks, per_rank, strict=True):
            for i in g:
                out[i] = min(n, full[i])
        return out

    def priced(per_rank: list[int]) -> Plan:
        return reestimate(plan, profile, recompute_layers=counts(per_rank), solver=plan.solver, templates=templates)

    while any(a < b for a, b in zip(lo, hi, strict=True)):
        mid = [(a + b) // 2 for a, b in zip(lo, hi, strict=True)]
        candidate = priced(mid)
        for r, g in enumerate(ranks):
            if lo[r] >= hi[r]:
                continue
            if all(candidate.stages[i].memory_bytes <= candidate.stages[i].memory_limit_bytes for i in g):
                hi[r] = mid[r]
            else:
                lo[r] = mid[r] + 1
    if counts(hi) == full:
        return plan
    best = priced(hi)
    if not plan_fits(best) or best.predicted.step_time_ms >= plan.predicted.step_time_ms * (1 - 1e-9):
        return plan
    return best


def _counts_text(plan: Plan) -> str:
    """What a partially recomputed plan checkpoints, in words."""
    counts = [s.checkpointed_layers for s in plan.stages if s.recompute]
    if len(set(counts)) == 1:
        return f"the first {counts[0]} layer(s) of each recomputing stage checkpointed"
    shown = ", ".join(map(str, counts[:16])) + (", ..." if len(counts) > 16 else "")
    return f"the first {shown} layer(s) of the recomputing stages checkpointed (each pipeline rank its least that fits)"


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
        notes.append(f"partial recompute: {_counts_text(best)} ({step:.4g} ms, was {plan.predicted.step_time_ms:.4g})")
    if relaxed < searched * (1 - 1e-9):
        notes.append("bound: the relaxed problem's (unlimited memory, no recompute), which covers partial recompute")
    message = "; ".join([plan.solver.message, *notes]) if notes else plan.solver.message
    solver = SolverInfo(status=status, gap=0.0 if status == "optimal" else gap,
                        wall_time_s=plan.solver.wall_time_s, message=message)
    return best.model_copy(update={"solver": solver})
