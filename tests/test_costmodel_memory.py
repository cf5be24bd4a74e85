"""The cost model's activation memory: what a stage keeps, its own inputs included."""

from __future__ import annotations

import pytest

from planner.cost import Layout, estimate, layer_costs, rank_memory_bytes
from planner.schedules import memory_points, schedule_actions
from planner.schema import (
    KeptInput,
    LayerProfile,
    MeasuredOn,
    Profile,
    TrainingSetup,
    parse_document,
)


def _profile(kept: dict[int, list[KeptInput]]) -> Profile:
    return Profile(
        model="m",
        measured_on=MeasuredOn(device="cpu"),
        microbatch_sizes=[1, 2],
        layers=[
            LayerProfile(name=f"l{i}", param_bytes=0, forward_ms=[1, 2], backward_ms=[2, 4],
                         activation_bytes=[100, 200], output_bytes=[10, 20], kept_inputs=kept.get(i))
            for i in range(4)
        ],
    )


def test_a_stage_keeps_its_inputs_once_it_reaches_the_layer_that_saves_them() -> None:
    # layer 1's input is saved first by layer 0 and again by layer 1 (offset 0) and by layer 2
    # (offset 1, a second input); layer 3 receives a slice of a larger tensor (negative)
    kept = {1: [KeptInput(offset=0, bytes=[10, 20]), KeptInput(offset=1, bytes=[5, 10])], 3: [KeptInput(offset=0, bytes=[-30, -60])]}
    costs = layer_costs(_profile(kept), 2)
    assert costs.stage_activation_bytes(0, 4) == 800  # from the start: every tensor once
    assert costs.stage_activation_bytes(1, 2) == 200 + 20
    assert costs.stage_activation_bytes(1, 3) == 400 + 20 + 10
    assert costs.stage_activation_bytes(2, 4) == 400  # nothing kept at layer 2
    assert costs.stage_activation_bytes(3, 4) == 200 - 60
    assert layer_costs(_profile(kept), 3).stage_activation_bytes(1, 3) == pytest.approx(600 + 30 + 15)  # extrapolated
    training = TrainingSetup(global_batch_size=4)
    gpipe_two = memory_points(schedule_actions("gpipe", 1, 2), [[0]])[0]  # both micro-batches held at once
    assert rank_memory_bytes(costs, [(1, 3)], [False], training, points=gpipe_two) == 2 * 430


def test_plans_count_the_kept_inputs() -> None:
    cluster = parse_document("cluster", {"devices": 2, "memory": "1GiB"})
    training = parse_document("training", {"global_batch_size": 4, "optimizer": "sgd"})
    plain = estimate(
        _profile({}), cluster, training,
        Layout(
            [(0, 2), (2, 4)],
            num_microbatches=2,
            schedule="gpipe",
        ),
    )
    more = estimate(
        _profile({2: [KeptInput(offset=0, bytes=[50, 100])]}), cluster, training,
        Layout(
            [(0, 2), (2, 4)],
            num_microbatches=2,
            schedule="gpipe",
        ),
    )  # fmt: skip
    assert more.stages[1].memory_bytes == plain.stages[1].memory_bytes + 2 * 100
    assert more.stages[0].memory_bytes == plain.stages[0].memory_bytes


def _big_profile() -> Profile:
    """Four layers of 1 GiB of parameters and 2 GiB of activations per sample (bytes a GPU feels)."""
    gib = 2**30
    return Profile(
        model="m",
        measured_on=MeasuredOn(device="cpu"),
        microbatch_sizes=[1, 2],
        layers=[
            LayerProfile(name=f"l{i}", param_bytes=gib, forward_ms=[1, 2], backward_ms=[2, 4],
                         activation_bytes=[2 * gib, 4 * gib], output_bytes=[10, 20])
            for i in range(4)
        ],
    )


def test_usable_bytes_is_the_stricter_of_the_margin_and_the_context_with_fragmentation() -> None:
    from planner.cost import outside_allocator, usable_bytes
    from planner.schema import Device

    dev = Device(memory_bytes=1000, context_bytes=100, fragmentation=0.1)
    # (1000 - 100) x 0.9 = 810 bytes for tensors: 810 / 0.9 = 900 reserved + 100 of context = 1000
    assert usable_bytes(dev, TrainingSetup(memory_margin=0.0)) == 810
    assert usable_bytes(dev, TrainingSetup(memory_margin=0.25)) == 750  # the margin is stricter
    assert outside_allocator(810, dev) == (100, 90)  # 810 x 0.1 / 0.9
    plain = Device(memory_bytes=1000)
    assert usable_bytes(plain, TrainingSetup(memory_margin=0.0)) == 1000
    assert outside_allocator(810, plain) == (0, 0)


