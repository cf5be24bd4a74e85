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
