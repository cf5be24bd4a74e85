"""The cost model: a plan's step time and per-device peak memory.

Sources of the formulas:

* GPipe (Huang et al., NeurIPS 2019): K stages, M micro-batches, bubble (K-1)/(M+K-1);
  re-materialization keeps only each stage's input per micro-batch and recomputes the rest
  during the backward pass.
* Narayanan et al. 2021 (Megatron-LM at scale, SC'21): 1F1B keeps at most K-k micro-batches
  in flight on stage k; interleaved 1F1B with v chunks per device cuts the bubble to
  (K-1)/(vM) and warms up with (K-r-1)*2 + (v-1)*K micro-batches on rank r.
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
from dataclasses import dataclass

from planner import scaling
from planner.errors import InputError
from planner.schema import (
    Cluster,
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
    ScheduleError,
    Simulation,
    check_schedule_shape,
    compile_schedule,
    makespans,
    simulate_schedule,
)


def interpolate(sizes: Sequence[int], values: Sequence[float], b: float, *, clamp: bool = True) -> float:
    """Value at micro-batch size ``b`` of one series measured at ``sizes``: the physical fit
    (:func:`planner.scaling.at_size`), or with ``clamp=False`` a signed correction read
    linearly (:func:`planner.scaling.linear`)."""
    return scaling.at_size(sizes, values, b) if clamp else scaling.linear(sizes, values, b)


@dataclass(frozen=True)
class LayerCosts:
    """Every layer's costs at one micro-batch size, with prefix sums for O(1) stage sums.

    ``prefix_x[i]`` is the sum of ``x`` over layers ``0..i-1``, so a stage ``[a, b)`` costs
    ``prefix_x[b] - prefix_x[a]``.
    """

    microbatch_size: int
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    param_bytes: tuple[int, ...]
    #: bytes crossing a cut right after each layer
    cut_bytes: tuple[float, ...]
    #: bytes of the model input
    input_bytes: float
    prefix_forward: tuple[float, ...]
    prefix_backward: tuple[float, ...]
    prefix_activation: tuple[float, ...]
    prefix_param: tuple[int, ...]
    #: per layer: (offset, bytes) a stage starting there keeps of its own inputs once it
    #: reaches layer + offset (``LayerProfile.kept_inputs``); empty tuples when not profiled
    kept_inputs: tuple[tuple[tuple[int, float], ...], ...] = ()
    #: how far below the plain prefix sums a stage's activations can fall (the most negative
    #: ``kept_inputs`` of any start, as a positive number; 0 for almost every profile): the
    #: solver's prefix-sum memory bounds subtract it, or step aside, to stay valid
    activation_slack: float = 0.0

    @property
    def num_layers(self) -> int:
        return len(self.forward_ms)

    def stage_activation_bytes(self, start: int, stop: int) -> float:
        """Bytes a stage ``[start, stop)`` keeps for backward per micro-batch, run as one module.

        The layers' ``activation_bytes`` count each saved tensor once, on the first layer that
        saves it; a stage that starts after a cut also keeps the inputs it receives when its
        layers save them (``kept_inputs``).
        """
        acts = self.prefix_activation[stop] - self.prefix_activation[start]
        if self.kept_inputs and start > 0:
            acts += sum(nbytes for offset, nbytes in self.kept_inputs[start] if start + offset < stop)
        return max(0.0, acts)

    def stage_input_bytes(self, start: int) -> float:
        """Bytes a stage starting at layer ``start`` receives per micro-batch (kept when recomputing)."""
        return self.input_bytes if start == 0 else self.cut_bytes[start - 1]


def layer_costs(profile: Profile, microbatch_size: int) -> LayerCosts:
    """Interpolate every layer of ``profile`` at ``microbatch_size``."""
    sizes = profile.microbatch_sizes
    b = microbatch_size
    fwd = tuple(
        scaling.at_size(sizes, layer.forward_ms, b, spread=layer.forward_ms_spread) for layer in profile.layers
    )
    bwd = tuple(
        scaling.at_size(sizes, layer.backward_ms, b, spread=layer.backward_ms_spread) for layer in profile.layers
    )
    act = tuple(interpolate(sizes, layer.activation_bytes, b) for layer in profile.layers)
    cut = tuple(interpolate(sizes, layer.transfer_bytes(), b) for layer in profile.layers)
    params = tuple(layer.param_bytes for layer in profile.layers)
    inp = interpolate(sizes, profile.input_bytes, b) if profile.input_bytes else 0.0
    kept: tuple[tuple[tuple[int, float], ...], ...] = ()
    if any(layer.kept_inputs for layer in profile.layers):
        kept = tuple(
            tuple((k.offset, interpolate(sizes, k.bytes, b, clamp=False)) for k in layer.kept_inputs or ())
            for layer in profile.layers
        )
    return LayerCosts(
        microbatch_size=b,
        forward_ms=fwd,
        backward_ms=bwd,
        activation_bytes=act,
        param_bytes=params,
        cut_bytes=cut,
        input_bytes=inp,
        prefix_forward=_prefix(fwd),
        prefix_backward=_prefix(bwd),
        prefix_activation=_prefix(act),
        prefix_param=tuple(int(x) for x in _prefix(params)),
        kept_inputs=kept,
        activation_slack=max((-sum(min(0.0, n) for _, n in entries) for entries in kept), default=0.0),
    )


def _prefix(values: Sequence[float]) -> tuple[float, ...]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)


# --------------------------------------------------------------------------- memory


def inflight_microbatches(schedule: Schedule, num_ranks: int, num_microbatches: int, rank: int, virtual_stages: int = 1) -> int:
    """How many micro-batches' activations rank ``rank`` holds at its peak.

    GPipe: all M.  1F1B: min(K - k, M) on stage k.  Interleaved 1F1B: Megatron's warm-up
    count (K - r - 1) * 2 + (v - 1) * K, plus the one in its steady state, capped at M * v
    (counted in chunk-micro-batches).
    """
    k, m, v = num_ranks, num_microbatches, virtual_stages
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(k - rank, m)
    return min((k - rank - 1) * 2 + (v - 1) * k + 1, m * v)


def static_bytes(param_bytes: float, training: TrainingSetup) -> float:
    """Parameters + gradients + optimizer state."""
    return param_bytes * (1.0 + training.gradient_bytes_per_param_byte + training.optimizer_state_factor)


def rank_memory_bytes(
    costs: LayerCosts,
    ranges: Sequence[tuple[int, int]],
    recompute: Sequence[bool],
    training: TrainingSetup,
    *,
    inflight: int,
) -> float:
    """Peak bytes of one rank holding the stages ``ranges`` (one, or v chunks when interleaved).

    Without recompute each in-flight micro-batch keeps the stage's activations; with
    recompute it keeps only the stage input, and one micro-batch's full activations exist
    during its backward.  For v chunks, the in-flight count multiplies the largest chunk's
    footprint (an upper bound).
    """
    static, acts, inputs = rank_memory_terms(costs, ranges, training)
    return rank_memory_from_terms(static, acts, inputs, recompute, inflight=inflight)


def rank_memory_terms(
    costs: LayerCosts, ranges: Sequence[tuple[int, int]], training: TrainingSetup
) -> tuple[float, list[float], list[float]]:
    """What :func:`rank_memory_bytes` reads of a rank's stages: its static bytes, and each
    stage's activations and input bytes (for searches that try many recompute choices)."""
    params = sum(costs.prefix_param[b] - costs.prefix_param[a] for a, b in ranges)
    acts = [costs.stage_activation_bytes(a, b) for a, b in ranges]
    inputs = [costs.stage_input_bytes(a) for a, _ in ranges]
    return static_bytes(params, training), acts, inputs


