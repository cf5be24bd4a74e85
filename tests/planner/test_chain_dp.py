"""The boundary dynamic program of :mod:`planner.bounds.chain_dp` and its 1F1B pair path are valid.

* the pair path of a split never exceeds its simulated step (random splits, recompute,
  slow links between nodes, data parallelism);
* the table never excludes a time at which some split fits (against every split of small
  instances), and the split it returns covers the model and fits memory;
* on a pipeline with a slow link between two nodes it proves more than the greedy's
  relaxed bound, which cannot see the link's ping-pong.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.bounds.chain_dp import chain_split, split_pair_bound
from planner.bounds.relaxed import relaxed_bound
from planner.schema import Cluster, PlanOptions, TrainingSetup
from planner.search.model import Split, StageModel, quick_step, split_memory_ok
from planner.search.space import Config, make_groups
from planner.search.state import SearchState
from tests.planner.helpers import brute_force, random_profile

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def two_tier(n: int, memory: str, *, per_node: int) -> Cluster:
    """``per_node`` devices a node, joined by a link slow enough to rival the compute."""
    return Cluster.model_validate({
        "devices": n, "memory": memory, "devices_per_node": per_node, "intra_node": "nvlink4",
        "inter_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4},
    })


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 5),
    extra=st.integers(0, 6),
    d=st.sampled_from([1, 2]),
    per_node=st.sampled_from([1, 2, 4]),
    overlap=st.sampled_from([0.0, 0.5]),
)
def test_pair_path_never_exceeds_the_simulated_step(seed: int, k: int, extra: int, d: int, per_node: int,
                                                    overlap: float) -> None:
    rng = random.Random(seed)
    m = k + extra
    layers = k + rng.randint(0, 6)
    profile = random_profile(seed, layers, unrepeated=seed % 3 == 0)
    cl = two_tier(k * d, "64GiB", per_node=per_node)
    training = TrainingSetup(global_batch_size=2 * m * d, optimizer="sgd", gradient_overlap=overlap)
    cfg = Config(d, k, m, "1f1b")
    sm = StageModel(SearchState(profile, cl, training, PlanOptions(), deadline=math.inf).costs_at(2), cfg, training)
    groups = make_groups(cl, training, d, k)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, layers), k - 1))
        bounds = (0, *cuts, layers)
        split = Split(
            tuple((bounds[i], bounds[i + 1]) for i in range(k)),
            tuple(rng.random() < 0.5 for _ in range(k)),
            tuple(range(k)),
        )
        assert split_pair_bound(sm, groups, cl, split) <= quick_step(sm, cl, groups, split) * (1 + 1e-12)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 3),
    extra=st.integers(0, 4),
    memory=st.sampled_from(["40MiB", "64MiB", "1GiB"]),
    per_node=st.sampled_from([1, 2]),
    schedule=st.sampled_from(["1f1b", "1f1b", "gpipe", "zb-h1", "zb-h2", "planned"]),
)
def test_the_table_never_excludes_a_time_some_split_reaches(
    seed: int, k: int, extra: int, memory: str, per_node: int, schedule: str
) -> None:
    m = k + extra
    profile = random_profile(seed, 6, split_backward=seed % 2 == 1, unrepeated=seed % 3 == 0)
    cl = two_tier(k, memory, per_node=per_node)
    training = TrainingSetup(global_batch_size=2 * m, optimizer="sgd")
    cfg = Config(1, k, m, schedule)  # type: ignore[arg-type]
    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    sm = StageModel(search.costs_at(2), cfg, training)
    groups = make_groups(cl, training, 1, k)
    best = brute_force(profile, cl, training, k=k, m=m, schedule=schedule)  # type: ignore[arg-type]
    if math.isinf(best):
        if schedule in ("1f1b", "gpipe"):  # exact memory: the table must see that nothing fits
            assert chain_split(sm, groups, cl, training, PlanOptions(), 1e12) is None
        # (the others' memory in the table is a lower bound: it may keep a split the walk
        # refuses; the direction that matters, never excluding a split that fits, is below)
        return
    found = chain_split(sm, groups, cl, training, PlanOptions(), best * (1 + 1e-9))
    assert found is not None
    ranges, rcs = found
    assert ranges[0][0] == 0 and ranges[-1][1] == profile.num_layers
    assert all(a < b for a, b in ranges) and all(x[1] == y[0] for x, y in itertools.pairwise(ranges))
    if schedule in ("1f1b", "gpipe"):  # (the others' memory in the table is a lower bound)
        assert split_memory_ok(sm, groups, Split(ranges, rcs, tuple(range(k))))


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 3),
    extra=st.integers(0, 4),
    memory=st.sampled_from(["40MiB", "1GiB"]),
    per_node=st.sampled_from([1, 2]),
    schedule=st.sampled_from(["1f1b", "gpipe", "zb-h1", "zb-h2", "planned"]),
)
def test_relaxed_bound_with_transfers_stays_below_the_optimum(
    seed: int, k: int, extra: int, memory: str, per_node: int, schedule: str
) -> None:
    """The greedy's relaxed bound counts the least transfer of every boundary (slow links
    between nodes here); it must still never exceed the best split, for every one-chunk
    schedule (split backwards too, with measured input and weight gradients)."""
    m = k + extra
    profile = random_profile(seed, 6, split_backward=seed % 2 == 1, unrepeated=seed % 3 == 0)
    cl = two_tier(k, memory, per_node=per_node)
    training = TrainingSetup(global_batch_size=2 * m, optimizer="sgd")
    cfg = Config(1, k, m, schedule)  # type: ignore[arg-type]
    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    sm = StageModel(search.costs_at(2), cfg, training)
    bound = relaxed_bound(search, sm, make_groups(cl, training, 1, k), 0.0)
    best = brute_force(profile, cl, training, k=k, m=m, schedule=schedule)  # type: ignore[arg-type]
    if bound is None:
        assert math.isinf(best)
    else:
        assert bound <= best * (1 + 1e-9)


def test_a_slow_link_between_busy_stages_raises_the_bound() -> None:
    """Four stages, one device a node, a slow link: the greedy's relaxed bound leaves the
    links' ping-pong out, the table's pair path counts it; both stay below the optimum."""
    k, m = 4, 32
    profile = random_profile(3, 12)
    cl = two_tier(k, "64GiB", per_node=1)
    training = TrainingSetup(global_batch_size=2 * m, optimizer="sgd")
    cfg = Config(1, k, m, "1f1b")
    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    sm = StageModel(search.costs_at(2), cfg, training)
    groups = make_groups(cl, training, 1, k)
    relaxed = relaxed_bound(search, sm, groups, 0.0)
    assert relaxed is not None
    best = brute_force(profile, cl, training, k=k, m=m, schedule="1f1b")
    # bisect the table's bound
    lo, hi = relaxed, best * (1 + 1e-9)
    assert chain_split(sm, groups, cl, training, PlanOptions(), hi) is not None
    for _ in range(30):
        mid = (lo + hi) / 2
        if chain_split(sm, groups, cl, training, PlanOptions(), mid) is not None:
            hi = mid
        else:
            lo = mid
    assert relaxed * 1.015 < lo <= best
    # and the best split's own pair path is what the simulator sees, within a few percent
    found = chain_split(sm, groups, cl, training, PlanOptions(), hi)
    assert found is not None
    split = Split(found[0], found[1], tuple(range(k)))
    assert split_pair_bound(sm, groups, cl, split) > 0.9 * quick_step(sm, cl, groups, split)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 3),
    m=st.sampled_from([4, 8]),
    memory=st.sampled_from(["40MiB", "64MiB", "1GiB"]),
    per_node=st.sampled_from([1, 2]),
)
def test_solver_gap_stays_true_when_the_table_sets_it(
    seed: int, k: int, m: int, memory: str, per_node: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With enumeration switched off, one-chunk configurations are settled by the greedy
    splits and the boundary table: the plan fits, and ``step x (1 - gap)`` never exceeds the
    best split of every configuration the options allow."""
    import planner.splits.exhaustive as exhaustive
    from planner.errors import InfeasibleError
    from planner.solver import solve
    from tests.planner.helpers import assert_valid

    monkeypatch.setattr(exhaustive, "ENUMERATE_LIMIT", 0)
    profile = random_profile(seed, 8, unrepeated=seed % 3 == 0)
    cl = two_tier(k, memory, per_node=per_node)
    training = TrainingSetup(global_batch_size=m, optimizer="sgd")
    # (whole-stage recompute: the space the brute force covers; a partial plan may beat it)
    options = PlanOptions(stages=k, num_microbatches=m, schedule="1f1b", data_parallel=1, partial_recompute=False)
    best = brute_force(profile, cl, training, k=k, m=m, schedule="1f1b")
    if math.isinf(best):
        with pytest.raises(InfeasibleError):
            solve(profile, cl, training, options)
        return
    plan = solve(profile, cl, training, options)
    assert_valid(plan, profile)
    assert plan.predicted.step_time_ms >= best * (1 - 1e-9)
    assert plan.predicted.step_time_ms * (1 - plan.solver.gap) <= best * (1 + 1e-9)
