"""The mesh search on long sequences: families ordered by what fits, context parallelism priced
once per distinct block, the interleaved chunks' recompute as Llama 3 chose it."""

from __future__ import annotations

import math

import pytest

from planner.context import context_layer
from planner.cost import profile_in_dtype
from planner.mesh import Mesh, mesh_problem, virtual_cluster
from planner.schema import Cluster, TrainingSetup
from planner.search.axes import _Family, _family_load, _promise
from profiler.decoder import DecoderSpec
from profiler.synth import synth_decoder

GiB = 2**30


def _long(seq: int = 131072) -> object:
    spec = DecoderSpec(layers=8, hidden=8192, heads=64, kv_heads=8, seq=seq, vocab=32000, gated_mlp=True,
                       ffn=28672, norm="rmsnorm", bias=False, positions="rotary", dropout=False)
    return profile_in_dtype(synth_decoder(spec, microbatch_sizes=(1,)), "bfloat16")


def test_a_family_whose_one_layer_cannot_fit_is_ordered_last() -> None:
    """At 128K tokens one block's activations alone exceed an A100-40GB at T = 1, C = 1: that
    family goes last (nothing of it fits); T = 8 with C = 8 goes first."""
    profile = _long()
    cluster = Cluster.model_validate({"devices": 512, "device_type": "a100-40g"})
    training = TrainingSetup(global_batch_size=64, optimizer="adam", dtype="bfloat16")
    plain, wide = _Family(1, False), _Family(8, True, False, 8)
    loads = {f: _family_load(profile, cluster, training, f) for f in (plain, wide)}
    usable = 40 * GiB * (1 - training.memory_margin)
    assert loads[plain].largest_activation > usable > loads[wide].largest_activation
    assert math.isinf(_promise(profile, cluster, training, plain, loads[plain]))
    assert math.isfinite(_promise(profile, cluster, training, wide, loads[wide]))
    # the work bound itself stays the valid one: T = 1's work is the least
    assert loads[plain].work < loads[wide].work


def test_context_parallelism_prices_identical_blocks_once_and_the_same() -> None:
    profile = _long(32768)
    cluster = Cluster.model_validate({"devices": 64, "device_type": "h100-80g"})
    training = TrainingSetup(global_batch_size=16, optimizer="adam", dtype="bfloat16")
    mesh = Mesh(tensor_parallel=2, sequence_parallel=True, context_parallel=4)
    problem = mesh_problem(profile, cluster, training, mesh, data_parallel=1, pipeline_degree=8)
    plain = mesh_problem(profile, cluster, training, Mesh(tensor_parallel=2, sequence_parallel=True),
                         data_parallel=1, pipeline_degree=8)
    alone = [
        context_layer(x, orig, 4, t=2, sequence_parallel=True, cluster=cluster, device="h100-80g")
        for x, orig in zip(plain.profile.layers, profile.layers, strict=True)
    ]
    assert problem.profile.layers == alone


def test_the_virtual_cluster_of_one_shared_device_is_the_per_device_one() -> None:
    shared = Cluster.model_validate({"devices": 64, "device_type": "h100-80g"})
    assert len({id(d) for d in shared.devices}) == 1
    distinct = shared.model_copy(update={"devices": [d.model_copy() for d in shared.devices]})
    assert len({id(d) for d in distinct.devices}) == 64 and distinct.homogeneous and shared.homogeneous
    for t, gathered in ((2, 0), (8, 3 * GiB)):
        assert virtual_cluster(shared, t, gathered_bytes=gathered, margin=0.1) == virtual_cluster(
            distinct, t, gathered_bytes=gathered, margin=0.1)
    mixed = distinct.model_copy(update={"devices": [*distinct.devices[:-1], distinct.devices[0].model_copy(
        update={"memory_bytes": GiB})]})
    assert not mixed.homogeneous


@pytest.mark.parametrize("e,zero", [(2, 0), (4, 1), (8, 0), (8, 2)])
def test_expert_replicas_are_the_fewest_stages_whose_state_fits_with_experts_sharded(e: int, zero: int) -> None:
    """The mesh search's first D for expert parallelism E: its stages hold the dense weights and
    1/E of the experts (ZeRO shards the optimizer state, then the gradients, over D); one stage
    fewer does not fit half a device; E divides D."""
    from planner.schema import LayerProfile, MeasuredOn, MoELayer, Profile
    from planner.search.axes import _expert_replicas

    layers = [LayerProfile(name=f"l{i}", param_bytes=2 * GiB, forward_ms=[1.0], backward_ms=[2.0],
                           activation_bytes=[2**20], output_bytes=[2**20], moe=MoELayer(experts=8, top_k=2, expert_param_bytes=GiB * 3 // 2,
                                                                   dispatch_bytes=[2**20]))
              for i in range(8)]
    profile = Profile(model="moe", measured_on=MeasuredOn(device="synthetic:h100-80g", dtype="bfloat16"),
                      microbatch_sizes=[1], layers=layers)
    cluster = Cluster.model_validate({"devices": 64, "memory": 16 * GiB, "intra_node": "nvlink4"})
    training = TrainingSetup(global_batch_size=64, optimizer="adam")
    fam = _Family(1, False)
    (d,) = _expert_replicas(profile, cluster, training, fam, e, zero=zero)
    assert d % e == 0 and 64 % d == 0
    usable = 16 * GiB * (1 - training.memory_margin) / 2

    def state(k: int, d: int) -> float:
        share = (8 * 2 * GiB - 8 * (3 * GiB // 2) + 8 * (3 * GiB // 2) / e) / k  # dense + experts / E
        grad, opt = training.gradient_bytes_per_param_byte, training.optimizer_state_factor
        return share * (1 + (grad / d if zero >= 2 else grad) + (opt / d if zero >= 1 else opt))

    k = 64 // d
    assert state(k, d) <= usable
    fewer = [j for j in range(1, k) if 64 % j == 0]
    assert all(state(j, 64 // j) > usable for j in fewer)


def test_the_relaxed_bound_keeps_a_shorthand_cluster_s_devices_one_shared_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The partial-recompute bound searches the cluster with unlimited memory: its copy of a
    16k-device shorthand cluster must stay one shared device object (16k distinct copies made
    every per-group cluster of the mesh search validate and compare 16k devices: seconds)."""
    from planner.limits import MAX_MEMORY_BYTES
    from planner.schema import PlanOptions
    from planner.search import partial

    seen = []

    def fake_search(profile, cluster, training, options, *, templates=None):  # type: ignore[no-untyped-def]
        seen.append(cluster)
        raise partial.InfeasibleError("stop here", {})

    monkeypatch.setattr(partial, "search", fake_search)
    cluster = Cluster.model_validate({"devices": 16384, "device_type": "h100-80g"})
    training = TrainingSetup(global_batch_size=128, optimizer="adam", dtype="bfloat16")
    assert partial.relaxed_bound(_long(), cluster, training, PlanOptions()) == 0.0
    (roomy,) = seen
    assert roomy.num_devices == 16384
    assert len({id(d) for d in roomy.devices}) == 1
    assert roomy.devices[0].memory_bytes == MAX_MEMORY_BYTES
    assert cluster.devices[0].memory_bytes < MAX_MEMORY_BYTES  # (the user's cluster untouched)
