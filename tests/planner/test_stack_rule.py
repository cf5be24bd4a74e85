"""The hand rule of a Megatron-LM user (planner/splits/baseline_seed.py: micro-batch 1, blocks
split evenly, interleaved with v = 2 or 3, recompute where memory needs it) seeds the search,
so a plan is never slower than that rule; and a search out of time before every configuration
has its cheap bound keeps a valid bound."""

from __future__ import annotations

import itertools
import math

import pytest

from planner.cost import Layout, estimate, plan_fits
from planner.errors import InputError
from planner.schema import Cluster, PlanOptions, TrainingSetup
from planner.search import driver
from planner.search.state import SearchState
from planner.solver import solve
from planner.splits.baseline_seed import rule_splits, seed_with_stack_rule, stack_rule_ranges
from profiler.synth import synth_transformer


def test_stack_rule_ranges_put_the_embedding_first_and_the_head_last() -> None:
    assert stack_rule_ranges(10, 4) == [(0, 3), (3, 5), (5, 7), (7, 10)]
    assert stack_rule_ranges(10, 1) == [(0, 10)]
    assert stack_rule_ranges(10, 3) is None  # 8 blocks do not split evenly in 3
    assert stack_rule_ranges(4, 3) is None


def test_megatron_s_accounting_split_counts_the_embedding_and_the_head_as_layers() -> None:
    # Llama 3 405B: 126 blocks + embedding + head = 128 layers on 16 ranks x 8 chunks, one each
    assert stack_rule_ranges(128, 16) is None  # 126 blocks do not split in 16
    ranges = stack_rule_ranges(128, 16, count_ends=True)
    assert ranges is not None and len(ranges) == 16
    assert ranges[0] == (0, 8) and ranges[-1] == (120, 128)  # one block fewer at each end
    assert all(b - a == 8 for a, b in ranges)
    assert stack_rule_ranges(128, 128, count_ends=True) == [(i, i + 1) for i in range(128)]
    assert stack_rule_ranges(10, 4, count_ends=True) is None


def test_the_rule_s_splits_fall_back_to_the_accounting_split_and_offer_one_layer_chunks() -> None:
    # 10 layers (8 blocks) on 4 ranks: v = 1 and 2 split the blocks evenly; v = 3 nothing
    got = dict(rule_splits(10, 4, [2, 3, 1]))
    assert got == {2: stack_rule_ranges(10, 8), 1: stack_rule_ranges(10, 4)}
    # 128 layers on 16 ranks: the blocks never split evenly; the layers do at v = 1, 2 and 8
    got = dict(rule_splits(128, 16, [2, 3, 1], one_layer_chunks=True))
    assert sorted(got) == [1, 2, 8]
    assert got[8] == [(i, i + 1) for i in range(128)]
    assert got[2] == stack_rule_ranges(128, 32, count_ends=True)
    assert 8 not in dict(rule_splits(128, 16, [2, 3, 1]))  # (only when v is free)
    assert all(v <= 1 for v, _ in rule_splits(10, 1, [2, 3, 1]))  # one rank: one stage


def _rule_steps(profile, cluster: Cluster, training: TrainingSetup) -> list[float]:  # type: ignore[no-untyped-def]
    """Every configuration of the rule that fits, priced by the cost model (recompute none or all)."""
    out = []
    n = cluster.num_devices
    for k, v in itertools.product(range(1, n + 1), (1, 2, 3)):
        ranges = stack_rule_ranges(profile.num_layers, k * v)
        if n % k or ranges is None or (k == 1 and v > 1):
            continue
        d = n // k
        m = training.global_batch_size // d
        for rc in (False, True):
            try:
                plan = estimate(
                    profile, cluster, training,
                    Layout(
                        ranges,
                        num_microbatches=m,
                        schedule="interleaved-1f1b" if v > 1 else "1f1b",
                        recompute=rc,
                        data_parallel=d,
                        pipeline_degree=k,
                    ),
                )
            except InputError:  # (a shape the schedule refuses)
                continue
            if plan_fits(plan):
                out.append(plan.predicted.step_time_ms)
    return out


@pytest.mark.parametrize("memory", ["12GiB", "20GiB"])
def test_a_plan_is_never_slower_than_the_hand_rule(memory: str) -> None:
    profile = synth_transformer(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200, device_type="a100-80g",
                                microbatch_sizes=(1, 2))
    cluster = Cluster.model_validate({"devices": 8, "memory": memory, "device_type": "a100-80g"})
    training = TrainingSetup(global_batch_size=64, optimizer="adam", dtype="bfloat16")
    rule = _rule_steps(profile, cluster, training)
    assert rule, "the rule must have a plan that fits here"
    plan = solve(profile, cluster, training, PlanOptions(time_limit_s=0.3, tensor_parallel=1, zero_stage=0,
                                                         selective_recompute=False))
    assert plan.predicted.step_time_ms <= min(rule) * (1 + 1e-9)


