"""Small random profiles and clusters built in code, plus a brute-force oracle."""

from __future__ import annotations

import itertools
import math
import random

from planner.costmodel import estimate, plan_fits
from planner.schema import Cluster, LayerProfile, MeasuredOn, Plan, Profile, Schedule, TrainingSetup

MiB = 2**20


def random_profile(seed: int, layers: int, *, sizes: tuple[int, ...] = (1, 2, 4)) -> Profile:
    rng = random.Random(seed)
    out = []
    for i in range(layers):
        f = rng.uniform(0.5, 3.0)
        ratio = rng.uniform(1.5, 2.5)
        act = rng.randint(1, 8) * MiB
        out.append(
            LayerProfile(
                name=f"l{i}",
                param_bytes=rng.randint(1, 16) * MiB,
                forward_ms=[f * b for b in sizes],
                backward_ms=[f * ratio * b for b in sizes],
                activation_bytes=[act * b for b in sizes],
                output_bytes=[rng.randint(1, 4) * MiB // 4 * b for b in sizes],
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
                profile, cl, training, ranges, num_microbatches=m, schedule=schedule,
                recompute=list(rc), data_parallel=data_parallel,
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
