"""ZeRO-3 with recompute: a checkpointed layer's recompute does not wait on its parameter
all-gather again.  FSDP2 gathers a layer's parameters in its pre-backward hook, and its
pre-forward hook returns early during the backward (``TrainingState.PRE_BACKWARD`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``), so the re-run forward finds them
gathered.  The cost model once priced the recompute as the whole forward, gather included."""

from __future__ import annotations

import pytest

from planner.cost import Layout, estimate
from planner.cost.layers import layer_costs
from planner.mesh import Mesh, mesh_problem
from planner.schema import parse_document

#: 1 MB/s: a 1000-byte parameter gather (two ranks) takes 0.5 ms, beside a 10 ms forward
BW = 1e6


def _profile() -> object:
    return parse_document("profile", {
        "model": "m", "measured_on": {"device": "cpu"}, "microbatch_sizes": [1],
        "layers": [
            {"name": "embed", "param_bytes": 400, "forward_ms": [1], "backward_ms": [2],
             "activation_bytes": [100], "output_bytes": [100]},
            {"name": "block", "param_bytes": 1000, "forward_ms": [10], "backward_ms": [20],
             "activation_bytes": [800], "output_bytes": [100]},
        ],
    })


def _cluster() -> object:
    link = {"bandwidth_bytes_per_s": BW}
    return parse_document("cluster", {"devices": 2, "memory": "1GiB", "intra_node": link, "inter_node": link})


def _training() -> object:
    return parse_document("training", {"global_batch_size": 2, "zero_overlap": 0.0, "fused_optimizer": True})


def _plan(zero: int, recompute: bool) -> object:
    return estimate(_profile(), _cluster(), _training(), Layout(
        [(0, 2)], num_microbatches=1, schedule="gpipe", data_parallel=2, zero_stage=zero, recompute=recompute,
    ))


def test_the_recompute_skips_the_gather_that_the_forward_waits_for() -> None:
    plain, redo = _plan(3, False).stages[0], _plan(3, True).stages[0]
    # gathers of 400 and 1000 bytes over two ranks at 1 MB/s: 0.2 ms and 0.5 ms, nothing hidden
    assert plain.forward_ms == pytest.approx(11 + 0.2 + 0.5, rel=1e-6)
    # the recompute is the two layers' compute alone, 11 ms, and it is all the backward gains
    assert redo.recompute_time_ms == pytest.approx(11.0, rel=1e-9)
    assert redo.backward_ms - plain.backward_ms == pytest.approx(11.0, rel=1e-9)
    assert redo.forward_ms == pytest.approx(plain.forward_ms, rel=1e-12)


def test_without_a_gather_the_recompute_is_the_whole_forward() -> None:
    for zero in (0, 1, 2):
        stage = _plan(zero, True).stages[0]
        assert stage.recompute_time_ms == pytest.approx(stage.forward_ms, rel=1e-12), zero


def test_the_mesh_problem_writes_what_a_recompute_does_not_repeat() -> None:
    problem = mesh_problem(_profile(), _cluster(), _training(), Mesh(zero_stage=3), data_parallel=2,
                           pipeline_degree=1)
    skipped = [x.forward_not_recomputed_ms for x in problem.profile.layers]
    assert skipped[0] == pytest.approx([0.2], rel=1e-6) and skipped[1] == pytest.approx([0.5], rel=1e-6)
    costs = layer_costs(problem.profile, 1)
    assert costs.recompute_ms == pytest.approx((1.0, 10.0), rel=1e-9)
    assert costs.prefix_recompute[-1] == pytest.approx(11.0, rel=1e-9)
    # hidden behind its own compute, the gather adds nothing to skip
    hidden = _training().model_copy(update={"zero_overlap": 1.0})
    problem = mesh_problem(_profile(), _cluster(), hidden, Mesh(zero_stage=3), data_parallel=2, pipeline_degree=1)
    assert [x.forward_not_recomputed_ms for x in problem.profile.layers] == [[0.0], [0.0]]


def test_old_profiles_without_the_field_read_and_recompute_their_forward() -> None:
    costs = layer_costs(_profile(), 1)
    assert costs.recompute_ms == costs.forward_ms
    assert costs.prefix_recompute == costs.prefix_forward
