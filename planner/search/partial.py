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

Its proven gap is then measured against the plain work bound (every layer's forward and
backward over every device, :func:`planner.cost.lower_bound_ms`), which holds for partial plans
too: the searches' sharper bounds do not, so the status is ``feasible`` and the message says so.
"""

from __future__ import annotations

from planner.cost import ScheduleTemplates, plan_fits, reestimate
from planner.schema import Plan, PlanOptions, Profile, SolverInfo


def partial_recompute(plan: Plan, profile: Profile, options: PlanOptions) -> Plan:
    """``plan`` with the fewest checkpointed layers per recomputing stage that fit, when faster
    (else ``plan``).  Skipped when the options fix recompute or turn partial recompute off."""
    if not options.partial_recompute or options.recompute is not None:
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
    step, bound = best.predicted.step_time_ms, best.predicted.lower_bound_ms
    n = max(s.recompute_layers or 0 for s in best.stages)
    message = (
        f"{plan.solver.message}; then partial recompute: the first {n} layer(s) of each recomputing stage "
        f"checkpointed ({step:.4g} ms, was {plan.predicted.step_time_ms:.4g}); the gap is against the work "
        "bound, the searches' bounds cover whole-stage recompute only"
    )
    gap = max(0.0, (step - bound) / step) if step > 0 else 0.0
    solver = SolverInfo(status="feasible", gap=gap, wall_time_s=plan.solver.wall_time_s, message=message)
    return best.model_copy(update={"solver": solver})
