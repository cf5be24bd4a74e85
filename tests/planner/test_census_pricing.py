"""The operation census in the cost model: synth's census priced by the device model, tensor
parallelism scaled by it, and profiles without one still planned (with a note)."""

from __future__ import annotations

import pytest

from planner.cost import Layout, estimate
from planner.cost.compute import layer_times
from planner.mesh import Mesh, mesh_problem
from planner.schema import Cluster, Profile, TrainingSetup
from profiler.synth import synth_transformer


def _gpt() -> Profile:
    return synth_transformer(layers=4, hidden=2048, heads=16, seq=1024, vocab=32000, device_type="a100-80g",
                             microbatch_sizes=(1, 2))


def _without_census(profile: Profile) -> Profile:
    return profile.model_copy(update={"layers": [x.model_copy(update={"operations": None}) for x in profile.layers]})


def test_synth_times_are_its_census_priced_by_the_device_model() -> None:
    prof = _gpt()
    block = prof.layers[1]
    assert block.operations is not None and len(block.operations) == 2
    for b, ops in zip(prof.microbatch_sizes, block.operations, strict=True):
        times = layer_times(ops, device_type="a100-80g")
        assert block.forward_ms[prof.microbatch_sizes.index(b)] == pytest.approx(times.forward)
        # the four GEMMs' m is the micro-batch's tokens
        assert {op.m for op in ops if op.kind == "gemm"} == {b * 1024}


def test_tensor_parallelism_scales_a_census_by_the_device_model() -> None:
    """T = 8 on a block with h = 2048: its GEMMs are 8x narrower, the device model says they run
    less efficiently, so one device's share is more than 1/8 of the block (the flat model's is
    1 / (8 x 0.9)); the plan has no flat-scaling note."""
    prof = _gpt()
    cluster = Cluster.model_validate({"devices": 8, "device_type": "a100-80g"})
    training = TrainingSetup(global_batch_size=8)
    census = mesh_problem(prof, cluster, training, Mesh(tensor_parallel=8), data_parallel=1, pipeline_degree=1)
    flat = mesh_problem(_without_census(prof), cluster, training, Mesh(tensor_parallel=8), data_parallel=1,
                        pipeline_degree=1)
    whole, shard, flat_shard = prof.layers[1], census.profile.layers[1], flat.profile.layers[1]
    # compute only: the collectives are the same in both
    comm = flat_shard.forward_ms[0] - whole.forward_ms[0] / (8 * 0.9)
    ratio = (shard.forward_ms[0] - comm) / whole.forward_ms[0]
    assert 1 / 8 < ratio < 1
    assert ratio != pytest.approx(1 / (8 * 0.9), rel=1e-3)
    plan = estimate(prof, cluster, training, Layout([(0, 6)], num_microbatches=8, tensor_parallel=8))
    assert not any("flat tensor_parallel_efficiency" in n for n in plan.notes)


def test_a_profile_without_a_census_still_plans_with_a_note() -> None:
    """A profile from before schema version 4 (no operations) plans as before, and the plan's
    notes say which layers tensor parallelism scaled by the flat efficiency."""
    prof = _without_census(_gpt())
    cluster = Cluster.model_validate({"devices": 8, "device_type": "a100-80g"})
    plan = estimate(prof, cluster, TrainingSetup(global_batch_size=8),
                    Layout([(0, 6)], num_microbatches=8, tensor_parallel=8))
    assert any("flat tensor_parallel_efficiency" in n and "blocks.0" in n for n in plan.notes), plan.notes
    assert plan.predicted.step_time_ms > 0


def _one_gemm_layer(*, census: bool) -> Profile:
    """One layer measured on an A100 at micro-batch 1 and 2 (times are the measurement: 20 and
    30 us), whose forward is one bf16 GEMM of m = 128 x b tokens, n = 128, k = 1024."""
    from planner.schema import LayerProfile, MeasuredOn, Operation

    ops = [[Operation(kind="gemm", m=128 * b, n=128, k=1024)] for b in (1, 2)]
    layer = LayerProfile(name="l0", param_bytes=0, forward_ms=[0.020, 0.030], backward_ms=[0.040, 0.060],
                         activation_bytes=[100, 200], output_bytes=[10, 20], operations=ops if census else None)
    return Profile(model="m", measured_on=MeasuredOn(device="cuda", device_name="NVIDIA A100-SXM4-80GB"),
                   microbatch_sizes=[1, 2], layers=[layer])


