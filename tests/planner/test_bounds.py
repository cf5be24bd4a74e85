"""The configuration bounds that prune the search and set reported gaps are valid.

Each bound is compared against the exhaustive optimum (every split, every recompute choice,
every device order) of small instances, for every schedule including interleaved-1f1b.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.bounds.chunk_memory import chunk_memory_bound
from planner.bounds.memory import memory_work_bound, static_memory_bound
from planner.bounds.work import cheap_bound
from planner.cost import Layout, estimate, plan_fits
from planner.schedules import placement_of, stage_rank
from planner.schema import Cluster, PlanOptions, Profile, TrainingSetup
from planner.search.space import Config, make_groups
from planner.search.state import SearchState
from tests.planner.helpers import brute_force, cluster, random_profile, runnable_m

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def exhaustive(
    profile: Profile, cl: Cluster, training: TrainingSetup, cfg: Config, *, recompute: bool | None = None
) -> float:
    """Best fitting step time of ``cfg`` over every split, recompute choice and device order."""
    return exhaustive_both(profile, cl, training, cfg, recompute=recompute)[0]


def exhaustive_both(
    profile: Profile, cl: Cluster, training: TrainingSetup, cfg: Config, *, recompute: bool | None = None
) -> tuple[float, float]:
    """(best fitting step time, least busiest-rank work ``M · max_r work_r`` over fitting plans).

    The second is what the memory bounds relax (they leave out fill, drain and transfers),
    so they come close to it and a wrong bound is caught."""
    n, k, v = profile.num_layers, cfg.pipeline_degree, cfg.virtual_stages
    stages = k * v
    groups = make_groups(cl, training, cfg.data_parallel, k)
    orders = sorted(set(itertools.permutations(range(k)))) if not cl.homogeneous else [tuple(range(k))]
    rc_choices = [(recompute,) * stages] if recompute is not None else list(itertools.product((False, True), repeat=stages))
    best = least_busy = math.inf
    owner = [stage_rank(placement_of(cfg.schedule), s, k, v) for s in range(stages)]
    for order in orders:
        devices = [list(groups[order[owner[s]]].devices) for s in range(stages)]
        for cuts in itertools.combinations(range(1, n), stages - 1):
            bounds = (0, *cuts, n)
            ranges = [(bounds[i], bounds[i + 1]) for i in range(stages)]
            for rc in rc_choices:
                plan = estimate(
                    profile, cl, training,
                    Layout(
                        ranges,
                        num_microbatches=cfg.num_microbatches,
                        schedule=cfg.schedule,
                        recompute=list(rc),
                        data_parallel=cfg.data_parallel,
                        pipeline_degree=k,
                        devices=devices,
                    ),
                )
                if plan_fits(plan):
                    best = min(best, plan.predicted.step_time_ms)
                    busy = [0.0] * k
                    for st_ in plan.stages:
                        busy[owner[st_.index]] += st_.forward_ms + st_.backward_ms
                    least_busy = min(least_busy, cfg.num_microbatches * max(busy))
    return best, least_busy


SHAPES = [
    (2, 1, "gpipe"), (3, 1, "gpipe"), (2, 1, "1f1b"), (3, 1, "1f1b"),
    (2, 2, "interleaved-1f1b"), (3, 2, "interleaved-1f1b"),
    (2, 1, "zb-h1"), (3, 1, "zb-h1"), (2, 1, "zb-h2"), (3, 1, "zb-h2"), (2, 1, "planned"), (3, 1, "planned"),
    (2, 2, "zbv"), (3, 2, "zbv"), (2, 2, "dualpipev"), (2, 2, "interleaved-zb"), (3, 2, "interleaved-zb"),
]


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from(SHAPES),
    m=st.sampled_from([1, 2, 4, 8]),
    memory=st.sampled_from(["48MiB", "96MiB", "256MiB", "1GiB"]),
    slow=st.booleans(),
    recompute=st.sampled_from([None, False, True]),
    d=st.sampled_from([1, 1, 2]),
    overlap=st.sampled_from([0.0, 0.0, 0.6]),
)
def test_cheap_bound_never_exceeds_the_exhaustive_optimum(
    seed: int, shape: tuple[int, int, str], m: int, memory: str, slow: bool, recompute: bool | None, d: int,
    overlap: float,
) -> None:
    """``d = 2`` runs two data-parallel replicas, so every rank all-reduces its gradients
    (what :func:`planner.bounds.work.rank_allreduce_bound` counts), ``overlap`` of it hidden."""
    k, v, schedule = shape
    m = runnable_m(schedule, k, m, v)  # type: ignore[arg-type]
    layers = 6 if k * v < 6 else 7
    profile = random_profile(seed, layers, split_backward=seed % 2 == 1, unrepeated=seed % 3 == 0)
    speeds = [1.0] + [0.5] * (k * d - 1) if slow else None
    cl = cluster(k * d, memory, speeds=speeds)
    training = TrainingSetup(global_batch_size=8 * m * d, optimizer="sgd", gradient_overlap=overlap)
    cfg = Config(d, k, m, schedule, v)  # type: ignore[arg-type]
    search = SearchState(profile, cl, training, PlanOptions(recompute=recompute), deadline=math.inf)
    groups = make_groups(cl, training, d, k)
    oracle = exhaustive(profile, cl, training, cfg, recompute=recompute)
    for name, bound in (
        ("cheap", cheap_bound(search, cfg, groups)),
        ("static", static_memory_bound(search, cfg, groups)),
        ("chunk", chunk_memory_bound(search, cfg, groups)),
    ):
        if math.isinf(bound):
            assert math.isinf(oracle), f"the {name} bound claims nothing fits, but a plan fits"
        elif not math.isinf(oracle):
            assert bound <= oracle * (1 + 1e-9), (name, bound, oracle)


def activation_heavy_profile(seed: int, layers: int, *, unrepeated: bool = False) -> Profile:
    """Random layers whose activations dwarf their parameters, so memory decides recompute;
    ``unrepeated``: a part of each forward that a recompute does not repeat (ZeRO-3's gather)."""
    import random

    from planner.schema import LayerProfile, MeasuredOn
    from tests.planner.helpers import MiB

    rng = random.Random(seed)
    skip = random.Random(seed + 7919)
    sizes = [1, 2, 4]
    out = []
    for i in range(layers):
        f = rng.uniform(0.5, 3.0)
        act = rng.randint(4, 32) * MiB
        out.append(
            LayerProfile(
                name=f"l{i}", param_bytes=rng.randint(1, 8) * MiB // 8, forward_ms=[f * b for b in sizes],
                backward_ms=[f * rng.uniform(1.5, 2.5) * b for b in sizes], activation_bytes=[act * b for b in sizes],
                output_bytes=[MiB // 4 * b for b in sizes],
                forward_not_recomputed_ms=[f * b * skip.uniform(0.0, 0.9) for b in sizes] if unrepeated else None,
            )
        )
    return Profile(model=f"act-{seed}", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=sizes,
                   input_bytes=[MiB // 8 * b for b in sizes], layers=out)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from(SHAPES),
    m=st.sampled_from([2, 4, 8]),
    fraction=st.floats(0.05, 1.2),
    recompute=st.sampled_from([None, None, False]),
)
def test_memory_bounds_never_exceed_the_optimum_when_memory_binds(
    seed: int, shape: tuple[int, int, str], m: int, fraction: float, recompute: bool | None
) -> None:
    """Memory between 5 % and 120 % of what keeping every activation would take."""
    k, v, schedule = shape
    m = runnable_m(schedule, k, m, v)  # type: ignore[arg-type]
    profile = activation_heavy_profile(seed, 6 if k * v < 6 else 7, unrepeated=seed % 3 == 0)
    training = TrainingSetup(global_batch_size=4 * m, optimizer="sgd")
    acts = sum(layer.activation_bytes[-1] for layer in profile.layers)  # at micro-batch size 4
    need = acts * min(m, k * v + k) / k
    cl = cluster(k, f"{max(1, int(need * fraction / 0.9))}B")
    cfg = Config(1, k, m, schedule, v)  # type: ignore[arg-type]
    search = SearchState(profile, cl, training, PlanOptions(recompute=recompute), deadline=math.inf)
    groups = make_groups(cl, training, 1, k)
    oracle, busiest = exhaustive_both(profile, cl, training, cfg, recompute=recompute)
    for name, bound, target in (
        ("memory", memory_work_bound(search, cfg, groups), busiest),
        ("static", static_memory_bound(search, cfg, groups), busiest),
        ("chunk", chunk_memory_bound(search, cfg, groups), busiest),
        ("cheap", cheap_bound(search, cfg, groups), oracle),
    ):
        if math.isinf(bound):
            assert math.isinf(oracle), f"the {name} bound claims nothing fits, but a plan fits"
        elif not math.isinf(oracle):
            assert bound <= target * (1 + 1e-9), (name, bound, target)


def _activation_heavy_case(memory: str, *, recompute: bool | None = None) -> tuple[SearchState, Config, list]:  # type: ignore[type-arg]
    """8 equal layers whose activations, not parameters, decide what fits."""
    from planner.schema import LayerProfile, MeasuredOn
    from tests.planner.helpers import MiB

    sizes = [1, 8]
    layers = [
        LayerProfile(name=f"l{i}", param_bytes=MiB, forward_ms=[1.0 * b for b in sizes],
                     backward_ms=[2.0 * b for b in sizes], activation_bytes=[32 * MiB * b for b in sizes],
                     output_bytes=[MiB * b for b in sizes])
        for i in range(8)
    ]
    profile = Profile(model="act-heavy", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=sizes, layers=layers)
    cl = cluster(2, memory)
    training = TrainingSetup(global_batch_size=32, optimizer="sgd")
    cfg = Config(1, 2, 4, "1f1b")
    search = SearchState(profile, cl, training, PlanOptions(recompute=recompute), deadline=math.inf)
    return search, cfg, make_groups(cl, training, 1, 2)


def test_memory_bound_counts_forced_recompute_and_only_then() -> None:
    """Ample memory: the bound is the plain M·W/sum(speed); tight memory: strictly above it,
    and still below the exhaustive optimum."""
    search, cfg, groups = _activation_heavy_case("64GiB")
    plain = cfg.num_microbatches * 8 * 3.0 * 8 / 2  # M x (8 layers x 3 ms x b=8) / 2 devices
    assert math.isclose(memory_work_bound(search, cfg, groups), plain, rel_tol=1e-9)
    assert math.isclose(static_memory_bound(search, cfg, groups), plain, rel_tol=1e-6)
    tight, cfg_t, groups_t = _activation_heavy_case("1200MiB")
    bound = memory_work_bound(tight, cfg_t, groups_t)
    assert bound > plain * 1.01
    oracle = exhaustive(tight.profile, tight.cluster, tight.training, cfg_t)
    assert not math.isinf(oracle)
    assert bound <= oracle
    assert plain * 1.01 < static_memory_bound(tight, cfg_t, groups_t) <= oracle


def test_memory_bound_proves_infeasible_without_recompute() -> None:
    search, cfg, groups = _activation_heavy_case("1200MiB", recompute=False)
    assert math.isinf(memory_work_bound(search, cfg, groups))
    assert math.isinf(exhaustive(search.profile, search.cluster, search.training, cfg, recompute=False))
    # with recompute allowed the same memory fits, and the bound is finite and below the optimum
    free, _, _ = _activation_heavy_case("1200MiB")
    oracle = exhaustive(free.profile, free.cluster, free.training, cfg)
    assert not math.isinf(oracle)
    assert memory_work_bound(free, cfg, groups) <= oracle


# --------------------------------------------------------------------------- 1F1B fill and drain


def _uniform_profile(layers: int, *, f: float = 1.0, b: float = 2.0) -> Profile:
    """Equal layers with no activations passed on (no transfer bytes), so a 1F1B pipeline
    of equal stages has the textbook makespan (M + K - 1)·(f + b) up to link latency."""
    from planner.schema import LayerProfile, MeasuredOn
    from tests.planner.helpers import MiB

    sizes = [1, 2]
    return Profile(
        model="uniform", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=sizes, input_bytes=[0, 0],
        layers=[
            LayerProfile(name=f"l{i}", param_bytes=MiB, forward_ms=[f * s for s in sizes],
                         backward_ms=[b * s for s in sizes], activation_bytes=[MiB * s for s in sizes],
                         output_bytes=[0, 0])
            for i in range(layers)
        ],
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 5),
    extra=st.integers(0, 6),
    d=st.sampled_from([1, 2]),
    slow=st.booleans(),
    rc_share=st.sampled_from([0.0, 0.3, 1.0]),
    overlap=st.sampled_from([0.0, 0.5]),
)
def test_split_bound_with_fill_and_drain_is_below_the_simulated_step(
    seed: int, k: int, extra: int, d: int, slow: bool, rc_share: float, overlap: float
) -> None:
    """Random 1F1B splits from M = K (where the two waits overlap) upwards, any speeds,
    recompute and data parallelism: the split bound never exceeds the simulated step."""
    import random

    from planner.bounds.split import split_lower_bound
    from planner.cost import layer_costs
    from planner.search.model import Split, StageModel, quick_step

    rng = random.Random(seed)
    m = k + extra
    layers = k + rng.randint(0, 6)
    profile = random_profile(seed, layers, unrepeated=seed % 3 == 0)
    n_dev = d * k
    cl = cluster(n_dev, "64GiB", speeds=[rng.choice([0.5, 1.0]) for _ in range(n_dev)] if slow else None)
    training = TrainingSetup(global_batch_size=d * m * 2, optimizer="sgd", gradient_overlap=overlap)
    cfg = Config(d, k, m, "1f1b")
    groups = make_groups(cl, training, d, k)
    sm = StageModel(layer_costs(profile, 2), cfg, training)
    cuts = sorted(rng.sample(range(1, layers), k - 1))
    bounds = [0, *cuts, layers]
    ranges = tuple((bounds[i], bounds[i + 1]) for i in range(k))
    split = Split(ranges, tuple(rng.random() < rc_share for _ in ranges), tuple(range(k)))
    step = quick_step(sm, cl, groups, split)
    plan = estimate(
        profile, cl, training,
        Layout(
            list(ranges),
            num_microbatches=m,
            schedule="1f1b",
            recompute=list(split.recompute),
            data_parallel=d,
            pipeline_degree=k,
            devices=[list(g.devices) for g in groups],
        ),
    )
    assert math.isclose(step, plan.predicted.step_time_ms, rel_tol=1e-9)
    assert split_lower_bound(sm, cl, groups, split) <= step * (1 + 1e-12)


@settings(max_examples=20, deadline=None)
@given(k=st.integers(2, 6), extra=st.integers(1, 12))
def test_split_bound_is_tight_when_the_first_stage_is_the_bottleneck(k: int, extra: int) -> None:
    """Stage 0 holds two equal layers (f = 2, b = 4 per micro-batch), the others one: rank 0
    idles ``down - (K-1)·f = K - 1`` ms waiting for its first backward and never again, so the
    simulated step is ``6·M + K - 1`` (up to link latency).  The bound must reach it; without
    the wait for the first backward (only the last-backward wait, which is 0 here) every
    rank's bound stays at most ``6·M``."""
    from planner.bounds.split import split_lower_bound
    from planner.cost import layer_costs
    from planner.search.model import Split, StageModel, quick_step

    m = k + extra  # M >= K + 1, so both waits count on rank 0
    profile = _uniform_profile(k + 1)
    cl = cluster(k, "64GiB")
    training = TrainingSetup(global_batch_size=m, optimizer="sgd")
    cfg = Config(1, k, m, "1f1b")
    groups = make_groups(cl, training, 1, k)
    sm = StageModel(layer_costs(profile, 1), cfg, training)
    ranges = ((0, 2), *((s + 1, s + 2) for s in range(1, k)))
    split = Split(ranges, (False,) * k, tuple(range(k)))
    step = quick_step(sm, cl, groups, split)
    assert step == pytest.approx(6 * m + k - 1, abs=0.05 * k)
    bound = split_lower_bound(sm, cl, groups, split)
    assert bound <= step * (1 + 1e-12)
    assert bound >= 6 * m + k - 1 - 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 5),
    extra=st.integers(0, 5),
    schedule=st.sampled_from(["1f1b", "gpipe", "zb-h1", "zb-h2", "planned"]),
    rc=st.booleans(),
    speed=st.sampled_from([0.5, 1.0]),
    transfers=st.sampled_from([0.0, 0.3, 5.0]),
)
def test_relaxed_stage_test_is_monotone(
    seed: int, k: int, extra: int, schedule: str, rc: bool, speed: float, transfers: float
) -> None:
    """The relaxed bound's farthest-reach greedy is exact only if each stage's time test
    ``M·work + idle`` grows with the stage's end; the waits must never break that."""
    from planner.bounds.relaxed import idle_bound
    from planner.cost import layer_costs
    from planner.search.model import StageModel

    m = k + extra
    layers = 9
    profile = random_profile(seed, layers, split_backward=seed % 2 == 1, unrepeated=seed % 3 == 0)
    training = TrainingSetup(global_batch_size=2 * m, optimizer="sgd")
    sm = StageModel(layer_costs(profile, 2), Config(1, k, m, schedule), training)  # type: ignore[arg-type]
    for s in range(k):
        for a in range(layers):
            # the whole stage test (split backwards: the weight gradients may trail)
            out_b = sm.gradient_prefix(a) + 3.0
            values = [sm.stage_value(1.0, out_b, a, b, rc, speed, 0.1 * b)
                      + idle_bound(sm, a, b, rc, s, speed, 1.0, transfers=transfers)
                      for b in range(a + 1, layers + 1)]
            assert all(x <= y * (1 + 1e-12) for x, y in itertools.pairwise(values)), (s, a, values)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 3),
    m=st.sampled_from([3, 4, 8]),
    memory=st.sampled_from(["64MiB", "1GiB"]),
    fraction=st.floats(0.9, 1.3),
)
def test_relaxed_bound_cutoff_agrees_with_the_full_bound(seed: int, k: int, m: int, memory: str, fraction: float) -> None:
    """With a cutoff the bound answers ">= cutoff" exactly when the full bound does, and
    below the cutoff it is the same value."""
    from planner.bounds.relaxed import relaxed_bound
    from planner.search.model import StageModel

    if m < k:
        m = k
    profile = random_profile(seed, 7, unrepeated=seed % 3 == 0)
    cl = cluster(k, memory)
    training = TrainingSetup(global_batch_size=2 * m, optimizer="sgd")
    cfg = Config(1, k, m, "1f1b")
    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    groups = make_groups(cl, training, 1, k)
    sm = StageModel(search.costs_at(2), cfg, training)
    full = relaxed_bound(search, sm, groups, 0.0)
    if full is None:
        assert relaxed_bound(search, sm, groups, 0.0, cutoff=1.0) is None
        return
    cutoff = full * fraction
    cut = relaxed_bound(search, sm, groups, 0.0, cutoff=cutoff)
    assert cut is not None
    if full >= cutoff * (1 + 1e-4):
        assert cut == cutoff
    elif full < cutoff * (1 - 1e-4):
        assert cut == pytest.approx(full, rel=1e-4)
    assert cut <= brute_force(profile, cl, training, k=k, m=m, schedule="1f1b") * (1 + 1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 3),
    v=st.integers(2, 3),
    fraction=st.floats(0.1, 1.5),
)
def test_mixed_interleaved_split_covers_and_fits(seed: int, k: int, v: int, fraction: float) -> None:
    """The per-chunk recompute split is contiguous, covers every layer, and fits memory
    exactly as estimate checks it, whenever it returns one."""
    from planner.cost import plan_fits
    from planner.search.model import StageModel
    from planner.splits.interleaved import interleaved_mixed_split

    m = 2 * k
    profile = activation_heavy_profile(seed, k * v + 3, unrepeated=seed % 3 == 0)
    training = TrainingSetup(global_batch_size=4 * m, optimizer="sgd")
    acts = sum(layer.activation_bytes[-1] for layer in profile.layers)
    cl = cluster(k, f"{max(1, int(acts * 2 * fraction))}B")
    cfg = Config(1, k, m, "interleaved-1f1b", v)
    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    groups = make_groups(cl, training, 1, k)
    sm = StageModel(search.costs_at(4), cfg, training)
    split = interleaved_mixed_split(search, sm, groups, tuple(range(k)))
    if split is None:
        return
    assert split.ranges[0][0] == 0 and split.ranges[-1][1] == profile.num_layers
    assert all(a < b for a, b in split.ranges)
    assert all(x[1] == y[0] for x, y in itertools.pairwise(split.ranges))
    plan = estimate(
        profile, cl, training,
        Layout(
            list(split.ranges),
            num_microbatches=m,
            schedule="interleaved-1f1b",
            recompute=list(split.recompute),
            pipeline_degree=k,
            devices=[list(groups[g].devices) for g in split.groups],
        ),
    )
    assert plan_fits(plan)


