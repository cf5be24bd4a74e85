"""The step estimate: a plan's step time and per-device peak memory.

Sources of the formulas:

* GPipe (Huang et al., NeurIPS 2019): K stages, M micro-batches, bubble (K-1)/(M+K-1);
  re-materialization keeps only each stage's input per micro-batch and recomputes the rest
  during the backward pass.
* Narayanan et al. 2021 (Megatron-LM at scale, SC'21): 1F1B keeps at most K-k micro-batches
  in flight on stage k; interleaved 1F1B with v chunks per device cuts the bubble to
  (K-1)/(vM) and warms up with (K-r-1)*2 + (v-1)*K micro-batches on rank r.
* Qi et al. 2024 (Zero Bubble Pipeline Parallelism, ICLR): the backward split into an
  input-gradient and a weight-gradient pass, the latter free to fill the bubble.
* Memory from the timeline: each rank's peak activation bytes come from walking its action
  list (:func:`planner.schedules.memory_points`): a forward adds the stage's activations (only
  its input when it recomputes), an input gradient frees what the weight gradient does not
  need, the weight gradient (or a full backward) frees the rest, and a recomputing stage holds
  its re-materialized activations during its backward.
* Korthikanti et al. 2022 (Reducing activation recomputation): activation bytes per layer,
  and recompute costs one extra forward pass.
* Ring all-reduce (Patarasuk & Yuan 2009): 2(D-1)/D of the bytes cross each link.

Profiles to costs: every per-layer quantity is measured at a few micro-batch sizes;
:mod:`planner.scaling` fits each series to what physics allows (non-negative, non-decreasing,
cost per sample non-increasing) and reads it at the size a plan needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from planner import scaling
from planner.context import context_gradient_ms, context_group, kv_bytes
from planner.cost.collectives import (
    all_gather_ms,
    allreduce_ms,
    boundary_transfer_ms,
    reduce_scatter_ms,
    replica_link,
)
from planner.cost.compute import census_device
from planner.cost.layers import (
    LayerCosts,
    _prefix,
    _times_at,
    extrapolation_note,
    layer_costs,
    profile_in_dtype,
    structure_sha,
)
from planner.cost.memory import (
    RankTerms,
    held_bytes,
    outside_allocator,
    rank_memory_from_terms,
    rank_memory_terms,
    step_temporary_bytes,
    usable_bytes,
)
from planner.errors import InputError
from planner.experts import all_to_all_per_microbatch_ms
from planner.mesh import (
    Mesh,
    MeshProblem,
    check_mesh,
    dp_link,
    flat_scaling_note,
    mesh_problem,
    replicated_note,
    tp_collectives_ms,
    tp_link,
    zero_collectives_ms,
)
from planner.schedules import (
    Action,
    RankWalk,
    ScheduleError,
    check_schedule_shape,
    format_actions,
    list_schedule,
    memory_points,
    parse_actions,
    placement_of,
    rank_stages,
    schedule_actions,
    stage_rank,
)
from planner.schema import (
    SCHEDULE_CHUNKS,
    Cluster,
    Device,
    MemoryParts,
    Placement,
    Plan,
    Predicted,
    Profile,
    Schedule,
    SolverInfo,
    StagePlan,
    StageRange,
    TrainingSetup,
    check_coverage,
)
from planner.simulator import (
    CompiledSchedule,
    Simulation,
    compile_actions,
    compile_template,
    makespans,
    simulate,
)


def default_devices(
    num_stages: int, pipeline_degree: int, data_parallel: int, *, placement: Placement = "loop"
) -> list[list[int]]:
    """Device indices of each stage's replicas: replica d of rank k is device d * K + k.

    A pipeline occupies consecutive devices, so neighbouring stages share a node when they can.
    """
    k = pipeline_degree
    v = max(1, num_stages // k)
    return [[d * k + stage_rank(placement, s, k, v) for d in range(data_parallel)] for s in range(num_stages)]


def lower_bound_ms(profile: Profile, cluster: Cluster, training: TrainingSetup) -> float:
    """Total forward + backward work of a step spread perfectly over every device.

    Uses the cheapest per-sample cost over the measured sizes, 1 and the global batch (linear
    pieces have their per-sample extremes at their ends), so no plan can beat it; and, where the
    device model scales a census outside the measured sizes (:func:`planner.cost.layers._times_at`:
    not linear there), every micro-batch size a plan can run there (the divisors of the global
    batch).  A calibrated profile's fixed step overhead is added (every plan pays it).
    """
    g = training.global_batch_size
    sizes = profile.microbatch_sizes
    candidates = sorted({1, g, *(b for b in sizes if b <= g)})
    if census_device(profile) is not None and any(x.operations for x in profile.layers):
        candidates = sorted({*candidates, *(b for b in _all_divisors(g) if not min(sizes) <= b <= max(sizes))})
    best = math.inf
    for b in candidates:
        fwd, bwd = _times_at(profile, b)  # (only these of layer_costs)
        best = min(best, (_prefix(fwd)[-1] + _prefix(bwd)[-1]) / b)
    return best * g / sum(d.speed for d in cluster.devices) + profile.step_overhead_ms


@dataclass(frozen=True)
class StageTimes:
    """Per stage, for one micro-batch: forward, full backward, input and weight gradient
    (recompute included in the backward and the input gradient, where a stage recomputes),
    and per boundary the transfer time."""

    forward: list[float]
    backward: list[float]
    input: list[float]
    weight: list[float]
    transfer: list[float]
    #: the recompute in each stage's backward (0 where it does not recompute)
    recompute: list[float] = field(default_factory=list)


def planned_actions(
    num_microbatches: int,
    times: StageTimes,
    terms: Sequence[RankTerms],
    recompute: Sequence[bool],
    limits: Sequence[float],
) -> list[list[Action]]:
    """The ``planned`` schedule of a one-stage-per-rank split: :func:`planner.schedules.list_schedule`
    with the stages' times and each rank's memory left for activations (its usable memory
    less its static bytes)."""
    hf: list[float] = []
    hw: list[float] = []
    live: list[float] = []
    for t, rc in zip(terms, recompute, strict=True):
        f_, w_, l_ = held_bytes(t, [rc])
        hf.append(f_[0])
        hw.append(w_[0])
        live.append(l_[0])
    orders, _ = list_schedule(
        num_microbatches,
        forward_ms=times.forward,
        input_ms=times.input,
        weight_ms=times.weight,
        transfer_ms=times.transfer,
        held_forward=hf,
        held_weight=hw,
        live=live,
        capacity=[lim - t.static for lim, t in zip(limits, terms, strict=True)],
    )
    return orders


@dataclass
class ScheduleTemplates:
    """The schedule templates one search has made, by shape (``schedule``, K, M, v): a named
    schedule's per-rank action lists, their compiled program, memory points and text, each made
    once when first asked for.  The mesh search prices the same long schedules again and again
    (540,000 actions a step on the largest Megatron rows), in :func:`estimate` and in each of its
    D x K solves; one object serves them all.  It belongs to its caller, not to the module.  Not
    for ``planned`` schedules or given actions: those are a plan's own."""

    orders: dict[tuple[str, int, int, int], list[list[Action]]] = field(default_factory=dict)
    compiled: dict[tuple[str, int, int, int], CompiledSchedule] = field(default_factory=dict)
    points: dict[tuple[str, int, int, int], list[RankWalk]] = field(default_factory=dict)
    text: dict[tuple[str, int, int, int], list[str]] = field(default_factory=dict)

    def actions(self, schedule: Schedule, k: int, m: int, v: int) -> list[list[Action]]:
        key = (schedule, k, m, v)
        if key not in self.orders:
            self.orders[key] = schedule_actions(schedule, k, m, v)
        return self.orders[key]

    def program(self, schedule: Schedule, k: int, m: int, v: int) -> CompiledSchedule:
        """The compiled program (:func:`planner.simulator.compile_template`: valid by construction)."""
        key = (schedule, k, m, v)
        if key not in self.compiled:
            self.compiled[key] = compile_template(schedule, k, m, v, self.actions(schedule, k, m, v))
        return self.compiled[key]

    def memory(self, schedule: Schedule, k: int, m: int, v: int) -> list[RankWalk]:
        key = (schedule, k, m, v)
        if key not in self.points:
            own = rank_stages(placement_of(schedule), k, v)
            self.points[key] = memory_points(self.actions(schedule, k, m, v), own)
        return self.points[key]

    def formatted(self, schedule: Schedule, k: int, m: int, v: int) -> list[str]:
        key = (schedule, k, m, v)
        if key not in self.text:
            self.text[key] = format_actions(self.actions(schedule, k, m, v))
        return list(self.text[key])