def test_a_measured_layer_is_scaled_to_an_unmeasured_micro_batch_by_its_census_prices() -> None:
    """By hand: at micro-batch 4 the GEMM has m = 512, four 128 x 128 tiles where micro-batch 2
    had two; both fill less than one wave of the A100's 108 SMs, so the device model prices both
    the same (twice the FLOPs at twice the efficiency): the forward stays the 30 us measured at 2,
    where reading the measured line on gives 50 us.  Below the measured sizes nothing changes."""
    from planner.cost import layer_costs
    from planner.cost.layers import extrapolation_note

    priced = _one_gemm_layer(census=True)
    plain = _one_gemm_layer(census=False)
    assert layer_costs(priced, 4).forward_ms[0] == pytest.approx(0.030)
    assert layer_costs(plain, 4).forward_ms[0] == pytest.approx(0.050)
    for b in (1, 2):  # measured sizes keep their times
        assert layer_costs(priced, b).forward_ms == layer_costs(plain, b).forward_ms
    # never cheaper than the largest measured size, never dearer per sample
    costs = layer_costs(priced, 4)
    assert 0.060 <= costs.backward_ms[0] <= 0.060 * 2
    assert costs.input_ms[0] + costs.weight_ms[0] == pytest.approx(costs.backward_ms[0])
    note = extrapolation_note(priced, 4)
    assert note == ("micro-batch 4 is extrapolated from sizes up to 2 by the device model's prices of each "
                    "layer's operation census; profile with --microbatch-sizes 1,2,4 for a measured figure")
    linear = extrapolation_note(plain, 4)  # as before the census existed
    assert linear == "micro-batch 4 is extrapolated from sizes up to 2; profile with --microbatch-sizes 1,2,4 for a measured figure"
    assert extrapolation_note(priced, 2) is None


def test_extrapolated_synth_times_are_the_device_models_own() -> None:
    """A synth profile measured (priced) at 1 and 2, read at 4 through its census, is what synth
    writes at 4 (times there are the device model's price of the census at 4)."""
    from planner.cost import layer_costs

    small = _gpt()
    big = synth_transformer(layers=4, hidden=2048, heads=16, seq=1024, vocab=32000, device_type="a100-80g",
                            microbatch_sizes=(1, 2, 4))
    got, want = layer_costs(small, 4), layer_costs(big, 4)
    assert got.forward_ms == pytest.approx(want.forward_ms, rel=1e-9)
    assert got.backward_ms == pytest.approx(want.backward_ms, rel=1e-9)


def test_profiles_without_a_census_still_plan_at_an_unmeasured_size_with_a_note() -> None:
    cluster = Cluster.model_validate({"devices": 1, "memory": "1GiB"})
    training = TrainingSetup(global_batch_size=8)
    for census, words in ((False, "extrapolated from sizes up to 2; profile"), (True, "device model's prices")):
        plan = estimate(_one_gemm_layer(census=census), cluster, training, Layout([(0, 1)], num_microbatches=2))
        assert plan.microbatch_size == 4
        assert any(words in n for n in plan.notes), plan.notes
        # the lower bound holds at the extrapolated size too
        assert plan.predicted.lower_bound_ms <= plan.predicted.step_time_ms + 1e-12


def test_extrapolated_tensor_parallel_times_are_the_device_models_own() -> None:
    """The same at T = 2 with sequence parallelism: one tensor-parallel rank's layers keep their
    shard's census, so a plan at micro-batch 4 of the profile priced at 1 and 2 predicts the step
    of the profile priced at 1, 2 and 4 (it was extrapolated linearly: 0.46 % slower here); within
    0.1 %: the ratio of the shard's compute also scales its collectives, which grow as b does."""
    small = _gpt()
    big = synth_transformer(layers=4, hidden=2048, heads=16, seq=1024, vocab=32000, device_type="a100-80g",
                            microbatch_sizes=(1, 2, 4))
    cluster = Cluster.model_validate({"devices": 4, "device_type": "a100-80g"})
    training = TrainingSetup(global_batch_size=16)
    layout = Layout([(0, small.num_layers)], num_microbatches=2, data_parallel=2, tensor_parallel=2,
                    sequence_parallel=True)
    got, want = estimate(small, cluster, training, layout), estimate(big, cluster, training, layout)
    assert got.microbatch_size == want.microbatch_size == 4
    assert got.predicted.step_time_ms == pytest.approx(want.predicted.step_time_ms, rel=1e-3)
    assert not any("linear" in n for n in got.notes), got.notes
