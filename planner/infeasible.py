"""Why no plan fits, with numbers: the layer too big for any device, the memory per device
and the number of devices that would fit.

Feasibility here is decided by :func:`planner.search.feasibility.config_fits`, the very
split searches :func:`planner.solver.solve` runs (the farthest-reach greedy with the exact
memory model, the enumerated small chains, the interleaved split), so a suggested fix is one
``solve`` accepts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from planner.cost import LayerCosts, layer_costs, memory_lower_bound, rank_memory_terms
from planner.cost.memory import usable_bytes
from planner.errors import InfeasibleError, InputError
from planner.schema import Cluster, Device, PlanOptions, Profile, TrainingSetup
from planner.search.feasibility import config_fits
from planner.search.model import StageModel
from planner.search.space import Config, enumerate_configs
from planner.units import format_bytes, parse_bytes

#: stop scanning device counts after this long (seconds)
DEVICE_SCAN_BUDGET_S = 3.0
#: the whole diagnosis's wall-clock budget (seconds): past it, what is not yet known is said to
#: be unknown (a 16k-device problem's feasibility tests take seconds each)
DIAGNOSIS_BUDGET_S = 10.0


def any_fits(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions,
    *,
    world: int | None = None,
    deadline: float = math.inf,
) -> bool | None:
    """Some configuration fits (only those using exactly ``world`` devices, if given); ``None``
    when the clock passes ``deadline`` (``time.perf_counter``) before it knows (falsy: a fix is
    suggested only where it is shown to fit)."""
    try:
        configs = enumerate_configs(profile, cluster, training, options)
    except InputError:
        return False
    cache: dict[int, LayerCosts] = {}
    for cfg in _memory_order(configs):
        if world is not None and cfg.data_parallel * cfg.pipeline_degree != world:
            continue
        if time.perf_counter() > deadline:
            return None
        b = cfg.microbatch_size(training.global_batch_size)
        if b not in cache:
            cache[b] = layer_costs(profile, b)
        if config_fits(profile, cluster, training, options, cfg, cache[b]):
            return True
    return False


def _memory_order(configs: Sequence[Config]) -> list[Config]:
    """Most promising for memory first: 1F1B, many stages, small micro-batches."""
    rank = {
        "1f1b": 0, "zb-h1": 1, "planned": 2, "interleaved-1f1b": 3, "interleaved-zb": 4, "zbv": 5,
        "dualpipev": 6, "zb-h2": 7, "gpipe": 8,
    }
    return sorted(configs, key=lambda c: (rank[c.schedule], -c.pipeline_degree, -c.num_microbatches * c.data_parallel, c))


def with_memory(cluster: Cluster, memory_bytes: int) -> Cluster:
    # (each distinct device copied once, its CUDA context and fragmentation kept)
    copies: dict[int, Device] = {}
    for d in cluster.devices:
        if id(d) not in copies:
            copies[id(d)] = d.model_copy(update={"memory_bytes": memory_bytes})
    devices = [copies[id(d)] for d in cluster.devices]
    return Cluster(
        devices=devices,
        devices_per_node=cluster.devices_per_node,
        intra_node=cluster.intra_node,
        inter_node=cluster.inter_node,
    )


def with_count(cluster: Cluster, count: int) -> Cluster:
    """``count`` devices like the cluster's largest one."""
    template = max(cluster.devices, key=lambda d: (d.memory_bytes, d.speed))
    return Cluster(
        devices=[template] * count,
        devices_per_node=min(cluster.devices_per_node, count),
        intra_node=cluster.intra_node,
        inter_node=cluster.inter_node,
    )


