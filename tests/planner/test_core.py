"""Building blocks: the fast step equals estimate's, bounds are bounds, baselines split right."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.baselines import block_partition, minmax_split, uniform_split
from planner.bounds.split import split_lower_bound
from planner.cost import Layout, estimate
from planner.schedules import placement_of, stage_rank
from planner.schema import TrainingSetup
from planner.search.model import Split, StageModel, quick_step
from planner.search.space import Config, make_groups
from planner.simulator import build_orders, compile_schedule, makespans, simulate
from tests.planner.helpers import brute_force, cluster, random_profile

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _random_split(rng: random.Random, n_layers: int, n: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, n_layers), n - 1))
    bounds = [0, *cuts, n_layers]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from([
        (1, 2, 4, "1f1b", 1), (2, 2, 2, "gpipe", 1), (1, 2, 4, "interleaved-1f1b", 2), (1, 3, 6, "1f1b", 1),
        (1, 3, 6, "zb-h1", 1), (1, 3, 5, "zb-h2", 1), (1, 2, 4, "zbv", 2), (1, 2, 4, "dualpipev", 2),
        (1, 2, 4, "interleaved-zb", 2), (1, 3, 6, "planned", 1), (2, 2, 3, "planned", 1),
    ]),
    speeds=st.booleans(),
)
def test_quick_step_equals_estimate_and_bound_is_below(seed: int, shape: tuple, speeds: bool) -> None:  # type: ignore[type-arg]
    d, k, m, sched, v = shape
    rng = random.Random(seed)
    profile = random_profile(seed, 10, split_backward=seed % 2 == 1)
    n_dev = d * k
    cl = cluster(n_dev, "1GiB", speeds=[rng.choice([0.5, 1.0]) for _ in range(n_dev)] if speeds else None)
    training = TrainingSetup(global_batch_size=d * m * 2)
    cfg = Config(d, k, m, sched, v)
    groups = make_groups(cl, training, d, k)
    from planner.cost import layer_costs

    sm = StageModel(layer_costs(profile, 2), cfg, training)
    ranges = _random_split(rng, 10, k * v)
    rc = tuple(rng.random() < 0.3 for _ in ranges)
    owner = [stage_rank(placement_of(sched), s, k, v) for s in range(k * v)]
    split = Split(tuple(ranges), rc, tuple(owner))
    plan = estimate(
        profile, cl, training,
        Layout(
            ranges,
            num_microbatches=m,
            schedule=sched,
            recompute=list(rc),
            data_parallel=d,
            pipeline_degree=k,
            devices=[list(groups[owner[s]].devices) for s in range(k * v)],
        ),
    )
    assert quick_step(sm, cl, groups, split) == pytest.approx(plan.predicted.step_time_ms, rel=1e-12)
    assert split_lower_bound(sm, cl, groups, split) <= plan.predicted.step_time_ms * (1 + 1e-12)


@pytest.mark.parametrize(
    "shape",
    [
        ("gpipe", 3, 4, 1), ("1f1b", 4, 4, 1), ("1f1b", 3, 7, 1), ("interleaved-1f1b", 2, 4, 2),
        ("interleaved-1f1b", 3, 6, 3), ("zb-h1", 4, 6, 1), ("zb-h2", 3, 7, 1), ("zbv", 3, 4, 2),
        ("dualpipev", 3, 7, 2), ("interleaved-zb", 3, 6, 2), ("interleaved-zb", 2, 3, 3),
    ],
)
def test_compiled_program_runs_the_simulators_orders(shape: tuple[str, int, int, int]) -> None:
    sched, k, m, v = shape
    orders = build_orders(sched, k, m, v)  # type: ignore[arg-type]
    rng = random.Random(k * m)
    n = k * v
    fwd = [rng.uniform(0.5, 2) for _ in range(n)]
    bwd = [rng.uniform(1, 4) for _ in range(n)]
    inp = [b * rng.uniform(0.3, 0.7) for b in bwd]
    wgt = [b - i for b, i in zip(bwd, inp, strict=True)]
    xfer = [rng.uniform(0, 0.5) for _ in range(n - 1)]
    sim = simulate(orders, fwd, bwd, transfer_ms=xfer, input_ms=inp, weight_ms=wgt)
    finish = makespans(compile_schedule(sched, k, m, v), fwd, bwd, xfer, binput=inp, bweight=wgt)  # type: ignore[arg-type]
    assert finish == pytest.approx([max(e.end_ms for e in t) for t in sim.timelines], rel=1e-12)


@SETTINGS
@given(seed=st.integers(0, 10_000), rank=st.integers(0, 2), rc=st.booleans())
def test_relaxed_memory_is_a_lower_bound(seed: int, rank: int, rc: bool) -> None:
    from planner.cost import layer_costs

    profile = random_profile(seed, 9)
    sm = StageModel(layer_costs(profile, 2), Config(1, 3, 4, "1f1b"), TrainingSetup())
    for a, b in itertools.combinations(range(10), 2):
        assert sm.memory_relaxed(a, b, rc, rank) <= sm.memory(a, b, rc, rank) + 1e-6
        if b < 9:
            assert sm.memory_relaxed(a, b, rc, rank) <= sm.memory_relaxed(a, b + 1, rc, rank) + 1e-6
        if a > 0:
            assert sm.memory_relaxed(a, b, rc, rank) <= sm.memory_relaxed(a - 1, b, rc, rank) + 1e-6


@pytest.mark.parametrize("seed", range(7))
def test_cpsat_bound_is_below_the_brute_force_optimum(seed: int) -> None:
    from planner.bounds.cpsat import config_bound
    from planner.cost import layer_costs

    profile = random_profile(seed, 9, split_backward=seed > 3)
    cl = cluster(3, ["60MiB", "90MiB", "1GiB"][seed % 3])
    training = TrainingSetup(global_batch_size=8, optimizer="sgd")
    cfg = Config(1, 3, 4, ["1f1b", "gpipe", "zb-h1", "planned", "zb-h2"][seed % 5])
    oracle = brute_force(profile, cl, training, k=3, m=4, schedule=cfg.schedule)
    sm = StageModel(layer_costs(profile, 2), cfg, training)
    bound, ranges, _, _, _ = config_bound(sm, make_groups(cl, training, 1, 3), hint=None, time_limit_s=5, options_recompute=None)
    if math.isinf(oracle):
        assert bound is None or ranges is not None  # infeasible proofs may only be claimed when true
    else:
        assert bound is not None and bound <= oracle * (1 + 1e-9)
        assert bound >= 0.5 * oracle  # and it is not vacuous


@given(weights=st.lists(st.floats(0, 100), min_size=2, max_size=9), parts=st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_baseline_splitters(weights: list[float], parts: int) -> None:
    parts = min(parts, len(weights))
    for split in (uniform_split(len(weights), parts), minmax_split(weights, parts), block_partition(weights, parts)):
        assert len(split) == parts and split[0][0] == 0 and split[-1][1] == len(weights)
        assert all(a < b for a, b in split) and all(split[i][1] == split[i + 1][0] for i in range(parts - 1))
    best = min(
        max(sum(weights[a:b]) for a, b in zip((0, *c), (*c, len(weights)), strict=True))
        for c in itertools.combinations(range(1, len(weights)), parts - 1)
    )
    got = max(sum(weights[a:b]) for a, b in minmax_split(weights, parts))
    assert got == pytest.approx(best, rel=1e-6, abs=1e-6)
