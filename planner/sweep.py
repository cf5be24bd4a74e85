"""What-if sweeps: the best plan of one model on several cluster sizes and device kinds.

:func:`sweep` plans every point of a :class:`planner.schema.SweepSpec` (device counts times
device types or memories) and answers the questions a capacity planner asks:

* per point, the best plan, its throughput, its memory headroom and its proven gap;
* the fewest devices that reach a target throughput (per device kind);
* the Pareto front of devices against step time (per device kind): the points that no point
  with as few devices beats;
* where a device kind's memory makes the model infeasible (the diagnosis says what would fit).

Points of one kind are solved in increasing device count, and each point also re-prices the
best plan of the smaller points on its own cluster (that plan leaves the extra devices idle,
which the planner allows).  So the best throughput never falls as devices are added, and a
point whose own search was cut short by its time limit still reports the better plan; its
proven gap is recomputed against the new plan (the solver's bound stays valid).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from planner.cost import plan_fits, reestimate
from planner.errors import InfeasibleError, InputError
from planner.schema import (
    Cluster,
    Plan,
    PlanOptions,
    Profile,
    SolverInfo,
    SweepPoint,
    SweepResult,
    SweepSpec,
    TrainingSetup,
    parse_document,
)
from planner.units import format_bytes

Solve = Callable[[Profile, Cluster, TrainingSetup, PlanOptions], Plan]


def point_kinds(spec: SweepSpec) -> list[tuple[str, dict[str, object]]]:
    """(label, cluster shorthand fields) of each device kind the sweep compares."""
    if spec.device_types:
        return [(t, {"device_type": t}) for t in spec.device_types]
    if spec.memories:
        return [(format_bytes(m), {"memory": m}) for m in spec.memories]
    return [("", {})]


def point_cluster(spec: SweepSpec, devices: int, kind: dict[str, object], *, defaults: dict[str, object]) -> Cluster:
    """The cluster of one point: ``defaults`` (say the profile's device type), the kind, the links."""
    data: dict[str, object] = {**defaults, **kind, "devices": devices}
    if "device_type" in kind:
        data.pop("memory", None)
    for field in ("devices_per_node", "intra_node", "inter_node"):
        value = getattr(spec, field)
        if value is not None:
            data[field] = value if isinstance(value, str | int) else value.model_dump()
    cluster: Cluster = parse_document("cluster", data, source=f"(sweep point of {devices} devices)")
    return cluster


def sweep(
    profile: Profile,
    training: TrainingSetup,
    spec: SweepSpec,
    *,
    options: PlanOptions | None = None,
    defaults: dict[str, object] | None = None,
    solve: Solve | None = None,
) -> SweepResult:
    """Plan every point of ``spec`` (see the module doc).

    ``options`` fixes decisions for every point (its time limit is replaced by the spec's per
    point); ``defaults`` fills the cluster shorthand of every point (e.g. ``{"device_type":
    "h100-80g"}`` or ``{"memory": "80GiB"}``) unless the kind overrides it.
    """
    if solve is None:
        from planner.solver import solve as solve_fn

        solve = solve_fn
    start = time.perf_counter()
    base = (options or PlanOptions()).model_copy(update={"time_limit_s": spec.time_limit_s})
    counts = sorted(set(spec.devices))
    points: list[SweepPoint] = []
    fewest: dict[str, int | None] = {}
    for label, kind in point_kinds(spec):
        best: Plan | None = None  # the best plan of the smaller points of this kind
        reference: float | None = None  # throughput per device of the smallest feasible point
        own: list[SweepPoint] = []
        for n in counts:
            cluster = point_cluster(spec, n, kind, defaults=defaults or {})
            point = _solve_point(profile, cluster, training, base, solve, best, label)
            if point.plan is not None:
                best = point.plan
                tput = point.plan.predicted.throughput_samples_per_s
                if reference is None and tput > 0:
                    reference = tput / n
                if reference:
                    point = point.model_copy(update={"scaling_efficiency": tput / n / reference})
            own.append(point)
        own = _mark_pareto(own)
        points.extend(own)
        if spec.target_samples_per_s is not None:
            fewest[label] = next(
                (p.devices for p in own if (p.throughput_samples_per_s or 0) >= spec.target_samples_per_s), None
            )
    return SweepResult(
        model=profile.model,
        profile_sha256=profile.sha256(),
        target_samples_per_s=spec.target_samples_per_s,
        fewest_devices_for_target=fewest,
        points=points,
        wall_time_s=time.perf_counter() - start,
    )


def _solve_point(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions, solve: Solve,
    smaller: Plan | None, label: str,
) -> SweepPoint:
    n = cluster.num_devices
    plan: Plan | None
    message = ""
    try:
        plan = solve(profile, cluster, training, options)
    except InfeasibleError as err:
        plan, message = None, str(err)
    reused = False
    if smaller is not None:
        carried = _carry(smaller, profile, cluster, training)
        if carried is not None and (plan is None or carried.predicted.step_time_ms < plan.predicted.step_time_ms):
            reused = True
            plan = _with_gap(carried, plan)
    if plan is None:
        return SweepPoint(devices=n, device_kind=label, status="infeasible", message=message)
    headroom = min(1 - s.memory_bytes / s.memory_limit_bytes if s.memory_limit_bytes else 0.0 for s in plan.stages)
    return SweepPoint(
        devices=n,
        device_kind=label,
        status="ok",
        step_time_ms=plan.predicted.step_time_ms,
        throughput_samples_per_s=plan.predicted.throughput_samples_per_s,
        memory_headroom=headroom,
        gap=plan.solver.gap,
        reused=reused,
        plan=plan,
    )


def _carry(plan: Plan, profile: Profile, cluster: Cluster, training: TrainingSetup) -> Plan | None:
    """``plan`` (made for fewer devices) priced on ``cluster``, if it still fits there."""
    try:
        carried = reestimate(plan, profile, cluster=cluster, training=training, solver=plan.solver)
    except InputError:
        return None
    return carried if plan_fits(carried) else None


def _with_gap(carried: Plan, solved: Plan | None) -> Plan:
    """The carried plan, with the gap proven by this point's own search (its bound is valid
    for every plan of this cluster)."""
    if solved is None:  # the search found nothing in its time: no bound to quote
        info = SolverInfo(status="feasible", gap=1.0, message="plan of a smaller point; this point's search found none")
    else:
        bound = solved.predicted.step_time_ms * (1 - solved.solver.gap)
        step = carried.predicted.step_time_ms
        gap = max(0.0, (step - bound) / step) if step > 0 else 0.0
        info = SolverInfo(
            status="optimal" if gap <= 1e-9 else "feasible",
            gap=0.0 if gap <= 1e-9 else gap,
            wall_time_s=solved.solver.wall_time_s,
            message="plan of a smaller point (leaves devices idle); " + solved.solver.message,
        )
    return carried.model_copy(update={"solver": info})


def _mark_pareto(points: list[SweepPoint]) -> list[SweepPoint]:
    """Flag the points no point with as few devices (of the same kind) is as fast as."""
    out = []
    best = float("inf")
    for p in sorted(points, key=lambda p: p.devices):
        on_front = p.step_time_ms is not None and p.step_time_ms < best * (1 - 1e-9)
        if on_front:
            best = p.step_time_ms  # type: ignore[assignment]
        out.append(p.model_copy(update={"pareto": on_front}))
    return out
