"""The plan's per-axis communication per step (``Predicted.tensor_parallel_ms``, ``zero_ms``,
``pipeline_transfer_ms``), against values computed by hand and against what the simulator
charges for the same plan (the step time with and without the axis's collectives)."""

from __future__ import annotations

import json

import pytest

from planner.cost import Layout, estimate, pipeline_transfer_ms, reestimate
from planner.schema import parse_document
from tests.planner.test_mesh import BW, _cluster, _profile, _training

MS = 1e3  # seconds to ms


def _slow_cluster(n: int, bandwidth: float = 1e6) -> object:
    link = {"bandwidth_bytes_per_s": bandwidth}
    return parse_document("cluster", {"devices": n, "memory": "1GiB", "intra_node": link, "inter_node": link})


def test_pipeline_transfers_count_every_boundary_a_rank_touches() -> None:
    # a V placement of 4 stages on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    # (boundary 1 is inside rank 1); each micro-batch crosses a boundary twice (activation, gradient)
    assert pipeline_transfer_ms([1.0, 2.0, 3.0], [0, 1, 1, 0], 2) == pytest.approx(max(2 * 2 * (1 + 3), 2 * 2 * (1 + 2 + 3)))
    # a loop of 3 ranks: the middle one sends and receives across both boundaries
    assert pipeline_transfer_ms([0.5, 0.25], [0, 1, 2], 4) == pytest.approx(2 * 4 * 0.75)
    assert pipeline_transfer_ms([], [0], 8) == 0.0


@pytest.mark.parametrize("m", [1, 2])
def test_pipeline_transfers_by_hand_and_as_the_simulator_charges_them(m: int) -> None:
    # 100 bytes cross the cut at 1 MB/s: 0.1 ms each way, per micro-batch
    plan = estimate(
        _profile(), _slow_cluster(2), _training(batch=m),
        Layout(
            [(0, 1), (1, 2)],
            num_microbatches=m,
            schedule="gpipe",
        ),
    )  # fmt: skip
    tau = 100 / 1e6 * MS
    assert plan.stages[0].send_ms == pytest.approx(tau)
    assert plan.predicted.pipeline_transfer_ms == pytest.approx(2 * m * tau)
    assert plan.predicted.tensor_parallel_ms == 0.0 and plan.predicted.zero_ms == 0.0
    if m == 1:  # F0, send, F1, B1, send back, B0: the simulator waits for both transfers
        compute = (1 + 2) + (10 + 20)
        assert plan.predicted.step_time_ms - compute == pytest.approx(plan.predicted.pipeline_transfer_ms)


def test_tensor_parallel_collectives_by_hand_and_as_the_simulator_charges_them() -> None:
    # the block at T = 2: forward all-reduces 2(T-1)/T x 1 MB = 1 ms, backward 2 ms, per micro-batch
    one = estimate(
        _profile(), _cluster(), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
        ),
    )  # fmt: skip
    assert one.predicted.tensor_parallel_ms == pytest.approx(1 + 2)
    # the same plan without the collectives' bytes: the step is shorter by exactly them
    quiet = _profile(tp_forward_bytes=[0], tp_backward_bytes=[0])
    none = estimate(
        quiet, _cluster(), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
        ),
    )  # fmt: skip
    assert none.predicted.tensor_parallel_ms == 0.0
    assert one.predicted.step_time_ms - none.predicted.step_time_ms == pytest.approx(one.predicted.tensor_parallel_ms)
    # two stages, 2 micro-batches, the block's stage recomputes: its forward's all-reduce runs again
    two = estimate(
        _profile(), _cluster(), _training(batch=2),
        Layout(
            [(0, 1), (1, 2)],
            num_microbatches=2,
            schedule="gpipe",
            tensor_parallel=2,
            recompute=[False, True],
        ),
    )  # fmt: skip
    assert two.predicted.tensor_parallel_ms == pytest.approx(2 * (2 * 1 + 2))
    assert two.predicted.pipeline_transfer_ms == pytest.approx(2 * 2 * 100 / BW * MS)  # the cut moves 100 bytes


@pytest.mark.parametrize(("zero", "per_byte"), [(0, 0), (1, 0), (2, 1), (3, 3)])
def test_zero_collectives_by_hand_and_as_the_simulator_charges_them(zero: int, per_byte: int) -> None:
    # D = 2, 1,400 parameter bytes: a reduce-scatter or all-gather moves (D-1)/D x 1,400 bytes;
    # ZeRO 2 reduce-scatters every micro-batch, ZeRO 3 also all-gathers before F and B
    plan = estimate(
        _profile(), _cluster(2), _training(batch=2, zero_overlap=0.0),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            data_parallel=2,
            zero_stage=zero,
        ),
    )  # fmt: skip
    half = 1400 / 2 / BW * MS
    assert plan.predicted.zero_ms == pytest.approx(per_byte * half)
    compute = (1 + 2) + (10 + 20)
    # nothing overlapped: the step is compute, ZeRO's collectives, then the collective after the step
    assert plan.predicted.step_time_ms - compute - plan.predicted.allreduce_ms == pytest.approx(plan.predicted.zero_ms)


def test_zero_collectives_over_micro_batches_recompute_and_tensor_parallel_shards() -> None:
    # ZeRO 3, D = 2, T = 2, 3 micro-batches; the block holds 400 + 1000 / 2 = 900 parameter bytes
    # per tensor-parallel rank, and recomputes: all-gathers before F and before B (not before
    # the recomputed F: FSDP2 gathers before the backward, and the recompute finds them gathered)
    plan = estimate(
        _profile(), _cluster(4), _training(batch=6),
        Layout(
            [(0, 2)],
            num_microbatches=3,
            schedule="gpipe",
            data_parallel=2,
            tensor_parallel=2,
            zero_stage=3,
            recompute=True,
        ),
    )  # fmt: skip
    half = 900 / 2 / BW * MS
    assert plan.predicted.zero_ms == pytest.approx(3 * (1 + 2) * half)
    assert plan.predicted.tensor_parallel_ms == pytest.approx(3 * (2 * 1 + 2))


def test_old_plans_load_without_the_axis_figures_and_new_ones_round_trip() -> None:
    plan = estimate(
        _profile(), _cluster(), _training(batch=2),
        Layout(
            [(0, 1), (1, 2)],
            num_microbatches=2,
            schedule="gpipe",
            tensor_parallel=2,
        ),
    )  # fmt: skip
    doc = json.loads(plan.model_dump_json())
    assert parse_document("plan", doc) == plan
    again = reestimate(plan, _profile())
    assert again.predicted.tensor_parallel_ms == pytest.approx(plan.predicted.tensor_parallel_ms)
    assert again.predicted.pipeline_transfer_ms == pytest.approx(plan.predicted.pipeline_transfer_ms)
    for key in ("tensor_parallel_ms", "zero_ms", "pipeline_transfer_ms"):
        del doc["predicted"][key]
    old = parse_document("plan", doc)
    assert old.predicted.tensor_parallel_ms is None and old.predicted.zero_ms is None
    assert old.predicted.pipeline_transfer_ms is None