def min_memory_bytes(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions, *, deadline: float = math.inf
) -> tuple[int, bool] | None:
    """Smallest memory per device (same for all) with which some plan fits these devices, and
    whether it is exact (False: the clock passed ``deadline`` during the bisection, so it is a
    memory that fits, not the least); ``None`` when no fitting memory was found before it."""
    lo = 0
    hi = max(1, max(d.memory_bytes for d in cluster.devices))
    while True:
        fits = any_fits(profile, with_memory(cluster, hi), training, options, deadline=deadline)
        if fits is None:
            return None
        if fits:
            break
        lo, hi = hi, hi * 2
        if hi > 2**62:
            raise InputError("no memory size makes this model fit: check the profile's byte counts")
    # feasibility is monotone in memory: bisect to 1 MiB, then report the upper end
    while hi - lo > 2**20:
        mid = (lo + hi) // 2
        fits = any_fits(profile, with_memory(cluster, mid), training, options, deadline=deadline)
        if fits is None:
            return hi, False
        if fits:
            hi = mid
        else:
            lo = mid
    return hi, True


def min_devices(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions, *, deadline: float = math.inf
) -> int | None:
    """Fewest devices like the cluster's largest that fit, scanning upward (None if none found)."""
    start = time.perf_counter()
    n0 = cluster.num_devices
    limit = max(profile.num_layers, n0) * 2
    n = n0 + 1
    while n <= limit and time.perf_counter() - start < DEVICE_SCAN_BUDGET_S:
        if any_fits(profile, with_count(cluster, n), training, options, world=n, deadline=deadline):
            return n
        n += 1
    return None


def largest_layer(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions
) -> tuple[int, float] | None:
    """A layer that alone exceeds every device in every configuration: (index, its least bytes)."""
    try:
        configs = enumerate_configs(profile, with_count(cluster, max(cluster.num_devices, 1)), training, options)
    except InputError:
        return None
    limit = max(usable_bytes(d, training) for d in cluster.devices)
    seen: dict[tuple[int, int], None] = {}
    for cfg in configs:
        sm_inflight = min(min(c) for c in StageModel.counts_of(cfg, profile.num_layers))
        seen.setdefault((cfg.microbatch_size(training.global_batch_size), sm_inflight), None)
    rc_opts = [options.recompute] if isinstance(options.recompute, bool) else [False, True]
    need = [math.inf] * profile.num_layers
    for b, inflight in seen:
        costs = layer_costs(profile, b)
        for i in range(profile.num_layers):
            for rc in rc_opts:
                terms = rank_memory_terms(costs, [(i, i + 1)], training)
                need[i] = min(need[i], memory_lower_bound(terms, [rc], [inflight]))
    worst = max(range(profile.num_layers), key=lambda i: (need[i], -i))
    if need[worst] > limit:
        return worst, need[worst]
    return None


def memory_flag(nbytes: int) -> str:
    """A ``--memory`` value at least ``nbytes``, rounded up to 0.1 GiB (or 1 MiB when small)."""
    if nbytes < 2**30:
        text = f"{math.ceil(nbytes / 2**20)}MiB"
    else:
        tenths = math.ceil(nbytes * 10 / 2**30)
        text = f"{tenths / 10:.1f}GiB"
        while parse_bytes(text) < nbytes:
            tenths += 1
            text = f"{tenths / 10:.1f}GiB"
    return text