def rank_memory_from_terms(
    static: float, acts: Sequence[float], inputs: Sequence[float], recompute: Sequence[bool], *, inflight: int
) -> float:
    """:func:`rank_memory_bytes` from :func:`rank_memory_terms` and the recompute flags."""
    stash = 0.0
    live = 0.0
    for act, inp, rc in zip(acts, inputs, recompute, strict=True):
        if rc:
            stash = max(stash, inp)
            live = max(live, act)
        else:
            stash = max(stash, act)
    return static + inflight * stash + live


# --------------------------------------------------------------------------- time


def transfer_ms(nbytes: float, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Point-to-point time: bytes / bandwidth + latency, in ms."""
    return (nbytes / bandwidth_bytes_per_s + latency_s) * 1e3


def allreduce_ms(nbytes: float, replicas: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-reduce: 2(D-1)/D x bytes / bandwidth, plus 2(D-1) latencies, in ms."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return (steps / replicas * nbytes / bandwidth_bytes_per_s + steps * latency_s) * 1e3


def boundary_transfer_ms(
    costs: LayerCosts,
    ranges: Sequence[tuple[int, int]],
    placement: Sequence[Sequence[int]],
    cluster: Cluster,
) -> list[float]:
    """Time to move one micro-batch across each stage boundary (the slowest replica's link).

    Stages on the same device exchange nothing over a link.
    """
    out = []
    for s in range(len(ranges) - 1):
        nbytes = costs.cut_bytes[ranges[s][1] - 1]
        worst = 0.0
        for src, dst in zip(placement[s], placement[s + 1], strict=True):
            if src != dst:
                link = cluster.link(src, dst)
                worst = max(worst, transfer_ms(nbytes, link.bandwidth_bytes_per_s, link.latency_s))
        out.append(worst)
    return out


def default_devices(num_stages: int, pipeline_degree: int, data_parallel: int) -> list[list[int]]:
    """Device indices of each stage's replicas: replica d of rank k is device d * K + k.

    A pipeline occupies consecutive devices, so neighbouring stages share a node when they can.
    """
    return [[d * pipeline_degree + s % pipeline_degree for d in range(data_parallel)] for s in range(num_stages)]


def lower_bound_ms(profile: Profile, cluster: Cluster, training: TrainingSetup) -> float:
    """Total forward + backward work of a step spread perfectly over every device.

    Uses the cheapest per-sample cost over the measured sizes, 1 and the global batch (linear
    pieces have their per-sample extremes at their ends), so no plan can beat it.  A calibrated
    profile's fixed step overhead is added (every plan pays it).
    """
    g = training.global_batch_size
    candidates = sorted({1, g, *(b for b in profile.microbatch_sizes if b <= g)})
    best = math.inf
    for b in candidates:
        c = layer_costs(profile, b)
        best = min(best, (c.prefix_forward[-1] + c.prefix_backward[-1]) / b)
    return best * g / sum(d.speed for d in cluster.devices) + profile.step_overhead_ms


def estimate(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    stages: Sequence[tuple[int, int]] | Sequence[StageRange],
    *,
    num_microbatches: int,
    schedule: Schedule = "1f1b",
    recompute: bool | Sequence[bool] = False,
    data_parallel: int = 1,
    pipeline_degree: int | None = None,
    devices: Sequence[Sequence[int]] | None = None,
    solver: SolverInfo | None = None,
) -> Plan:
    """Predict step time and memory of a fully specified plan and return it as a :class:`Plan`.

    ``stages`` are ``[start, stop)`` layer ranges in order.  ``pipeline_degree`` K defaults to
    the number of stages; with ``interleaved-1f1b`` it defaults to the devices available per
    replica, and each rank runs ``len(stages) / K`` chunks.  ``devices[s]`` lists the device of
    each data-parallel replica of stage ``s`` (default: :func:`default_devices`).
    """
    ranges = [(s.start, s.stop) if isinstance(s, StageRange) else (int(s[0]), int(s[1])) for s in stages]
    try:
        check_coverage(ranges, profile.num_layers)
    except ValueError as err:
        raise InputError(f"invalid stages {_fmt_ranges(ranges)}: {err}") from None
    num_stages = len(ranges)
    n = cluster.num_devices
    if data_parallel < 1:
        raise InputError(f"data_parallel must be >= 1, got {data_parallel}")
    if pipeline_degree is None:
        pipeline_degree = num_stages if schedule != "interleaved-1f1b" else max(1, min(num_stages, n // data_parallel))
    k = pipeline_degree
    if num_stages % k != 0:
        raise InputError(
            f"{num_stages} stages cannot be spread over pipeline degree {k}: with interleaved-1f1b give a "
            f"multiple of {k} stages"
        )
    v = num_stages // k
    if schedule != "interleaved-1f1b" and v != 1:
        raise InputError(f"{num_stages} stages on {k} devices needs schedule interleaved-1f1b, not {schedule!r}")
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
    placement = [list(d) for d in devices] if devices is not None else default_devices(num_stages, k, data_parallel)
    _check_placement(placement, num_stages, k, data_parallel, n)

    b = g // (data_parallel * m)
    costs = layer_costs(profile, b)

    speed = [min(cluster.devices[d].speed for d in placement[s]) for s in range(num_stages)]
    fwd = [(costs.prefix_forward[e] - costs.prefix_forward[a]) / speed[s] for s, (a, e) in enumerate(ranges)]
    bwd = [(costs.prefix_backward[e] - costs.prefix_backward[a]) / speed[s] for s, (a, e) in enumerate(ranges)]
    rec = [fwd[s] if rc[s] else 0.0 for s in range(num_stages)]
    xfer = boundary_transfer_ms(costs, ranges, placement, cluster)

    # the simulator's fast path (no events: the largest plans have 10^5 actions and more)
    finish = makespans(compile_schedule(schedule, k, m, v), fwd, [b_ + r_ for b_, r_ in zip(bwd, rec, strict=True)], xfer)
    makespan = max(finish, default=0.0)
    busy = m * sum(fwd) + m * sum(bwd) + m * sum(rec)
    bubble = max(0.0, 1.0 - busy / (k * makespan)) if makespan > 0 else 0.0

    # Per rank: memory, and the gradient all-reduce after its last backward.
    rank_stages = [[s for s in range(num_stages) if s % k == r] for r in range(k)]
    mem_rank: list[float] = []
    limit_rank: list[int] = []
    ar_rank: list[float] = []
    for r in range(k):
        own = rank_stages[r]
        mem_rank.append(
            rank_memory_bytes(
                costs,
                [ranges[s] for s in own],
                [rc[s] for s in own],
                training,
                inflight=inflight_microbatches(schedule, k, m, r, v),
            )
        )
        devs = {d for s in own for d in placement[s]}
        limit_rank.append(int(min(cluster.devices[d].memory_bytes for d in devs) * (1 - training.memory_margin)))
        grad = sum(costs.prefix_param[ranges[s][1]] - costs.prefix_param[ranges[s][0]] for s in own)
        grad_bytes = grad * training.gradient_bytes_per_param_byte
        replicas = placement[own[0]]
        link = cluster.intra_node if all(cluster.same_node(replicas[0], d) for d in replicas) else cluster.inter_node
        ar_rank.append(allreduce_ms(grad_bytes, data_parallel, link.bandwidth_bytes_per_s, link.latency_s))
    # the calibrated fixed cost of a step (optimizer, launch: planner/calibrate.py), 0 as profiled
    overhead = profile.step_overhead_ms
    step = max(f + a for f, a in zip(finish, ar_rank, strict=True)) + overhead

    stage_plans = [
        StagePlan(
            index=s,
            start=a,
            stop=e,
            layer_names=[profile.layers[i].name for i in range(a, e)],
            devices=placement[s],
            recompute=rc[s],
            param_bytes=costs.prefix_param[e] - costs.prefix_param[a],
            forward_ms=fwd[s],
            backward_ms=bwd[s] + rec[s],
            memory_bytes=math.ceil(mem_rank[s % k]),
            memory_limit_bytes=limit_rank[s % k],
            send_ms=xfer[s] if s < num_stages - 1 else 0.0,
        )
        for s, (a, e) in enumerate(ranges)
    ]
    return Plan(
        model=profile.model,
        profile_sha256=profile.sha256(),
        num_layers=profile.num_layers,
        schedule=schedule,
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
        ),
        solver=solver or SolverInfo(status="given", gap=0.0),
        cluster=cluster,
        training=training,
        notes=[n for n in (scaling.extrapolation_note(profile.microbatch_sizes, b), _calibration_note(profile)) if n],
        split_points=list(profile.split_points),
    )


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
) -> Plan:
    """Re-run :func:`estimate` for the decisions ``plan`` made (stages, M, schedule, recompute,
    mesh, placement), with ``profile`` and the plan's own cluster and training setup unless given."""
    return estimate(
        profile,
        cluster or plan.cluster,
        training or plan.training,
        [(s.start, s.stop) for s in plan.stages],
        num_microbatches=plan.num_microbatches,
        schedule=plan.schedule,
        recompute=[s.recompute for s in plan.stages],
        data_parallel=plan.data_parallel_degree,
        pipeline_degree=plan.pipeline_degree,
        devices=[s.devices for s in plan.stages],
        solver=solver,
    )


def plan_fits(plan: Plan) -> bool:
    """True when every stage's predicted peak fits its device's usable memory."""
    return all(s.memory_bytes <= s.memory_limit_bytes for s in plan.stages)


def simulate_plan(plan: Plan) -> Simulation:
    """Re-run the simulator for a plan (for timelines and charts); needs nothing but the plan."""
    rec = [s.forward_ms if s.recompute else 0.0 for s in plan.stages]
    return simulate_schedule(
        plan.schedule,
        plan.pipeline_degree,
        plan.num_microbatches,
        [s.forward_ms for s in plan.stages],
        [s.backward_ms - r for s, r in zip(plan.stages, rec, strict=True)],
        virtual_stages=plan.virtual_stages,
        recompute_ms=rec,
        transfer_ms=[s.send_ms for s in plan.stages[:-1]],
    )


def _check_placement(placement: list[list[int]], num_stages: int, k: int, d: int, n: int) -> None:
    if len(placement) != num_stages or any(len(p) != d for p in placement):
        raise InputError(f"devices must list {d} device(s) for each of the {num_stages} stages, got {placement}")
    for s, p in enumerate(placement):
        for dev in p:
            if not 0 <= dev < n:
                raise InputError(f"stage {s} is placed on device {dev} but the cluster has devices 0..{n - 1}")
    used: dict[int, int] = {}
    for s, p in enumerate(placement):
        for dev in p:
            rank = s % k
            if used.setdefault(dev, rank) != rank:
                raise InputError(f"device {dev} is given to two pipeline ranks ({used[dev]} and {rank}): one rank per device")


def _divisors(x: int) -> list[int]:
    return [i for i in range(1, x + 1) if x % i == 0]


def _fmt_ranges(ranges: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{a}:{b}" for a, b in ranges)
