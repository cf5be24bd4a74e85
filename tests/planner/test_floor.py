"""Configuration floors (planner/search/floor.py) and the mesh search's phase 4, which raises
its open bounds with them: valid against brute force, and raising the bound where the ZeRO
relaxation was loose."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.mesh import Mesh, mesh_problem
from planner.schema import PlanOptions, TrainingSetup
from planner.search import axes
from planner.search.floor import configuration_floor
from planner.solver import solve
from profiler.synth import synth_transformer
from tests.planner.helpers import MiB
from tests.planner.test_axes import _cluster, brute_force_mesh, sharded_profile


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), memory_mib=st.sampled_from([40, 70, 120]), zero=st.sampled_from([0, 1, 2, 3]))
def test_the_floor_is_below_every_plan_of_its_problem(seed: int, memory_mib: int, zero: int) -> None:
    """The floor of one (ZeRO stage) problem never exceeds the brute-forced best plan of it."""
    profile = sharded_profile(seed, 4)
    cl = _cluster(4, memory_mib * MiB)
    training = TrainingSetup(global_batch_size=4)
    floors = []
    for d in (1, 2, 4):  # the T = 1 problem of that ZeRO stage at every D, as the mesh search poses it
        problem = mesh_problem(profile, cl, training, Mesh(zero_stage=zero), data_parallel=d, pipeline_degree=1)
        floor, count = configuration_floor(problem.profile, problem.cluster, problem.training,
                                           PlanOptions(schedule="1f1b", data_parallel=d))
        assert count > 0
        floors.append(floor)
    optimum = brute_force_mesh(profile, cl, training, zeros=(zero,), tensor_parallel=(1,))
    assert min(floors) <= optimum * (1 + 1e-9), (floors, optimum)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), memory_mib=st.sampled_from([40, 70, 120]))
def test_the_raised_bounds_stay_valid_against_brute_force(seed: int, memory_mib: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With the small-instance path off, the mesh search bounds ZeRO by its relaxation and then
    by the floors of phase 4 (and with no clock, budget or time limit in the way): its bound
    never exceeds the brute-forced optimum over every T, ZeRO stage, D, K, M and split."""
    monkeypatch.setattr(axes, "small_instance", lambda *_: False)
    monkeypatch.setattr(axes, "FLOOR_SHARE", 100.0)
    profile = sharded_profile(seed, 4)
    cl = _cluster(4, memory_mib * MiB)
    training = TrainingSetup(global_batch_size=4)
    optimum = brute_force_mesh(profile, cl, training)
    if optimum == math.inf:
        return
    plan = solve(profile, cl, training, PlanOptions(schedule="1f1b", time_limit_s=30.0))
    if "ZeRO 1-3 not searched" in plan.solver.message:
        optimum = brute_force_mesh(profile, cl, training, zeros=(0,))
    bound = plan.predicted.step_time_ms * (1 - plan.solver.gap)
    assert bound <= optimum * (1 + 1e-9), (bound, optimum, plan.solver.message)


def test_the_floors_raise_a_loose_zero_relaxation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A memory-bound model whose gradient all-reduce is large (a heavy embedding and head): the
    relaxation drops the all-reduce, the floors keep each ZeRO stage's collectives, so the proven
    bound rises, and stays below the plan."""
    # (the flat efficiency and materialised attention this case was built with: the device model's times
    # and flash attention's memory make another case)
    profile = synth_transformer(layers=24, hidden=2048, heads=16, seq=2048, vocab=256000, device_type="a100-80g",
                                microbatch_sizes=(1, 2), mfu=0.5, attention="materialized")
    cl = _cluster(16, 40 * 1024 * MiB)  # (ZeRO 1 it is: memory binds)
    training = TrainingSetup(global_batch_size=128, optimizer="adam-mixed")
    # (whole-stage recompute: the bound of partial recompute's relaxed problem would hide the floors')
    options = PlanOptions(time_limit_s=2.0, tensor_parallel=1, selective_recompute=False, partial_recompute=False)
    monkeypatch.setattr(axes, "FLOOR_SHARE", 0.0)
    without = solve(profile, cl, training, options)
    monkeypatch.setattr(axes, "FLOOR_SHARE", 100.0)
    with_floors = solve(profile, cl, training, options)
    assert with_floors.predicted.step_time_ms == pytest.approx(without.predicted.step_time_ms)  # the plan is settled
    assert with_floors.solver.gap < 0.75 * without.solver.gap, (with_floors.solver.gap, without.solver.gap)  # 1.9 -> 1.05 %
    assert with_floors.solver.gap > 0


def test_no_all_reduce_latency_where_no_gradient_bytes_move() -> None:
    """ZeRO 3 collects nothing after the step (its problem has no gradient bytes): the cheap
    bound once charged each rank the all-reduce's latencies anyway, 0.018 ms over this optimum."""
    profile = sharded_profile(0, 4)
    cl = _cluster(4, 120 * MiB)
    training = TrainingSetup(global_batch_size=4)
    problem = mesh_problem(profile, cl, training, Mesh(zero_stage=3), data_parallel=4, pipeline_degree=1)
    assert problem.training.gradient_bytes_per_param_byte == 0
    floor, _ = configuration_floor(problem.profile, problem.cluster, problem.training,
                                   PlanOptions(schedule="1f1b", data_parallel=4))
    optimum = brute_force_mesh(profile, cl, training, zeros=(3,), tensor_parallel=(1,))
    assert floor <= optimum * (1 + 1e-12), (floor, optimum)


def test_zero_solves_try_every_replica_count_while_nothing_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing fits at ZeRO 0 and the relaxation's D fits no ZeRO stage: the ZeRO solves try the
    other replica counts (it said "no plan fits" although ZeRO 2 at D = 2 does)."""
    monkeypatch.setattr(axes, "small_instance", lambda *_: False)  # (the path of larger models)
    profile = sharded_profile(5, 4)
    cl = _cluster(4, 100 * MiB)
    # (fused optimizer kernels: the memory was sized before the step's temporaries were counted)
    training = TrainingSetup(global_batch_size=4, fused_optimizer=True)
    optimum = brute_force_mesh(profile, cl, training)
    assert optimum < math.inf
    plan = solve(profile, cl, training, PlanOptions(schedule="1f1b", time_limit_s=30.0))
    assert plan.zero_stage > 0
    assert plan.predicted.step_time_ms * (1 - plan.solver.gap) <= optimum * (1 + 1e-9)
