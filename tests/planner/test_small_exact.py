"""Small instances are solved exactly: status ``optimal``, gap 0, and the brute-force optimum
over every configuration (D, K, M, schedule, v, split, recompute), not only over splits.

Recompute is whole-stage here (``partial_recompute=False``), the space the brute force covers;
``tests/planner/test_checkpoints.py`` checks the bound of partial recompute against its own."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import InfeasibleError
from planner.schema import KeptInput, LayerProfile, MeasuredOn, PlanOptions, Profile, TrainingSetup
from planner.solver import solve
from tests.planner.helpers import brute_force_all, cluster

MiB = 2**20


@st.composite
def small_profiles(draw: st.DrawFn) -> Profile:
    sizes = draw(st.sampled_from([[1, 2], [1, 2, 4], [2]]))
    layers = []
    count = draw(st.integers(2, 5))
    for i in range(count):
        f = draw(st.floats(0.05, 5.0))
        # noisy measurements: each size's figure off by up to +-40 % (a larger size may be
        # measured faster than a smaller one)
        fwd = [f * b * draw(st.floats(0.6, 1.4)) for b in sizes]
        bwd = [2 * f * b * draw(st.floats(0.6, 1.4)) for b in sizes]
        act = draw(st.integers(0, 64)) * MiB
        layers.append(
            LayerProfile(
                name=f"l{i}",
                param_bytes=draw(st.integers(0, 32)) * MiB,
                forward_ms=fwd,
                backward_ms=bwd,
                activation_bytes=[act * b for b in sizes],
                output_bytes=[draw(st.integers(0, 8)) * MiB * b for b in sizes],
                # what a stage starting here keeps of its own input, positive or (a slice of
                # a larger tensor) negative: the bounds must stay valid either way
                kept_inputs=[
                    KeptInput(offset=off, bytes=[draw(st.integers(-32, 32)) * MiB * b for b in sizes])
                    for off in draw(st.lists(st.integers(0, count - 1 - i), max_size=2, unique=True))
                ] or None,
            )
        )
    return Profile(
        model="small", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=sizes,
        input_bytes=[MiB * b for b in sizes], layers=layers,
    )


@settings(max_examples=50, deadline=None)
@given(
    profile=small_profiles(),
    devices=st.integers(1, 4),
    batch=st.sampled_from([2, 4]),
    memory_mib=st.sampled_from([200, 400, 1000, 4000]),
)
def test_small_instances_are_optimal_against_brute_force(
    profile: Profile, devices: int, batch: int, memory_mib: int
) -> None:
    cl = cluster(devices, f"{memory_mib}MiB")
    training = TrainingSetup(global_batch_size=batch, optimizer="sgd")
    best = brute_force_all(profile, cl, training)
    try:
        # the brute force covers the D x K space (ZeRO 0; tests/planner/test_axes.py covers the mesh)
        plan = solve(profile, cl, training, PlanOptions(time_limit_s=5.0, zero_stage=0, partial_recompute=False))
    except InfeasibleError:
        assert best == math.inf
        return
    assert plan.solver.status == "optimal", plan.solver
    assert plan.solver.gap == 0.0
    assert math.isclose(plan.predicted.step_time_ms, best, rel_tol=1e-9), (plan.predicted.step_time_ms, best)


@settings(max_examples=8, deadline=None)
@given(
    profile=small_profiles(),
    devices=st.integers(2, 4),
    memory_mib=st.sampled_from([200, 400, 1000]),
)
def test_small_instances_are_optimal_with_zero_free(profile: Profile, devices: int, memory_mib: int) -> None:
    """ZeRO free (the default): a small instance solves every (ZeRO stage, D) apart, so the plan
    is proven optimal over ZeRO 0-3 too, not bounded by a relaxation."""
    cl = cluster(devices, f"{memory_mib}MiB")
    training = TrainingSetup(global_batch_size=4, optimizer="adam")  # (optimizer state: ZeRO matters)
    best = brute_force_all(profile, cl, training, zeros=(0, 1, 2, 3))
    try:
        plan = solve(profile, cl, training, PlanOptions(time_limit_s=5.0, partial_recompute=False))
    except InfeasibleError:
        assert best == math.inf
        return
    assert plan.solver.status == "optimal", plan.solver
    assert math.isclose(plan.predicted.step_time_ms, best, rel_tol=1e-9), (plan.predicted.step_time_ms, best)


def test_noisy_13_layer_mlp_on_two_devices_is_optimal(tmp_path: Path) -> None:
    """The issue's case: 13 tiny noisy layers, 2 devices, K = 2 fixed, every schedule free."""
    from tests.test_robust_profiles import _noisy_mlp

    profile = Profile.model_validate(json.loads(json.dumps(_noisy_mlp())))
    plan = solve(
        profile, cluster(2, "4GiB"), TrainingSetup(global_batch_size=8),
        PlanOptions(stages=2, data_parallel=1),
    )
    assert plan.solver.status == "optimal" and plan.solver.gap == 0.0, plan.solver


@settings(max_examples=60, deadline=None)
@given(profile=small_profiles(), b=st.sampled_from([1, 2, 4]))
def test_prefix_sum_memory_bounds_hold_with_kept_inputs(profile: Profile, b: int) -> None:
    """The solver's prefix-sum memory relaxations never exceed a stage's exact memory, also
    when kept inputs are negative (a stage input that is a slice of a larger tensor)."""
    from planner.bounds.knapsack import Knapsack
    from planner.cost import layer_costs
    from planner.search.model import StageModel
    from planner.search.space import Config

    costs = layer_costs(profile, b)
    knap = Knapsack.of(costs)
    sm = StageModel(costs, Config(1, 2, 4, "1f1b", 1), TrainingSetup(optimizer="sgd"))
    n = costs.num_layers
    for a in range(n):
        for e in range(a + 1, n + 1):
            exact = costs.stage_activation_bytes(a, e)
            work = sum(costs.forward_ms[a:e]) + sum(costs.backward_ms[a:e])
            assert knap.value(exact) >= work * (1 - 1e-9)
            for rc in (False, True):
                for r in (0, 1):
                    assert sm.memory_relaxed(a, e, rc, r) <= sm.memory(a, e, rc, r) * (1 + 1e-12) + 1e-6