@dataclass(frozen=True)
class Layout:
    """The decisions of a plan, all :func:`estimate` prices (see its doc for each field): the
    stages, M, the schedule, recompute, and the mesh.  ``Layout.of(plan)`` reads a plan's."""

    stages: Sequence[tuple[int, int]] | Sequence[StageRange]
    num_microbatches: int
    schedule: Schedule = "1f1b"
    recompute: bool | Sequence[bool] = False
    recompute_layers: Sequence[int | None] | None = None
    data_parallel: int = 1
    pipeline_degree: int | None = None
    devices: Sequence[Sequence[int]] | None = None
    actions: Sequence[str] | None = None
    tensor_parallel: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    tensor_parallel_across_nodes: bool = False
    selective_recompute: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1
    context_attention: str = "all-gather"

    @staticmethod
    def of(plan: Plan, *, actions: bool = True) -> Layout:
        """The decisions ``plan`` made (its own actions, unless ``actions`` is False: a named
        schedule's template is the same order)."""
        return Layout(
            stages=[(s.start, s.stop) for s in plan.stages],
            num_microbatches=plan.num_microbatches,
            schedule=plan.schedule,
            recompute=[s.recompute for s in plan.stages],
            recompute_layers=[s.recompute_layers for s in plan.stages],
            data_parallel=plan.data_parallel_degree,
            pipeline_degree=plan.pipeline_degree,
            devices=[s.devices for s in plan.stages],
            actions=plan.actions if actions else None,
            tensor_parallel=plan.tensor_parallel_degree,
            zero_stage=plan.zero_stage,
            sequence_parallel=plan.sequence_parallel,
            tensor_parallel_across_nodes=plan.tensor_parallel_degree > plan.cluster.devices_per_node,
            selective_recompute=plan.selective_recompute,
            context_parallel=plan.context_parallel_degree,
            expert_parallel=plan.expert_parallel_degree,
            context_attention=plan.context_attention,
        )


