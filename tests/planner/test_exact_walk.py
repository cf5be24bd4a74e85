"""Long interleaved 1F1B schedules: the search keeps their memory to a closed form (an upper
bound of the walk), and checks the walk itself, listed at the fewest micro-batches with the same
points, before it makes a rank recompute."""

from __future__ import annotations

import math

import pytest

from planner.cost import (
    Layout,
    estimate,
    layer_costs,
    plan_fits,
    rank_memory_from_terms,
    rank_memory_terms,
)
from planner.schedules import (
    closed_form_walks,
    memory_points,
    placement_of,
    rank_stages,
    schedule_actions,
    walk_microbatches,
)
from planner.schema import (
    Cluster,
    LayerProfile,
    MeasuredOn,
    PlanOptions,
    Profile,
    StageRange,
    TrainingSetup,
)
from planner.search.model import conservative
from planner.solver import solve

MiB = 2**20


def _points(k: int, m: int, v: int) -> list[set[str]]:
    orders = schedule_actions("interleaved-1f1b", k, m, v)
    walks = memory_points(orders, rank_stages(placement_of("interleaved-1f1b"), k, v))
    return [{repr(p) for p in walk} for walk in walks]


@pytest.mark.parametrize("k,v", [(2, 2), (3, 3), (4, 2), (4, 4), (5, 3), (8, 2), (16, 4)])
def test_the_walk_of_2k_microbatches_has_every_larger_walks_points(k: int, v: int) -> None:
    short = _points(k, 2 * k, v)
    for m in (3 * k, 4 * k, 7 * k):
        assert walk_microbatches("interleaved-1f1b", k, m, v) == 2 * k
        assert _points(k, m, v) == short, (k, v, m)
    # below 2K, and every other schedule, list their own count
    assert walk_microbatches("interleaved-1f1b", k, k, v) == k
    assert walk_microbatches("1f1b", k, 8 * k) == 8 * k


def test_a_rank_the_closed_form_would_make_recompute_fits_by_its_walk() -> None:
    """20 layers in 8 chunks on 4 ranks, M = 24 (a schedule the search keeps to the closed
    form); one chunk per rank keeps 8x the activations of the other: the closed form charges
    every in-flight micro-batch the larger chunk, the walk knows most are of the smaller one."""
    layers = []
    for i in range(20):
        big = i < 12 and i % 3 == 0
        layers.append(LayerProfile(
            name=f"l{i}", param_bytes=MiB, forward_ms=[1.0], backward_ms=[2.0],
            activation_bytes=[(16 if big else 2) * MiB], output_bytes=[MiB],
        ))
    profile = Profile(model="uneven-chunks", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=[1], layers=layers)
    training = TrainingSetup(global_batch_size=24, optimizer="sgd")
    ranges = [(0, 3), (3, 6), (6, 9), (9, 12), (12, 14), (14, 16), (16, 18), (18, 20)]
    k, m, v = 4, 24, 2

    def cluster(memory: int) -> Cluster:
        return Cluster.model_validate({"devices": k, "memory": memory, "intra_node": "nvlink4", "devices_per_node": k})

    from planner.search.space import Config

    assert conservative(Config(1, k, m, "interleaved-1f1b", v), profile.num_layers)
    exact = estimate(
        profile, cluster(2**40), training,
        Layout(
            ranges,
            num_microbatches=m,
            schedule="interleaved-1f1b",
            pipeline_degree=k,
        ),
    )
    costs = layer_costs(profile, 1)
    closed = closed_form_walks("interleaved-1f1b", k, m, v)
    assert closed is not None
    own = rank_stages("loop", k, v)
    exact_peak = max(s.memory_bytes for s in exact.stages)
    closed_peak = max(
        rank_memory_from_terms(rank_memory_terms(costs, [ranges[s] for s in stages], training), [False] * v, closed[r])
        for r, stages in enumerate(own)
    )
    assert closed_peak > exact_peak * 1.2  # the closed form is far above the walk here
    # usable memory (10 % margin) just above the walk's peak, below the closed form's
    memory = math.ceil(exact_peak / 0.9) + 1
    options = PlanOptions(stages=[StageRange(start=a, stop=b) for a, b in ranges], schedule="interleaved-1f1b",
                          num_microbatches=m, virtual_stages=v, data_parallel=1, time_limit_s=2.0)
    plan = solve(profile, cluster(memory), training, options)
    assert not any(s.recompute for s in plan.stages)  # without the walk: recompute on every heavy rank
    assert plan_fits(plan)
    assert plan.predicted.step_time_ms == pytest.approx(exact.predicted.step_time_ms)


