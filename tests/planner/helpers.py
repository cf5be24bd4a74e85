"""Small random profiles and clusters built in code, plus a brute-force oracle."""

from __future__ import annotations

import itertools
import math
import random

from planner.cost import Layout, estimate, plan_fits
from planner.schema import Cluster, LayerProfile, MeasuredOn, Plan, Profile, Schedule, TrainingSetup

MiB = 2**20


def random_profile(
    seed: int,
    layers: int,
    *,
    sizes: tuple[int, ...] = (1, 2, 4),
    split_backward: bool = False,
    unrepeated: bool = False,
) -> Profile:
    """``split_backward``: also measured input and weight gradients (any share of the
    backward, summing to between 0.8 and 1.2 times it) and bytes held between them.
    ``unrepeated``: each layer's forward also has a part a recompute does not repeat (up to
    90 % of it, as ZeRO-3's exposed gather; drawn apart, so the other values stay the seed's)."""
    rng = random.Random(seed)
    skip = random.Random(seed + 7919)
    out = []
    for i in range(layers):
        f = rng.uniform(0.5, 3.0)
        ratio = rng.uniform(1.5, 2.5)
        act = rng.randint(1, 8) * MiB
        extra: dict[str, list[float] | list[int]] = {}
        if split_backward:
            share, total = rng.uniform(0.0, 1.0), rng.uniform(0.8, 1.2)
            extra = {
                "backward_input_ms": [f * ratio * b * share * total for b in sizes],
                "backward_weight_ms": [f * ratio * b * (1 - share) * total for b in sizes],
                "weight_grad_bytes": [int(act * rng.uniform(0.2, 1.3)) * b for b in sizes],
            }
        if unrepeated:
            extra["forward_not_recomputed_ms"] = [f * b * skip.uniform(0.0, 0.9) for b in sizes]
        out.append(
            LayerProfile(
                name=f"l{i}",
                param_bytes=rng.randint(1, 16) * MiB,
                forward_ms=[f * b for b in sizes],
                backward_ms=[f * ratio * b for b in sizes],
                activation_bytes=[act * b for b in sizes],
                output_bytes=[rng.randint(1, 4) * MiB // 4 * b for b in sizes],
                **extra,  # type: ignore[arg-type]
            )
        )
    return Profile(
        model=f"random-{seed}",
        measured_on=MeasuredOn(device="cpu"),
        microbatch_sizes=list(sizes),
        input_bytes=[MiB // 8 * b for b in sizes],
        layers=out,
    )


def cluster(n: int, memory: str = "1GiB", *, speeds: list[float] | None = None) -> Cluster:
    if speeds is None:
        return Cluster.model_validate({"devices": n, "memory": memory, "intra_node": "nvlink4"})
    return Cluster.model_validate(
        {
            "devices": [{"memory_bytes": memory, "speed": s} for s in speeds],
            "intra_node": "nvlink4",
        }
    )


def brute_force(
    profile: Profile,
    cl: Cluster,
    training: TrainingSetup,
    *,
    k: int,
    m: int,
    schedule: Schedule,
    data_parallel: int = 1,
    recompute_free: bool = True,
) -> float:
    """Best fitting step time over every split and every recompute choice (inf if none fits)."""
    n = profile.num_layers
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        ranges = [(bounds[i], bounds[i + 1]) for i in range(k)]
        choices = itertools.product((False, True), repeat=k) if recompute_free else [(False,) * k]
        for rc in choices:
            plan = estimate(
                profile, cl, training,
                Layout(
                    ranges,
                    num_microbatches=m,
                    schedule=schedule,
                    recompute=list(rc),
                    data_parallel=data_parallel,
                ),
            )
            if plan_fits(plan):
                best = min(best, plan.predicted.step_time_ms)
    return best


def assert_valid(plan: Plan, profile: Profile) -> None:
    """Coverage, contiguity and memory."""
    expect = 0
    for s in plan.stages:
        assert s.start == expect and s.stop > s.start
        assert s.layer_names == [profile.layers[i].name for i in range(s.start, s.stop)]
        expect = s.stop
    assert expect == profile.num_layers
    assert plan_fits(plan), [(s.memory_bytes, s.memory_limit_bytes) for s in plan.stages]
    assert plan.pipeline_degree * plan.data_parallel_degree <= plan.cluster.num_devices


def brute_force_all(profile: Profile, cl: Cluster, training: TrainingSetup, *, zeros: tuple[int, ...] = (0,)) -> float:
    """Best fitting step time over EVERY configuration of a homogeneous cluster: each data-parallel
    degree D and pipeline degree K with D·K <= devices, each micro-batch count M, each schedule
    and chunk count v, each split into K·v stages and each recompute choice per stage.

    Every schedule is tried: the one-chunk ones (gpipe, 1f1b, zb-h1, zb-h2, planned), the
    interleaved ones with 2..MAX_VIRTUAL_STAGES chunks and the V ones with two.  Only the
    planner's documented limits of its space apply: at most MAX_VIRTUAL_STAGES chunks per
    device, interleaving only across K >= 2 ranks, and micro-batches at most
    MAX_EXTRAPOLATION times the largest profiled size.  Shapes the executor cannot run are
    refused by the cost model itself (InputError).  ``zeros``: the ZeRO stages tried where D > 1.
    """
    from planner.errors import InputError
    from planner.search.space import MAX_EXTRAPOLATION, MAX_VIRTUAL_STAGES

    n_dev, n, g = cl.num_devices, profile.num_layers, training.global_batch_size
    best = math.inf
    for d in range(1, n_dev + 1):
        if g % d:
            continue
        for k in range(1, n_dev // d + 1):
            for m in range(1, g // d + 1):
                if (g // d) % m or g // (d * m) > MAX_EXTRAPOLATION * profile.microbatch_sizes[-1]:
                    continue
                shapes: list[tuple[Schedule, int]] = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("planned", 1)]
                if k >= 2:
                    shapes += [("interleaved-1f1b", v) for v in range(2, MAX_VIRTUAL_STAGES + 1)]
                    shapes += [("interleaved-zb", v) for v in range(2, MAX_VIRTUAL_STAGES + 1)]
                    shapes += [("zbv", 2), ("dualpipev", 2)]
                for (schedule, v), z in itertools.product(shapes, zeros if d > 1 else (0,)):
                    stages = k * v
                    if stages > n:
                        continue
                    for cuts in itertools.combinations(range(1, n), stages - 1):
                        bounds = (0, *cuts, n)
                        ranges = [(bounds[i], bounds[i + 1]) for i in range(stages)]
                        for rc in itertools.product((False, True), repeat=stages):
                            try:
                                plan = estimate(
                                    profile, cl, training,
                                    Layout(
                                        ranges,
                                        num_microbatches=m,
                                        schedule=schedule,
                                        recompute=list(rc),
                                        data_parallel=d,
                                        pipeline_degree=k,
                                        zero_stage=z,
                                    ),
                                )
                            except InputError:
                                break  # this shape (K, M, schedule, v) is not runnable
                            if plan_fits(plan):
                                best = min(best, plan.predicted.step_time_ms)
                        else:
                            continue
                        break
    return best


def runnable_m(schedule: Schedule, k: int, m: int, v: int) -> int:
    """The smallest micro-batch count >= ``m`` the schedule runs with on K ranks of v chunks
    (a multiple of K when it needs one)."""
    from planner.schedules import ScheduleError, check_schedule_shape

    for cand in [*range(m, 2 * k * m + 2 * k + 1)]:
        try:
            check_schedule_shape(schedule, k, cand, v)
        except ScheduleError:
            continue
        return cand
    raise AssertionError(f"no micro-batch count runs {schedule} with K={k} v={v}")