def estimate(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    layout: Layout,
    *,
    solver: SolverInfo | None = None,
    templates: ScheduleTemplates | None = None,
) -> Plan:
    """Predict step time and memory of a fully specified plan, ``layout``, as a :class:`Plan`.

    ``tensor_parallel`` T, ``zero_stage`` and ``sequence_parallel`` are the mesh axes beyond
    D x K (:mod:`planner.mesh`): the plan is priced as the plan of one tensor-parallel rank,
    each group of T consecutive devices acting as one; ``devices`` then name the first device
    of each group.  ``selective_recompute`` prices Megatron's selective recompute on every
    block (:func:`planner.mesh.selective_layer`); it excludes full ``recompute``.

    ``stages`` are ``[start, stop)`` layer ranges in order.  ``pipeline_degree`` K defaults to
    the number of stages (half of them for the two-chunk V schedules; with the interleaved
    schedules, the devices available per replica), and each rank runs ``len(stages) / K``
    chunks.  ``devices[s]`` lists the device of each data-parallel replica of stage ``s``
    (default: :func:`default_devices`).  ``actions`` (one string per rank, as
    ``Plan.actions``) replaces the schedule's own order, e.g. to re-evaluate a plan.
    ``templates`` reuses the schedule templates of earlier estimates (:class:`ScheduleTemplates`).
    ``recompute_layers[s]``: how many of stage s's first layers a recomputing stage checkpoints
    (None or absent: all of them; a count > 0 makes the stage recompute).  ``solver`` is the
    plan's solver record (default: "given").
    """
    profile = profile_in_dtype(profile, training.dtype)
    ranges = [(s.start, s.stop) if isinstance(s, StageRange) else (int(s[0]), int(s[1])) for s in layout.stages]
    mesh = Mesh(layout.tensor_parallel, layout.zero_stage, layout.sequence_parallel, layout.selective_recompute,
                layout.context_parallel, layout.expert_parallel, layout.context_attention)
    recompute, recompute_layers = layout.recompute, layout.recompute_layers
    data_parallel, pipeline_degree, schedule = layout.data_parallel, layout.pipeline_degree, layout.schedule
    num_microbatches, devices, actions = layout.num_microbatches, layout.devices, layout.actions
    full = recompute is True or (not isinstance(recompute, bool) and any(recompute)) or any(recompute_layers or ())
    if layout.selective_recompute and full:
        raise InputError(
            f"selective recompute and full recompute ({recompute!r}) exclude each other (one recompute "
            "granularity per plan, as in Megatron): drop one of them"
        )
    if not mesh.trivial:
        return _mesh_estimate(profile, cluster, training, ranges, mesh, layout, solver=solver, templates=templates)
    try:
        check_coverage(ranges, profile.num_layers)
    except ValueError as err:
        raise InputError(f"invalid stages {_fmt_ranges(ranges)}: {err}") from None
    num_stages = len(ranges)
    n = cluster.num_devices
    if data_parallel < 1:
        raise InputError(f"data_parallel must be >= 1, got {data_parallel}")
    chunks = SCHEDULE_CHUNKS[schedule]
    if pipeline_degree is None:
        if chunks == "n":
            pipeline_degree = max(1, min(num_stages, n // data_parallel))
        elif chunks == "2":
            pipeline_degree = max(1, num_stages // 2)
        else:
            pipeline_degree = num_stages
    k = pipeline_degree
    if num_stages % k != 0:
        raise InputError(
            f"{num_stages} stages cannot be spread over pipeline degree {k}: give a multiple of {k} stages"
        )
    v = num_stages // k
    if (chunks == "1" and v != 1) or (chunks == "2" and v != 2):
        need = "one stage" if chunks == "1" else "two stages"
        raise InputError(
            f"{num_stages} stages on {k} devices is {v} per device, but schedule {schedule!r} runs {need} "
            "per device: choose interleaved-1f1b or interleaved-zb for several, zbv or dualpipev for two"
        )
    if k * data_parallel > n:
        raise InputError(
            f"the plan needs pipeline degree {k} x data-parallel degree {data_parallel} = "
            f"{k * data_parallel} devices but the cluster has {n}: use fewer stages or add devices"
        )
    m = num_microbatches
    g = training.global_batch_size
    if m < 1 or g % (data_parallel * m) != 0:
        raise InputError(
            f"global batch {g} does not split into {data_parallel} replica(s) x {m} micro-batches: "
            f"choose M so that data_parallel x M divides {g} (e.g. M in {_divisors(g // data_parallel)[:8]})"
        )
    try:
        check_schedule_shape(schedule, k, m, v)
    except ScheduleError as err:
        raise InputError(str(err)) from None
    rc = [bool(recompute)] * num_stages if isinstance(recompute, bool) else [bool(x) for x in recompute]
    if len(rc) != num_stages:
        raise InputError(f"recompute has {len(rc)} entries for {num_stages} stages: give one per stage")
    ckpt = checkpoint_counts(ranges, rc, recompute_layers)
    rc = [n > 0 for n in ckpt]
    placement = placement_of(schedule)
    devs = (
        [list(d) for d in devices]
        if devices is not None
        else default_devices(num_stages, k, data_parallel, placement=placement)
    )
    owner = [stage_rank(placement, s, k, v) for s in range(num_stages)]
    _check_placement(devs, owner, data_parallel, n)

    b = g // (data_parallel * m)
    costs = layer_costs(profile, b)

    times = stage_times(costs, ranges, rc, [min(cluster.devices[d].speed for d in devs[s]) for s in range(num_stages)],
                        boundary_transfer_ms(costs, ranges, devs, cluster), checkpointed=ckpt)
    own_stages = rank_stages(placement, k, v)
    terms = [
        rank_memory_terms(costs, [ranges[s] for s in own], training, checkpointed=[ckpt[s] for s in own])
        for own in own_stages
    ]
    limit_rank = [min(usable_bytes(cluster.devices[d], training) for s in own for d in devs[s]) for own in own_stages]
    shape = None
    if actions is not None:
        try:
            orders = parse_actions(actions)
        except ScheduleError as err:
            raise InputError(f"invalid actions: {err}") from None
    elif schedule == "planned":
        orders = planned_actions(m, times, terms, rc, limit_rank)
    elif templates is not None:
        shape = (schedule, k, m, v)
        orders = templates.actions(*shape)
    else:
        orders = schedule_actions(schedule, k, m, v)
    try:
        compiled = templates.program(*shape) if templates is not None and shape else compile_actions(orders, num_stages, m)
    except ScheduleError as err:
        raise InputError(f"the actions cannot run: {err}") from None
    if list(compiled.stage_to_rank) != owner:
        raise InputError(
            f"the actions put the stages on ranks {list(compiled.stage_to_rank)}, but schedule {schedule!r} "
            f"places them on {owner}"
        )

    # the simulator's fast path (no events: the largest plans have 10^5 actions and more)
    finish = makespans(compiled, times.forward, times.backward, times.transfer, binput=times.input, bweight=times.weight)
    makespan = max(finish, default=0.0)
    busy = busy_ms(orders, times)
    bubble = max(0.0, 1.0 - busy / (k * makespan)) if makespan > 0 else 0.0

    # Per rank: memory (walking its actions), and the gradient all-reduce after its last backward.
    points = templates.memory(*shape) if templates is not None and shape else memory_points(orders, own_stages)
    mem_rank: list[float] = []
    ar_rank: list[float] = []
    parts_rank: list[MemoryParts] = []
    for r, own in enumerate(own_stages):
        mem_rank.append(rank_memory_from_terms(terms[r], [rc[s] for s in own], points[r]))
        parts_rank.append(memory_parts(
            sum(costs.prefix_param[ranges[s][1]] - costs.prefix_param[ranges[s][0]] for s in own),
            mem_rank[-1], training, device=_largest_overhead(cluster, [d for s in own for d in devs[s]]),
        ))
        grad = sum(costs.prefix_param[ranges[s][1]] - costs.prefix_param[ranges[s][0]] for s in own)
        grad_bytes = grad * training.gradient_bytes_per_param_byte
        link = replica_link(cluster, devs[own[0]])
        ar_rank.append(allreduce_ms(grad_bytes, data_parallel, link.bandwidth_bytes_per_s, link.latency_s))
    # the calibrated fixed cost of a step (optimizer, launch: planner/calibrate.py), 0 as profiled
    overhead = profile.step_overhead_ms
    # the share of each rank's collective that overlaps its last backward does not add to the step
    exposed = 1.0 - training.gradient_overlap
    step = max(f + a * exposed for f, a in zip(finish, ar_rank, strict=True)) + overhead

    stage_plans = [
        StagePlan(
            index=s,
            start=a,
            stop=e,
            layer_names=[profile.layers[i].name for i in range(a, e)],
            devices=devs[s],
            recompute=rc[s],
            recompute_layers=ckpt[s] if 0 < ckpt[s] < e - a else None,
            recompute_ms=times.recompute[s],
            param_bytes=costs.prefix_param[e] - costs.prefix_param[a],
            forward_ms=times.forward[s],
            backward_ms=times.backward[s],
            backward_input_ms=times.input[s],
            backward_weight_ms=times.weight[s],
            memory_bytes=math.ceil(mem_rank[owner[s]]),
            memory_parts=parts_rank[owner[s]],
            memory_limit_bytes=limit_rank[owner[s]],
            send_ms=times.transfer[s] if s < num_stages - 1 else 0.0,
        )
        for s, (a, e) in enumerate(ranges)
    ]
    return Plan(
        model=profile.model,
        profile_sha256=structure_sha(profile),
        num_layers=profile.num_layers,
        schedule=schedule,
        placement=placement,
        pipeline_degree=k,
        data_parallel_degree=data_parallel,
        virtual_stages=v,
        num_microbatches=m,
        microbatch_size=b,
        global_batch_size=g,
        stages=stage_plans,
        predicted=Predicted(
            step_time_ms=step,
            throughput_samples_per_s=g / (step / 1e3) if step > 0 else 0.0,
            bubble_fraction=min(1.0, bubble),
            lower_bound_ms=lower_bound_ms(profile, cluster, training),
            allreduce_ms=max(ar_rank),
            step_overhead_ms=overhead,
            tensor_parallel_ms=0.0,
            zero_ms=0.0,
            pipeline_transfer_ms=pipeline_transfer_ms(times.transfer, owner, m),
        ),
        solver=solver or SolverInfo(status="given", gap=0.0),
        cluster=cluster,
        training=training,
        notes=[n for n in (extrapolation_note(profile, b), _calibration_note(profile)) if n],
        split_points=list(profile.split_points),
        actions=templates.formatted(*shape) if templates is not None and shape else format_actions(orders),
    )


def _mesh_estimate(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    ranges: list[tuple[int, int]],
    mesh: Mesh,
    layout: Layout,
    *,
    solver: SolverInfo | None,
    templates: ScheduleTemplates | None = None,
) -> Plan:
    """:func:`estimate` of a plan with tensor parallelism or ZeRO: the D x K plan of one
    tensor-parallel rank (:func:`planner.mesh.mesh_problem`), reported on the real devices."""
    t, c = mesh.tensor_parallel, mesh.context_parallel
    g = mesh.group  # devices per virtual device: T x C
    across_nodes = layout.tensor_parallel_across_nodes
    data_parallel, devices, schedule = layout.data_parallel, layout.devices, layout.schedule
    check_mesh(mesh, cluster, across_nodes=across_nodes)
    n = cluster.num_devices
    groups = n // g
    if data_parallel < 1:
        raise InputError(f"data_parallel must be >= 1, got {data_parallel}")
    chunks = SCHEDULE_CHUNKS[schedule]
    k = layout.pipeline_degree
    if k is None:
        if chunks == "n":
            k = max(1, min(len(ranges), groups // data_parallel))
        elif chunks == "2":
            k = max(1, len(ranges) // 2)
        else:
            k = len(ranges)
    if k * data_parallel * g > n:
        cp = f" x context-parallel degree {c}" if c > 1 else ""
        raise InputError(
            f"the plan needs pipeline degree {k} x data-parallel degree {data_parallel} x tensor-parallel "
            f"degree {t}{cp} = {k * data_parallel * g} devices but the cluster has {n}: use fewer stages, a "
            "smaller degree, or add devices"
        )
    virt: list[list[int]] | None = None
    if devices is not None:
        virt = []
        for s, devs in enumerate(devices):
            row = []
            for dev in devs:
                if dev % g:
                    raise InputError(
                        f"stage {s} is placed on device {dev}, which does not start a tensor-parallel group of "
                        f"{g}: give the first device of each group (a multiple of {g})"
                    )
                row.append(dev // g)
            virt.append(row)
    problem = mesh_problem(
        profile, cluster, training, mesh, data_parallel=data_parallel, pipeline_degree=k, across_nodes=across_nodes
    )
    inner = estimate(
        problem.profile, problem.cluster, problem.training,
        replace(layout, stages=ranges, pipeline_degree=k, devices=virt, tensor_parallel=1, zero_stage=0,
                sequence_parallel=False, tensor_parallel_across_nodes=False, selective_recompute=False,
                context_parallel=1, expert_parallel=1),
        solver=solver, templates=templates,
    )
    pre = _prefix(problem.param_bytes)
    rank_of = [stage_rank(inner.placement, x.index, inner.pipeline_degree, inner.virtual_stages) for x in inner.stages]
    stage_plans = []
    for st in inner.stages:
        phys = [d * g for d in st.devices]
        members = [x for d in phys for x in range(d, d + g)]
        limit = min(usable_bytes(cluster.devices[x], training) for x in members)
        own = [x for x in inner.stages if rank_of[x.index] == rank_of[st.index]]
        parts = memory_parts(
            sum(pre[x.stop] - pre[x.start] for x in own), st.memory_bytes, training,
            zero=mesh.zero_stage, data_parallel=data_parallel, gathered=problem.gathered_bytes,
            device=_largest_overhead(cluster, members),
        )
        stage_plans.append(st.model_copy(update={
            "devices": phys,
            "param_bytes": int(pre[st.stop] - pre[st.start]),
            "memory_bytes": st.memory_bytes + problem.gathered_bytes,
            "memory_limit_bytes": limit,
            "memory_parts": parts,
        }))
    notes = list(inner.notes)
    note = replicated_note(profile, t)
    if note:
        notes.append(note)
    note = flat_scaling_note(profile, t)
    if note:
        notes.append(note)
    axes = axis_collectives_ms(profile, cluster, training, mesh, problem, inner)
    extra = axes.pop("context_gradient_ms")
    predicted = inner.predicted
    if extra > 0:  # the gradients' reduction over the context-parallel group, once per step
        step = predicted.step_time_ms + extra
        predicted = predicted.model_copy(update={
            "step_time_ms": step,
            "throughput_samples_per_s": inner.global_batch_size / (step / 1e3) if step > 0 else 0.0,
            "allreduce_ms": predicted.allreduce_ms + extra,
        })
    return inner.model_copy(update={
        "stages": stage_plans,
        "cluster": cluster,
        "training": training,
        "tensor_parallel_degree": t,
        "zero_stage": mesh.zero_stage,
        "sequence_parallel": mesh.sequence_parallel,
        "selective_recompute": mesh.selective_recompute,
        "context_parallel_degree": c,
        "expert_parallel_degree": mesh.expert_parallel,
        "context_attention": mesh.context_attention,
        "notes": notes,
        "predicted": predicted.model_copy(update={
            "lower_bound_ms": lower_bound_ms(profile, cluster, training),
            **mesh_collectives_ms(profile, cluster, training, mesh, problem, inner),
            **axes,
        }),
    })


def memory_parts(
    param_bytes: float,
    peak_bytes: float,
    training: TrainingSetup,
    *,
    zero: int = 0,
    data_parallel: int = 1,
    gathered: int = 0,
    device: Device | None = None,
) -> MemoryParts:
    """What a device's predicted peak ``peak_bytes`` (without ZeRO-3's ``gathered`` bytes) is made
    of: its ``param_bytes`` (one tensor-parallel rank's, before ZeRO) as parameters, gradients and
    optimizer state, each sharded over the ``data_parallel`` replicas from ZeRO stage 3, 2 and 1
    on; the rest of the peak is activations and the gathered layers, or the optimizer step's
    temporaries when those make the peak (the step runs when no activation is held and the
    gathered layers are freed: the peak's rest is then the step's less ``gathered``, the bytes it
    reuses).  Beside that allocator peak, ``device`` holds its context and the allocator's
    fragmentation (:func:`planner.cost.memory.outside_allocator`)."""
    d = data_parallel if data_parallel > 1 else 1
    params = param_bytes / (d if zero >= 3 else 1)
    grads = param_bytes * training.gradient_bytes_per_param_byte / (d if zero >= 2 else 1)
    opt = param_bytes * training.optimizer_state_factor / (d if zero >= 1 else 1)
    step = math.ceil(step_temporary_bytes(param_bytes / (d if zero >= 1 else 1), training))
    static = math.ceil(params) + math.ceil(grads) + math.ceil(opt)
    rest = max(0, math.ceil(peak_bytes) - static)
    at_step = step > 0 and rest + gathered <= step
    context, fragmentation = outside_allocator(peak_bytes + gathered, device) if device is not None else (0, 0)
    return MemoryParts(
        parameters=math.ceil(params),
        gradients=math.ceil(grads),
        optimizer=math.ceil(opt),
        activations=0 if at_step else rest,
        optimizer_step=rest + gathered if at_step else 0,
        gathered=0 if at_step else gathered,
        context=context,
        fragmentation=fragmentation,
    )


def _largest_overhead(cluster: Cluster, devices: Sequence[int]) -> Device:
    """The device of ``devices`` that holds the most outside its allocator (a plan's devices are
    of one preset, so in practice any of them)."""
    return max((cluster.devices[d] for d in devices), key=lambda x: (x.context_bytes, x.fragmentation))


def pipeline_transfer_ms(transfer: Sequence[float], owner: Sequence[int], num_microbatches: int) -> float:
    """The plan's pipeline transfers per step on the busiest pipeline rank (``Predicted.
    pipeline_transfer_ms``): every boundary ``b`` between stages ``b`` and ``b + 1`` on ranks
    ``owner[b]`` and ``owner[b + 1]`` moves each micro-batch's activations forward and its
    gradient back, each in ``transfer[b]`` ms (what the simulator waits between the two actions);
    a rank counts the boundaries its stages touch, sends and receives alike."""
    per: dict[int, float] = {}
    for b, ms in enumerate(transfer):
        for r in {owner[b], owner[b + 1]}:
            per[r] = per.get(r, 0.0) + 2 * num_microbatches * ms
    return max(per.values(), default=0.0)


def mesh_collectives_ms(
    profile: Profile, cluster: Cluster, training: TrainingSetup, mesh: Mesh, problem: MeshProblem, inner: Plan
) -> dict[str, float]:
    """``Predicted.tensor_parallel_ms`` and ``zero_ms`` of a mesh plan: per pipeline rank, the
    collectives its stages' layer times carry (:func:`planner.mesh.tp_collectives_ms` at the plan's
    micro-batch size, read like every profiled series; :func:`planner.mesh.zero_collectives_ms`),
    summed over the micro-batches, a recomputing stage's forward counted twice for tensor
    parallelism (not for ZeRO-3's gather, which a recompute does not repeat); the busiest rank's.
    Link time, before ZeRO's overlap and at device speed 1.  ``inner`` is the D x K plan of
    ``problem`` (``profile`` in the plan's dtype)."""
    t, z, d = mesh.tensor_parallel, mesh.zero_stage, inner.data_parallel_degree
    k, m, b = inner.pipeline_degree, inner.num_microbatches, inner.microbatch_size
    g = mesh.group
    sizes = profile.microbatch_sizes
    tp_f, tp_b = [], []
    c = mesh.context_parallel  # a context-parallel rank's collectives carry its s/C of the tokens
    for layer in profile.layers:
        f, bw = tp_collectives_ms(layer, t, tp_link(cluster, t))
        tp_f.append(scaling.at_size(sizes, f, b) / c if any(f) else 0.0)
        tp_b.append(scaling.at_size(sizes, bw, b) / c if any(bw) else 0.0)
    link = dp_link(cluster, g, d, k)
    zero = [zero_collectives_ms(p, z, d, training, link) for p in problem.param_bytes]
    tp_rank = [0.0] * k
    zero_rank = [0.0] * k
    for st in inner.stages:
        r = stage_rank(inner.placement, st.index, k, inner.virtual_stages)
        redone = st.start + st.checkpointed_layers  # layers [start, redone) run their forward twice
        layers = range(st.start, st.stop)
        tp_rank[r] += m * sum((2 if i < redone else 1) * tp_f[i] + tp_b[i] for i in layers)
        # (a recompute finds its parameters gathered: FSDP2 gathers them before the backward)
        zero_rank[r] += m * sum(rs + 2 * ag for rs, ag in (zero[i] for i in layers))
    return {"tensor_parallel_ms": max(tp_rank), "zero_ms": max(zero_rank)}


def axis_collectives_ms(
    profile: Profile, cluster: Cluster, training: TrainingSetup, mesh: Mesh, problem: MeshProblem, inner: Plan
) -> dict[str, float]:
    """``Predicted.context_parallel_ms`` and ``expert_parallel_ms`` of a mesh plan (0 without the
    axis): per pipeline rank, the K/V collectives and the MoE all-to-alls its layer times carry,
    over the micro-batches (a recomputing stage's forward counted twice), the busiest rank's; and
    ``context_gradient_ms``, the per-step all-reduce of the busiest rank's gradients over its
    context-parallel group (:func:`planner.context.context_gradient_ms`), which the step adds."""
    t, c, e = mesh.tensor_parallel, mesh.context_parallel, mesh.expert_parallel
    out = {"context_parallel_ms": 0.0, "expert_parallel_ms": 0.0, "context_gradient_ms": 0.0}
    if c == 1 and e == 1:
        return out
    k, m, b = inner.pipeline_degree, inner.num_microbatches, inner.microbatch_size
    sizes = profile.microbatch_sizes
    cp_f, cp_b, ep = [0.0] * profile.num_layers, [0.0] * profile.num_layers, [0.0] * profile.num_layers
    if c > 1:
        group = context_group(cluster, t, c)
        for i, layer in enumerate(profile.layers):
            kv = [kv_bytes(ops, t) for ops in (layer.operations or [])]
            if any(kv):
                cp_f[i] = scaling.at_size(sizes, [all_gather_ms(x, group, cluster) for x in kv], b)
                cp_b[i] = scaling.at_size(sizes, [reduce_scatter_ms(x, group, cluster) for x in kv], b)
    if e > 1:
        for i, layer in enumerate(profile.layers):
            per = all_to_all_per_microbatch_ms(layer, e, t=t, c=c, sequence_parallel=mesh.sequence_parallel,
                                               cluster=cluster, pipeline_degree=k)
            ep[i] = scaling.at_size(sizes, per, b) if any(per) else 0.0
    cp_rank, ep_rank, grads = [0.0] * k, [0.0] * k, [0.0] * k
    for st in inner.stages:
        r = stage_rank(inner.placement, st.index, k, inner.virtual_stages)
        redone = st.start + st.checkpointed_layers
        layers = range(st.start, st.stop)
        cp_rank[r] += m * sum((2 if i < redone else 1) * cp_f[i] + cp_b[i] for i in layers)
        ep_rank[r] += m * sum((1.5 if i < redone else 1.0) * ep[i] for i in layers)
        grads[r] += sum(problem.param_bytes[i] for i in layers) * training.gradient_bytes_per_param_byte
    out["context_parallel_ms"] = max(cp_rank)
    out["expert_parallel_ms"] = max(ep_rank)
    out["context_gradient_ms"] = max(context_gradient_ms(x, cluster, t, c) for x in grads)
    return out


def checkpoint_counts(
    ranges: Sequence[tuple[int, int]], recompute: Sequence[bool], recompute_layers: Sequence[int | None] | None
) -> list[int]:
    """Per stage, how many of its first layers are checkpointed: ``recompute_layers[s]`` when
    given (None: all of them where the stage recomputes), else all or none by ``recompute``."""
    if recompute_layers is None:
        return [b - a if r else 0 for (a, b), r in zip(ranges, recompute, strict=True)]
    if len(recompute_layers) != len(ranges):
        raise InputError(
            f"recompute_layers has {len(recompute_layers)} entries for {len(ranges)} stages: give one per stage"
        )
    out = []
    for s, ((a, b), r, n) in enumerate(zip(ranges, recompute, recompute_layers, strict=True)):
        if n is None:
            out.append(b - a if r else 0)
        elif not 0 <= n <= b - a:
            raise InputError(
                f"stage {s} ({a}:{b}) has {b - a} layers but recompute_layers asks to checkpoint {n}: "
                f"give 0..{b - a}"
            )
        else:
            out.append(n)
    return out


def stage_times(
    costs: LayerCosts,
    ranges: Sequence[tuple[int, int]],
    recompute: Sequence[bool],
    speed: Sequence[float],
    transfer: Sequence[float],
    *,
    checkpointed: Sequence[int] | None = None,
) -> StageTimes:
    """:class:`StageTimes` of a split (each stage at its devices' ``speed``).  A recomputing
    stage re-runs the forward of its checkpointed layers (``checkpointed[s]`` first layers;
    default: all) in its backward, less what a recompute does not repeat
    (``LayerCosts.recompute_ms``)."""
    fwd = [(costs.prefix_forward[e] - costs.prefix_forward[a]) / speed[s] for s, (a, e) in enumerate(ranges)]
    pr = costs.prefix_recompute
    rec = [
        0.0 if not r else (pr[e if checkpointed is None else min(e, a + checkpointed[s])] - pr[a]) / speed[s]
        for s, ((a, e), r) in enumerate(zip(ranges, recompute, strict=True))
    ]
    return StageTimes(
        forward=fwd,
        backward=[(costs.prefix_backward[e] - costs.prefix_backward[a]) / speed[s] + rec[s] for s, (a, e) in enumerate(ranges)],
        input=[(costs.prefix_input[e] - costs.prefix_input[a]) / speed[s] + rec[s] for s, (a, e) in enumerate(ranges)],
        weight=[(costs.prefix_weight[e] - costs.prefix_weight[a]) / speed[s] for s, (a, e) in enumerate(ranges)],
        transfer=list(transfer),
        recompute=rec,
    )


def busy_ms(orders: Sequence[Sequence[Action]], times: StageTimes) -> float:
    """Compute time of every action (what the ranks are busy with)."""
    per = {"F": times.forward, "B": times.backward, "I": times.input, "W": times.weight}
    return sum(per[a.kind][a.stage] for acts in orders for a in acts)


def _calibration_note(profile: Profile) -> str | None:
    cal = profile.calibration
    if cal is None:
        return None
    return (
        f"costs calibrated from {len(cal.runs)} run(s) (pipeplan calibrate): layer times scaled, "
        f"step overhead {cal.step_overhead_ms:.2f} ms"
    )


def reestimate(
    plan: Plan,
    profile: Profile,
    *,
    cluster: Cluster | None = None,
    training: TrainingSetup | None = None,
    solver: SolverInfo | None = None,
    recompute_layers: Sequence[int | None] | None = None,
    templates: ScheduleTemplates | None = None,
) -> Plan:
    """Re-run :func:`estimate` for the decisions ``plan`` made (:meth:`Layout.of`), with
    ``profile`` and the plan's own cluster and training setup unless given.
    ``recompute_layers`` replaces the stages' checkpointed-layer counts.  With ``templates``, a
    named schedule runs its template from there (the same order as the plan's actions, without
    parsing them again); otherwise what runs is the plan's own order."""
    layout = Layout.of(plan, actions=templates is None or plan.schedule == "planned")
    if recompute_layers is not None:
        layout = replace(layout, recompute_layers=list(recompute_layers))
    return estimate(profile, cluster or plan.cluster, training or plan.training, layout, solver=solver,
                    templates=templates)


def plan_fits(plan: Plan) -> bool:
    """True when every stage's predicted peak fits its device's usable memory."""
    return all(s.memory_bytes <= s.memory_limit_bytes for s in plan.stages)


def plan_orders(plan: Plan) -> list[list[Action]]:
    """The plan's actions per rank (its ``actions``, or its schedule's template)."""
    if plan.actions is not None:
        return parse_actions(plan.actions)
    return schedule_actions(plan.schedule, plan.pipeline_degree, plan.num_microbatches, plan.virtual_stages)


def simulate_plan(plan: Plan) -> Simulation:
    """Re-run the simulator for a plan (for timelines and charts); needs nothing but the plan."""
    rec = [s.recompute_time_ms for s in plan.stages]
    bwd = [s.backward_ms - r for s, r in zip(plan.stages, rec, strict=True)]
    inp = [s.backward_input_ms - r if s.backward_input_ms is not None else b / 2 for s, r, b in zip(plan.stages, rec, bwd, strict=True)]
    wgt = [s.backward_weight_ms if s.backward_weight_ms is not None else b - i for s, b, i in zip(plan.stages, bwd, inp, strict=True)]
    return simulate(
        plan_orders(plan),
        [s.forward_ms for s in plan.stages],
        bwd,
        recompute_ms=rec,
        transfer_ms=[s.send_ms for s in plan.stages[:-1]],
        input_ms=inp,
        weight_ms=wgt,
    )


def _check_placement(placement: list[list[int]], owner: Sequence[int], d: int, n: int) -> None:
    num_stages = len(owner)
    if len(placement) != num_stages or any(len(p) != d for p in placement):
        raise InputError(f"devices must list {d} device(s) for each of the {num_stages} stages, got {placement}")
    for s, p in enumerate(placement):
        for dev in p:
            if not 0 <= dev < n:
                raise InputError(f"stage {s} is placed on device {dev} but the cluster has devices 0..{n - 1}")
    used: dict[int, int] = {}
    for s, p in enumerate(placement):
        for dev in p:
            rank = owner[s]
            if used.setdefault(dev, rank) != rank:
                raise InputError(f"device {dev} is given to two pipeline ranks ({used[dev]} and {rank}): one rank per device")
    for s in range(num_stages):
        for t in range(s + 1, num_stages):
            if owner[s] == owner[t] and sorted(placement[s]) != sorted(placement[t]):
                raise InputError(
                    f"stages {s} and {t} run on the same pipeline rank, so they need the same devices, "
                    f"got {placement[s]} and {placement[t]}"
                )


def _all_divisors(x: int) -> list[int]:
    """The divisors of ``x`` in O(sqrt x)."""
    small = [i for i in range(1, math.isqrt(x) + 1) if x % i == 0]
    return sorted({*small, *(x // i for i in small)})


def _divisors(x: int) -> list[int]:
    return [i for i in range(1, x + 1) if x % i == 0]


def _fmt_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{a}:{b}" for a, b in ranges)