def test_the_seed_is_the_rule_and_as_fast_as_its_best_configuration() -> None:
    profile = synth_transformer(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200, device_type="a100-80g",
                                microbatch_sizes=(1, 2))
    cluster = Cluster.model_validate({"devices": 8, "memory": "12GiB", "device_type": "a100-80g"})
    training = TrainingSetup(global_batch_size=64, optimizer="adam", dtype="bfloat16")
    search = SearchState(profile, cluster, training, PlanOptions(), deadline=math.inf)
    seed_with_stack_rule(search)
    assert search.best is not None
    cfg, split, _ = search.best
    assert cfg.data_parallel * cfg.num_microbatches == training.global_batch_size  # micro-batch 1
    assert list(split.ranges) == stack_rule_ranges(profile.num_layers, cfg.num_stages)
    assert search.best_step <= min(_rule_steps(profile, cluster, training)) * (1 + 1e-9)


def test_out_of_time_in_level0_keeps_a_valid_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = synth_transformer(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200, device_type="a100-80g",
                                microbatch_sizes=(1, 2))
    cluster = Cluster.model_validate({"devices": 8, "memory": "20GiB", "device_type": "a100-80g"})
    training = TrainingSetup(global_batch_size=64, optimizer="adam", dtype="bfloat16")
    options = PlanOptions(time_limit_s=0.3, tensor_parallel=1, zero_stage=0, selective_recompute=False)
    full = solve(profile, cluster, training, options)
    monkeypatch.setattr(driver, "WALL_SAFETY", 1e-9)  # the wall-clock net is past at once
    cut = solve(profile, cluster, training, options)
    assert "time limit reached" in cut.solver.message
    assert plan_fits(cut) and cut.solver.status == "feasible"
    # its bound never exceeds the best plan either search found (so it is below the optimum too)
    best = min(full.predicted.step_time_ms, cut.predicted.step_time_ms)
    assert cut.predicted.step_time_ms * (1 - cut.solver.gap) <= best * (1 + 1e-9)
    assert not math.isnan(cut.solver.gap)


def _rule_steps_with_t(profile, cluster: Cluster, training: TrainingSetup, t: int) -> list[float]:  # type: ignore[no-untyped-def]
    """The rule's configurations at tensor-parallel degree ``t`` (K·D·t devices), priced by the
    cost model with every stage recomputed (as Megatron's Table 1) or none."""
    out = []
    groups = cluster.num_devices // t
    for k, v in itertools.product(range(1, groups + 1), (1, 2, 3)):
        ranges = stack_rule_ranges(profile.num_layers, k * v)
        if groups % k or ranges is None or (k == 1 and v > 1):
            continue
        d = groups // k
        if training.global_batch_size % d:
            continue
        for rc in (False, True):
            try:
                plan = estimate(
                    profile, cluster, training,
                    Layout(
                        ranges,
                        num_microbatches=training.global_batch_size // d,
                        schedule="interleaved-1f1b" if v > 1 else "1f1b",
                        recompute=rc,
                        data_parallel=d,
                        pipeline_degree=k,
                        tensor_parallel=t,
                        zero_stage=0,
                    ),
                )
            except InputError:
                continue
            if plan_fits(plan):
                out.append(plan.predicted.step_time_ms)
    return out


def test_a_mesh_plan_out_of_time_is_never_slower_than_the_hand_rule_of_any_t(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mesh search prices every family's hand rule before it searches: with the wall clock
    past at once (a loaded machine), only the first family is solved, and the plan is still no
    slower than what a Megatron user writes at any T."""
    from planner.search import axes

    profile = synth_transformer(layers=24, hidden=4096, heads=32, seq=2048, vocab=51200, device_type="a100-80g",
                                microbatch_sizes=(1, 2), attention="materialized")
    cluster = Cluster.model_validate({"devices": 32, "memory": "40GiB", "device_type": "a100-80g"})
    training = TrainingSetup(global_batch_size=128, optimizer="adam", dtype="bfloat16")
    monkeypatch.setattr(axes, "WALL_SAFETY", 1e-9)
    monkeypatch.setattr(driver, "WALL_SAFETY", 1e-9)  # the D x K solve's own net too
    plan = solve(profile, cluster, training, PlanOptions(time_limit_s=0.2, zero_stage=0, selective_recompute=False))
    assert "1 D x K solves" in plan.solver.message and "time limit reached" in plan.solver.message
    assert plan.solver.message.count("time limit reached") == 1, plan.solver.message  # said once
    rules = {t: _rule_steps_with_t(profile, cluster, training, t) for t in (1, 2, 4, 8)}
    assert sum(bool(r) for r in rules.values()) >= 2, "the rule must fit at several T here"
    for t, steps in rules.items():
        if steps:
            assert plan.predicted.step_time_ms <= min(steps) * (1 + 1e-9), (t, plan.predicted.step_time_ms, min(steps))
    assert plan_fits(plan) and plan.solver.status == "feasible"
