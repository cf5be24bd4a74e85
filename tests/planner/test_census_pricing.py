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