def test_chunk_memory_bound_is_stronger_where_chunks_must_recompute() -> None:
    """Interleaved, activation-heavy, tight memory: a rank that recomputes gives up a whole
    chunk's share of its memory, which the whole-model bounds cannot see.  The chunk bound is
    clearly above them and still below the exhaustive optimum's busiest rank."""
    k, v, m = 2, 2, 4
    profile = activation_heavy_profile(11, 6)
    training = TrainingSetup(global_batch_size=4 * m, optimizer="sgd")
    acts = sum(layer.activation_bytes[-1] for layer in profile.layers)
    cl = cluster(k, f"{int(acts * min(m, k * v + k) / k * 0.3 / 0.9)}B")
    cfg = Config(1, k, m, "interleaved-1f1b", v)
    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    groups = make_groups(cl, training, 1, k)
    chunk = chunk_memory_bound(search, cfg, groups)
    whole = max(static_memory_bound(search, cfg, groups), memory_work_bound(search, cfg, groups))
    _, busiest = exhaustive_both(profile, cl, training, cfg)
    assert 1.05 * whole < chunk <= busiest


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    layers=st.integers(1, 9),
    fraction=st.floats(0.0, 1.2),
    exclude=st.sets(st.integers(0, 8), max_size=3),
)
def test_layer_runs_give_the_most_work_of_any_run_that_fits(
    seed: int, layers: int, fraction: float, exclude: set[int]
) -> None:
    """``Windows.value(A)`` is the most work of consecutive layers, none excluded, whose
    activations fit ``A`` (checked against every run); never less, so the bound stays valid."""
    from planner.bounds.chunk_memory import Windows
    from planner.cost import layer_costs

    costs = layer_costs(random_profile(seed, layers), 2)
    skip = frozenset(i for i in exclude if i < layers)
    capacity = fraction * sum(costs.activation_bytes)
    runs = Windows(costs, exclude=skip)
    best = 0.0
    for a in range(layers):
        for b in range(a + 1, layers + 1):
            if skip & set(range(a, b)):
                continue
            if sum(costs.activation_bytes[a:b]) <= capacity:
                best = max(best, sum(costs.forward_ms[a:b]) + sum(costs.backward_ms[a:b]))
    assert runs.value(capacity) == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert runs.value(capacity) >= best