def test_one_layer_chunks_whose_closed_form_fits_no_recompute_set_still_plan() -> None:
    """Meta's Llama 3 layout in small: one layer per chunk (K = 4 ranks x v = 8 chunks, M = 16),
    the last chunk's input 16x the others' (the head reads the final hidden state, kept in
    fp32 here), so the closed form charges every warm-up forward of the last rank that input,
    even with every chunk recomputing.  The schedule's walk fits once most chunks recompute: the
    search must find such a set (2^8 per rank: the greedy fallback past the cheapest 16), not
    report that nothing fits."""
    n, k, m, v = HEAD_HEAVY
    profile, training, ranges = _head_heavy()
    cluster = _cluster

    from planner.search.space import Config

    assert conservative(Config(1, k, m, "interleaved-1f1b", v), profile.num_layers)

    def walked(recompute: bool) -> float:
        return _walked(profile, training, ranges, [recompute] * n, 2**40)

    costs = layer_costs(profile, 1)
    closed = closed_form_walks("interleaved-1f1b", k, m, v)
    assert closed is not None
    own = rank_stages("loop", k, v)
    closed_all = max(
        rank_memory_from_terms(rank_memory_terms(costs, [ranges[s] for s in stages], training), [True] * v, closed[r])
        for r, stages in enumerate(own)
    )
    memory = math.ceil(walked(True) / 0.9) + 1  # usable memory (10 % margin) just above the walk's peak
    assert closed_all > memory and walked(False) > memory  # the closed form fits nothing; the walk needs recompute
    options = PlanOptions(schedule="interleaved-1f1b", num_microbatches=m, virtual_stages=v, data_parallel=1,
                          time_limit_s=2.0)
    plan = solve(profile, cluster(memory), training, options)
    assert plan_fits(plan)
    assert len(plan.stages) == n and any(s.recompute for s in plan.stages)


#: layers, ranks, micro-batches, chunks per rank of :func:`_head_heavy`
HEAD_HEAVY = (32, 4, 16, 8)


def _head_heavy() -> tuple[Profile, TrainingSetup, list[tuple[int, int]]]:
    """One layer per chunk on K = 4 ranks x v = 8, M = 16; the last chunk's input 16x the others'."""
    n, _, m, _ = HEAD_HEAVY
    layers = [
        LayerProfile(
            name=f"l{i}", param_bytes=MiB, forward_ms=[1.0], backward_ms=[2.0],
            activation_bytes=[8 * MiB], output_bytes=[(16 if i == n - 2 else 1) * MiB],
        )
        for i in range(n)
    ]
    profile = Profile(model="head-heavy", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=[1], layers=layers)
    return profile, TrainingSetup(global_batch_size=m, optimizer="sgd"), [(i, i + 1) for i in range(n)]


def _cluster(memory: int) -> Cluster:
    k = HEAD_HEAVY[1]
    return Cluster.model_validate({"devices": k, "memory": memory, "intra_node": "nvlink4", "devices_per_node": k})


def _walked(profile: Profile, training: TrainingSetup, ranges: list[tuple[int, int]], recompute: list[bool],
            memory: int) -> float:
    _, k, m, _ = HEAD_HEAVY
    plan = estimate(profile, _cluster(memory), training, Layout(
        ranges, num_microbatches=m, schedule="interleaved-1f1b", pipeline_degree=k, recompute=recompute))
    return max(s.memory_bytes for s in plan.stages)


@pytest.mark.parametrize("share", [0.35, 0.5, 0.8])
def test_prefix_recompute_checkpoints_each_ranks_fewest_first_chunks_that_fit(share: float) -> None:
    """Llama 3's choice (each rank checkpoints its first n chunks, the least n that fits), as the
    interleaved searches offer it beside the set grown by memory."""
    import time

    from planner.search.space import Config, make_groups
    from planner.search.state import SearchState
    from planner.splits.recompute import with_prefix_recompute

    n, k, m, v = HEAD_HEAVY
    profile, training, ranges = _head_heavy()
    lo, hi = _walked(profile, training, ranges, [True] * n, 2**40), _walked(profile, training, ranges, [False] * n, 2**40)
    memory = math.ceil((lo + share * (hi - lo)) / 0.9)
    cluster = _cluster(memory)
    search = SearchState(profile, cluster, training, PlanOptions(time_limit_s=2.0), deadline=time.perf_counter() + 60)
    cfg = Config(1, k, m, "interleaved-1f1b", v)
    sm = search.stage_model(cfg)
    groups = make_groups(cluster, training, 1, k)
    split = with_prefix_recompute(search, sm, groups, tuple(ranges), tuple(sm.owner))
    assert split is not None
    limit = groups[0].limit_bytes
    counts = []
    for own in sm.rank_stages:
        flags = [split.recompute[s] for s in own]
        count = sum(flags)
        assert flags == [j < count for j in range(v)]  # a prefix of the rank's chunks
        counts.append(count)
    assert _walked(profile, training, ranges, list(split.recompute), memory) <= limit
    for r, own in enumerate(sm.rank_stages):  # one chunk fewer on any rank does not fit
        if counts[r] == 0:
            continue
        fewer = list(split.recompute)
        fewer[own[counts[r] - 1]] = False
        plan = estimate(profile, cluster, training, Layout(
            ranges, num_microbatches=m, schedule="interleaved-1f1b", pipeline_degree=k, recompute=fewer))
        assert max(plan.stages[s].memory_bytes for s in own) > limit