def test_gpu_presets_show_the_context_and_fragmentation_and_cpu_presets_have_none() -> None:
    from planner.presets import ALLOCATOR_FRAGMENTATION, CUDA_CONTEXT_BYTES, DEVICES

    training = parse_document("training", {"global_batch_size": 2, "optimizer": "sgd", "memory_margin": 0.0})
    layout = Layout([(0, 2), (2, 4)], num_microbatches=2, schedule="gpipe")  # micro-batch 1
    gpu = estimate(_big_profile(), parse_document("cluster", {"devices": 2, "device_type": "h100-80g"}), training, layout)
    cpu = estimate(_big_profile(), parse_document("cluster", {"devices": 2, "device_type": "cpu"}), training, layout)
    for plan in (gpu, cpu):
        st = plan.stages[0]
        assert st.memory_parts is not None
        # 2 GiB of parameters and gradients, two micro-batches of 2 layers x 2 GiB held by GPipe
        assert st.memory_bytes == (2 + 2 + 2 * 2 * 2) * 2**30
    f = ALLOCATOR_FRAGMENTATION
    parts = gpu.stages[0].memory_parts
    assert parts is not None and parts.context == CUDA_CONTEXT_BYTES > 0 and 0 < f < 1
    assert parts.fragmentation == pytest.approx(12 * 2**30 * f / (1 - f), abs=1)
    assert gpu.stages[0].device_bytes == gpu.stages[0].memory_bytes + parts.context + parts.fragmentation
    # margin 0: the limit leaves room for the context and the fragmentation, not the whole device
    memory = DEVICES["h100-80g"].memory_bytes
    assert gpu.stages[0].memory_limit_bytes == int((memory - CUDA_CONTEXT_BYTES) * (1 - f))
    cparts = cpu.stages[0].memory_parts
    assert cparts is not None and cparts.context == cparts.fragmentation == 0
    assert cpu.stages[0].device_bytes == cpu.stages[0].memory_bytes
    assert cpu.stages[0].memory_limit_bytes == DEVICES["cpu"].memory_bytes
    # the same under a mesh (ZeRO-3: the gathered parameters are the allocator's too)
    zero = estimate(_big_profile(), parse_document("cluster", {"devices": 4, "device_type": "h100-80g"}), training,
                    Layout([(0, 2), (2, 4)], num_microbatches=1, schedule="gpipe", data_parallel=2, zero_stage=3))
    zp = zero.stages[0].memory_parts
    assert zp is not None and zp.gathered > 0 and zp.context == CUDA_CONTEXT_BYTES
    assert zp.fragmentation == pytest.approx(zero.stages[0].memory_bytes * f / (1 - f), abs=1)
    assert zero.stages[0].memory_limit_bytes == int((memory - CUDA_CONTEXT_BYTES) * (1 - f))


def test_cluster_files_override_the_presets_memory_outside_the_allocator() -> None:
    cluster = parse_document("cluster", {"devices": 2, "device_type": "a100-80g", "fragmentation": 0.2,
                                         "context_bytes": 0})
    assert cluster.devices[0].fragmentation == 0.2 and cluster.devices[0].context_bytes == 0
    old = {"devices": [{"name": "x", "memory_bytes": 100}], "devices_per_node": 1,
           "intra_node": "nvlink3", "inter_node": "ib-hdr"}
    read = parse_document("cluster", old)  # clusters written before these fields
    assert read.devices[0].context_bytes == 0 and read.devices[0].fragmentation == 0.0


def test_with_the_default_margin_every_preset_is_bound_by_the_margin() -> None:
    """With the default margin every preset's usable memory is its memory less the margin (the
    margin is stricter than the context and the fragmentation), so a preset whose context or
    fragmentation outgrew the margin fails here.  (The searches and the estimate share
    planner.cost.usable_bytes; a device given less memory than its preset's can be bound by the
    context instead: test_the_search_and_the_estimate_share_the_usable_memory.)"""
    from planner.cost import usable_bytes
    from planner.presets import DEVICES

    training = TrainingSetup()
    for name in DEVICES:
        dev = parse_document("cluster", {"devices": 1, "device_type": name}).devices[0]
        assert usable_bytes(dev, training) == int(dev.memory_bytes * (1 - training.memory_margin)), name


def test_the_search_and_the_estimate_share_the_usable_memory() -> None:
    """An a100-80g preset given 3 GiB: its CUDA context (about 1 GiB) and fragmentation bind,
    not the 10 % margin.  The search's device groups (also under tensor parallelism, whose
    virtual devices keep the context) and the diagnosis's memory sizes use the same usable bytes
    as the estimate: a plan the search accepts fits the estimate, and the memory the diagnosis
    names fits."""
    from planner.cost import Layout, estimate, plan_fits, usable_bytes
    from planner.errors import InfeasibleError
    from planner.infeasible import with_memory
    from planner.mesh import Mesh, mesh_problem
    from planner.schema import Cluster, PlanOptions
    from planner.search.space import make_groups
    from planner.solver import solve
    from profiler.synth import synth_transformer

    training = TrainingSetup(global_batch_size=16, optimizer="adam", dtype="bfloat16")
    cluster = Cluster.model_validate({"devices": 4, "memory": "3GiB", "device_type": "a100-80g"})
    dev = cluster.devices[0]
    assert usable_bytes(dev, training) < int(dev.memory_bytes * (1 - training.memory_margin))  # context binds
    assert make_groups(cluster, training, 1, 4)[0].limit_bytes == usable_bytes(dev, training)
    prof = synth_transformer(layers=8, hidden=2048, heads=16, seq=2048, vocab=32000, device_type="a100-80g",
                             microbatch_sizes=(1, 2))
    virtual = mesh_problem(prof, cluster, training, Mesh(2, 0, False), data_parallel=1, pipeline_degree=4).cluster
    assert (virtual.devices[0].context_bytes, virtual.devices[0].fragmentation) == (dev.context_bytes, dev.fragmentation)
    assert with_memory(cluster, 2**31).devices[0].context_bytes == dev.context_bytes
    options = PlanOptions(time_limit_s=1, tensor_parallel=2, sequence_parallel=False, selective_recompute=False,
                          zero_stage=0)
    with pytest.raises(InfeasibleError) as info:
        solve(prof, cluster, training, options)
    need = info.value.details["min_memory_bytes"]
    assert need > dev.memory_bytes  # (it named less than the 3 GiB that did not fit, before)
    plan = solve(prof, with_memory(cluster, need), training, options)
    assert plan_fits(plan) and plan.tensor_parallel_degree == 2
    assert plan_fits(estimate(prof, with_memory(cluster, need), training, Layout.of(plan)))