def _blocks_and_head(memory: str) -> tuple[Profile, Cluster, TrainingSetup, Config]:
    """Seven equal blocks and an LM head that does three times their work for 40 MiB of
    activations (the densest layer by far), interleaved on two ranks."""
    from planner.schema import LayerProfile, MeasuredOn
    from tests.planner.helpers import MiB

    sizes = [1, 8]

    def layer(name: str, f: float, act: int) -> LayerProfile:
        return LayerProfile(name=name, param_bytes=MiB, forward_ms=[f * b for b in sizes],
                            backward_ms=[2 * f * b for b in sizes], activation_bytes=[act * MiB * b for b in sizes],
                            output_bytes=[MiB * b for b in sizes])

    layers = [layer(f"block{i}", 1.0, 32) for i in range(7)] + [layer("head", 3.0, 40)]
    profile = Profile(model="blocks-head", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=sizes, layers=layers)
    return profile, cluster(2, memory), TrainingSetup(global_batch_size=32, optimizer="sgd"), Config(1, 2, 4, "interleaved-1f1b", 2)


@pytest.mark.parametrize("memory", ["512MiB", "768MiB"])
def test_chunk_bound_counts_whole_layers_and_a_head_only_one_chunk_can_keep(
    memory: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """512 MiB: a kept chunk holds whole layers, so whole-layer runs beat the fractional
    knapsack; 768 MiB: only one chunk can keep the head, so setting it apart beats runs that
    let every rank claim it.  Each version stays below the exhaustive busiest rank.  (The
    memory walk lets a rank keep a large last chunk with few micro-batches in flight, so the
    margins are a few per cent.)"""
    import planner.bounds.chunk_memory as chunk_memory

    profile, cl, training, cfg = _blocks_and_head(memory)
    groups = make_groups(cl, training, 1, 2)

    def bound() -> float:
        return chunk_memory_bound(SearchState(profile, cl, training, PlanOptions(), deadline=math.inf), cfg, groups)

    full = bound()
    with monkeypatch.context() as patch:
        patch.setattr(chunk_memory, "outlier_layers", lambda costs: frozenset())
        runs_only = bound()
        patch.setattr(chunk_memory.Windows, "value", lambda self, capacity: math.inf)
        knapsack_only = bound()
    _, busiest = exhaustive_both(profile, cl, training, cfg)
    assert full <= busiest * (1 + 1e-9)
    assert knapsack_only <= runs_only <= full
    if memory == "512MiB":
        assert runs_only > 1.03 * knapsack_only
    else:
        assert full > 1.015 * runs_only


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from(SHAPES),
    m=st.sampled_from([2, 4]),
    bandwidth=st.sampled_from([5e8, 2e9, 1e11]),
    overlap=st.sampled_from([0.0, 0.7]),
)
def test_pinned_ranks_with_their_allreduce_stay_below_the_optimum(
    seed: int, shape: tuple[int, int, str], m: int, bandwidth: float, overlap: float
) -> None:
    """Two replicas on a slow link, so the all-reduce after each rank's work is a large part
    of the step: the bound on ranks 0, K-1 and the busiest, with their all-reduce, must
    stay below the best plan of every split, recompute choice and device order."""
    from planner.bounds.work import rank_allreduce_bound

    k, v, schedule = shape
    m = runnable_m(schedule, k, m, v)  # type: ignore[arg-type]
    d = 2
    profile = random_profile(seed, 6 if k * v < 6 else 7, split_backward=seed % 2 == 1, unrepeated=seed % 3 == 0)
    cl = Cluster.model_validate({
        "devices": k * d, "memory": "1GiB", "devices_per_node": 2 * k,
        "intra_node": {"bandwidth_bytes_per_s": bandwidth, "latency_s": 1e-4},
    })
    training = TrainingSetup(global_batch_size=2 * m * d, optimizer="sgd", gradient_overlap=overlap)
    cfg = Config(d, k, m, schedule, v)  # type: ignore[arg-type]
    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    bound = rank_allreduce_bound(search, cfg, make_groups(cl, training, d, k))
    oracle = exhaustive(profile, cl, training, cfg)
    assert bound <= oracle * (1 + 1e-9), (bound, oracle)


def test_layer_runs_past_their_limit_claim_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """With more runs than ``WINDOW_LIMIT`` the table gives up: every answer, the first and
    every later one, is infinity (no information), never a too-small value."""
    import planner.bounds.chunk_memory as chunk_memory
    from planner.cost import layer_costs

    monkeypatch.setattr(chunk_memory, "WINDOW_LIMIT", 3)
    runs = chunk_memory.Windows(layer_costs(random_profile(1, 8), 2))
    big = 1e12
    assert runs.value(big) == math.inf
    assert runs.value(big / 2) == math.inf
    assert runs.value(1.0) == math.inf