def diagnose(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions, *, group: int = 1
) -> InfeasibleError:
    """The error to raise when no plan fits; its message states the numbers and the fixes.

    ``group``: each device of ``cluster`` stands for ``group`` GPUs (one tensor x context
    parallel group of a fixed mesh family, :func:`planner.mesh.mesh_problem`): the message and
    ``details`` count GPUs, so ``--devices`` takes the number as it is."""
    deadline = time.perf_counter() + DIAGNOSIS_BUDGET_S
    groups = cluster.num_devices
    n = groups * group
    usable = max(usable_bytes(d, training) for d in cluster.devices)
    memory = max(d.memory_bytes for d in cluster.devices)
    layer = largest_layer(profile, cluster, training, options)
    found = min_memory_bytes(profile, cluster, training, options, deadline=deadline)
    need_mem = found[0] if found is not None else None
    found_groups = None if layer is not None else min_devices(profile, cluster, training, options, deadline=deadline)
    need_dev = None if found_groups is None else found_groups * group
    lines = [
        f"no plan fits the memory of these {n} device(s)"
        + (f" ({groups} groups of {group})" if group > 1 else "")
        + f" ({format_bytes(memory)} each, {format_bytes(usable)} usable after the "
        + (f"{training.memory_margin:.0%} margin)." if usable >= int(memory * (1 - training.memory_margin))
           else "CUDA context and the allocator's fragmentation, stricter here than the "
           f"{training.memory_margin:.0%} margin).")
    ]
    if layer is not None:
        i, nbytes = layer
        lines.append(
            f"Layer {profile.layers[i].name!r} (index {i}) alone needs at least {format_bytes(nbytes)} "
            "on one device (parameters, gradients, optimizer state, and one micro-batch of activations or, "
            "when larger, the optimizer step's temporaries), "
            "so no number of these devices helps."
        )
    if found is None:
        lines.append(
            f"No memory per device that fits on these {n} device(s) was found within the diagnosis's "
            f"{DIAGNOSIS_BUDGET_S:g} s (a large problem)."
        )
    elif found[1]:
        lines.append(
            f"The smallest memory per device that fits on these {n} device(s) is {format_bytes(found[0])} "
            f"(with the margin): use devices with that much memory (--memory {memory_flag(found[0])})."
        )
    else:
        lines.append(
            f"A memory per device that fits on these {n} device(s) is {format_bytes(found[0])} (with the margin; "
            f"the least was not found within the diagnosis's {DIAGNOSIS_BUDGET_S:g} s): use devices with that "
            f"much memory (--memory {memory_flag(found[0])})."
        )
    if need_dev is not None:
        lines.append(f"With {format_bytes(memory)} devices, {need_dev} of them would fit (--devices {need_dev}).")
    elif layer is None and time.perf_counter() <= deadline:
        lines.append("No number of these devices up to the search limit fits.")
    relaxed = _relaxations(profile, cluster, training, options, deadline=deadline)
    if relaxed:
        lines.append("It would also fit if you " + " or ".join(relaxed) + ".")
    fused = " or fused optimizer kernels (--fused-optimizer: no step temporaries)" if training.optimizer_step_factor else ""
    lines.append(
        f"Other fixes: a smaller global batch or a lighter optimizer (--optimizer sgd){fused} shrink the "
        "memory per device."
    )
    details = {
        "layer": profile.layers[layer[0]].name if layer else None,
        "layer_index": layer[0] if layer else None,
        "layer_bytes": math.ceil(layer[1]) if layer else None,
        "min_memory_bytes": need_mem,
        "min_devices": need_dev,
        "devices": n,
        "usable_bytes": usable,
    }
    return InfeasibleError(" ".join(lines), details)


def _relaxations(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions, *, deadline: float = math.inf
) -> list[str]:
    """Options the user fixed whose release would make a plan fit."""
    out = []
    trials = []
    if options.recompute is False:
        trials.append(("allow recompute (drop --no-recompute)", options.model_copy(update={"recompute": None})))
    if options.schedule is not None:
        trials.append(("let the solver choose the schedule (drop --schedule)", options.model_copy(update={"schedule": None, "virtual_stages": None})))
    elif options.schedules is not None:
        trials.append(("let the solver choose among every schedule (drop schedules)", options.model_copy(update={"schedules": None})))
    if options.stages is not None:
        trials.append(("let the solver choose the stages (drop --stages)", options.model_copy(update={"stages": None})))
    if options.num_microbatches is not None:
        trials.append(("let the solver choose M (drop --microbatches)", options.model_copy(update={"num_microbatches": None})))
    if options.data_parallel is not None:
        trials.append(("let the solver choose D (drop --data-parallel)", options.model_copy(update={"data_parallel": None})))
    for text, opts in trials:
        if any_fits(profile, cluster, training, opts, deadline=deadline):
            out.append(text)
    return out
