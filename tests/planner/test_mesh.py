"""The mesh axes in the cost model (planner/mesh.py): tensor parallelism, sequence parallelism
and ZeRO, against small cases computed by hand."""

from __future__ import annotations

import json

import pytest

from planner.cost import Layout, estimate, reestimate
from planner.errors import InputError
from planner.schema import parse_document

BW = 1e9  # bytes/s on every link, no latency: 1 MB = 1 ms


def _profile(**block: object) -> object:
    layer = {
        "name": "block", "param_bytes": 1000, "forward_ms": [10], "backward_ms": [20], "activation_bytes": [800],
        "output_bytes": [100], "tensor_parallel": "block", "tp_compute_fraction": 0.5,
        "tp_forward_bytes": [1_000_000], "tp_backward_bytes": [2_000_000], "tp_replicated_activation_bytes": [200],
    }
    layer.update(block)
    return parse_document("profile", {
        "model": "m", "measured_on": {"device": "cpu"}, "microbatch_sizes": [1],
        "layers": [
            {"name": "embed", "param_bytes": 400, "forward_ms": [1], "backward_ms": [2], "activation_bytes": [100],
             "output_bytes": [100]},
            layer,
        ],
    })


def _cluster(n: int = 4, per_node: int | None = None) -> object:
    link = {"bandwidth_bytes_per_s": BW}
    return parse_document("cluster", {"devices": n, "memory": "1GiB", "devices_per_node": per_node or n,
                                      "intra_node": link, "inter_node": link})


def _training(batch: int = 1, **extra: object) -> object:
    # fused optimizer kernels unless a test says otherwise: the hand-computed peaks below are the
    # walk's (the step's temporaries, larger than these tiny activations, have their own test)
    return parse_document(
        "training", {"global_batch_size": batch, "tensor_parallel_efficiency": 1.0, "fused_optimizer": True, **extra}
    )


def test_tensor_parallel_time_and_memory_by_hand() -> None:
    # block at T=2: time x (0.5 / 2 + 0.5) = 0.75, plus its all-reduces: 2(T-1)/T x 1 MB = 1 ms
    # forward, 2 ms backward; the embedding is replicated (full time and memory)
    plan = estimate(
        _profile(), _cluster(), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
        ),
    )
    assert plan.predicted.step_time_ms == pytest.approx(1 + 2 + (7.5 + 1) + (15 + 2))
    # params 400 + 1000/2 = 900, x (1 + 1 + 2) for adam; activations 100 + 200 + 600/2
    assert plan.stages[0].param_bytes == 900
    assert plan.stages[0].memory_bytes == 900 * 4 + 100 + 200 + 300
    assert plan.world_size == 2 and plan.tensor_parallel_degree == 2
    assert any("embed" in n and "replicated" in n for n in plan.notes)


def test_sequence_parallel_shards_the_rest() -> None:
    # with SP the non-matmul half divides by T too (0.5/2 + 0.5/2), and every activation byte
    plan = estimate(
        _profile(), _cluster(), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
            sequence_parallel=True,
        ),
    )
    assert plan.predicted.step_time_ms == pytest.approx(1 + 2 + (5 + 1) + (10 + 2))
    assert plan.stages[0].memory_bytes == 900 * 4 + 100 + 400
    assert plan.sequence_parallel


def test_efficiency_factor_and_cut_bytes() -> None:
    # efficiency 0.5 at T=2: the sharded half takes 0.5 / (2 x 0.5) = 0.5 of the time (no gain)
    plan = estimate(
        _profile(), _cluster(), _training(tensor_parallel_efficiency=0.5),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
        ),
    )
    assert plan.stages[0].forward_ms == pytest.approx(1 + 10 + 1)
    # two stages at T=2 on 4 devices: the cut after embed moves 100 bytes (whole without SP, /2 with)
    two = estimate(
        _profile(), _cluster(), _training(),
        Layout(
            [(0, 1), (1, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
        ),
    )
    assert [s.devices for s in two.stages] == [[0], [2]] and two.world_size == 4
    assert two.stages[0].send_ms == pytest.approx(100 / BW * 1e3)
    sp = estimate(
        _profile(), _cluster(), _training(),
        Layout(
            [(0, 1), (1, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
            sequence_parallel=True,
        ),
    )
    assert sp.stages[0].send_ms == pytest.approx(two.stages[0].send_ms)  # embed is replicated: its output is whole


@pytest.mark.parametrize(("zero", "static", "collected"), [
    (0, 4.0, 1.0), (1, 1 + 1 + 2 / 2, 1.0), (2, 1 + 1 / 2 + 2 / 2, 0.5), (3, 1 / 2 + 1 / 2 + 2 / 2, 0.0),
])
def test_zero_memory_and_collective_by_hand(zero: int, static: float, collected: float) -> None:
    # D=2 replicas, adam (2 bytes of state per parameter byte), 1,400 parameter bytes
    plan = estimate(
        _profile(), _cluster(2), _training(batch=2, zero_overlap=0.0),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            data_parallel=2,
            zero_stage=zero,
        ),
    )
    acts = 100 + 800
    gathered = 2 * 1000 if zero == 3 else 0  # the running and the prefetched layer's parameters
    assert plan.stages[0].memory_bytes == pytest.approx(1400 * static + acts + gathered, abs=2)
    # after the step: a ring all-reduce moves 2(D-1)/D x bytes = 1 x bytes here (z2: the all-gather only)
    assert plan.predicted.allreduce_ms == pytest.approx(1400 * collected / BW * 1e3)
    # per micro-batch: z2 reduce-scatters the gradients (W), z3 also all-gathers before F and B
    rs = 1400 / 2 / BW * 1e3
    compute = 1 + 2 + 10 + 20
    extra = {0: 0.0, 1: 0.0, 2: rs, 3: 3 * rs}[zero]
    assert plan.predicted.step_time_ms == pytest.approx(compute + extra + plan.predicted.allreduce_ms)
    assert plan.zero_stage == zero


def test_zero_overlap_hides_behind_compute() -> None:
    slow = {"bandwidth_bytes_per_s": 1e6}
    cluster = parse_document("cluster", {"devices": 2, "memory": "1GiB", "intra_node": slow, "inter_node": slow})
    times = []
    for overlap in (0.0, 1.0):
        plan = estimate(
            _profile(), cluster, _training(batch=2, zero_overlap=overlap),
            Layout(
                [(0, 2)],
                num_microbatches=1,
                schedule="gpipe",
                data_parallel=2,
                zero_stage=3,
            ),
        )
        times.append(plan.predicted.step_time_ms)
    # block: all-gather 1000/2 bytes at 1 MB/s = 0.5 ms, hidden behind its 10 ms forward when overlapped
    assert times[0] - times[1] == pytest.approx(2 * 0.5 + 0.5 + 3 * 0.2, rel=1e-6)


def test_plans_round_trip_and_reestimate() -> None:
    plan = estimate(
        _profile(), _cluster(), _training(batch=2),
        Layout(
            [(0, 1), (1, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
            zero_stage=0,
            sequence_parallel=True,
        ),
    )
    back = parse_document("plan", json.loads(plan.model_dump_json()))
    assert back == plan
    again = reestimate(back, _profile())
    assert again.predicted.step_time_ms == pytest.approx(plan.predicted.step_time_ms)
    assert again.tensor_parallel_degree == 2 and again.sequence_parallel


def test_mesh_errors_name_the_fix() -> None:
    with pytest.raises(InputError, match="devices per node"):
        estimate(
            _profile(), _cluster(4, per_node=2), _training(),
            Layout(
                [(0, 2)],
                num_microbatches=1,
                tensor_parallel=4,
            ),
        )
    with pytest.raises(InputError, match="needs --tensor-parallel"):
        estimate(
            _profile(), _cluster(), _training(),
            Layout(
                [(0, 2)],
                num_microbatches=1,
                sequence_parallel=True,
            ),
        )
    with pytest.raises(InputError, match="x tensor-parallel degree 2 = 6 devices"):
        estimate(
            _profile(), _cluster(4), _training(batch=3),
            Layout(
                [(0, 2)],
                num_microbatches=1,
                data_parallel=3,
                tensor_parallel=2,
            ),
        )


def test_dtype_rescaling_keeps_the_tensor_parallel_split() -> None:
    # a bf16 profile planned in bf16: parameters become fp32 masters (x2), and the part that shards
    # must follow, or half of every weight would look replicated
    from profiler.synth import synth_transformer

    profile = synth_transformer(layers=2, hidden=256, heads=4, seq=128, vocab=512, device_type="a100-80g",
                                dtype="bfloat16", microbatch_sizes=(1,))
    cl = parse_document("cluster", {"devices": 2, "device_type": "a100-80g"})
    training = parse_document("training", {"global_batch_size": 1, "dtype": "bf16"})
    one = estimate(profile, cl, training, Layout([(0, 4)], num_microbatches=1))
    two = estimate(profile, cl, training, Layout([(0, 4)], num_microbatches=1, tensor_parallel=2))
    replicated = sum(x.param_bytes - (x.tp_param_bytes or 0) for x in profile.layers) * 2
    assert two.stages[0].param_bytes == pytest.approx((one.stages[0].param_bytes + replicated) / 2, abs=4)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_synth_block_activations_follow_korthikanti(t: int) -> None:
    # Korthikanti et al. 2022: per block, with tensor parallelism t, s·b·h·(10 + 24/t + 5as/(ht))
    # bytes (16-bit, dropout); with sequence parallelism too, s·b·h/t·(34 + 5as/h)
    from planner.mesh import Mesh, mesh_problem
    from profiler.synth import synth_transformer

    s_, h, a = 256, 512, 8
    profile = synth_transformer(layers=1, hidden=h, heads=a, seq=s_, vocab=1024, device_type="a100-80g",
                                dtype="bfloat16", microbatch_sizes=(1,), attention="materialized")
    cl = parse_document("cluster", {"devices": 8, "device_type": "a100-80g"})
    training = parse_document("training", {"global_batch_size": 1})
    sbh = s_ * h
    for sp, expect in ((False, sbh * (10 + 24 / t + 5 * a * s_ / (h * t))), (True, sbh / t * (34 + 5 * a * s_ / h))):
        block = mesh_problem(profile, cl, training, Mesh(t, 0, sp), data_parallel=1).profile.layers[1]
        assert block.activation_bytes[0] == pytest.approx(expect, abs=2)
        # each forward all-reduces the attention and the MLP outputs: 2 x s·b·h·2 bytes
        assert profile.layers[1].tp_forward_bytes == [2 * sbh * 2]


def test_selective_recompute_by_hand() -> None:
    # the block drops 300 of its 800 activation bytes and recomputes them for 4 ms in its backward
    prof = _profile(selective_recompute_bytes=[300], selective_recompute_ms=[4.0])
    base = estimate(
        prof, _cluster(1), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
        ),
    )
    sel = estimate(
        prof, _cluster(1), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            selective_recompute=True,
        ),
    )
    assert sel.selective_recompute and not base.selective_recompute
    assert base.stages[0].memory_bytes - sel.stages[0].memory_bytes == 300
    assert sel.stages[0].backward_ms == pytest.approx(base.stages[0].backward_ms + 4.0)
    # the recompute comes before the input gradient: I grows, W does not
    assert sel.stages[0].backward_input_ms == pytest.approx(base.stages[0].backward_input_ms + 4.0)
    assert sel.stages[0].backward_weight_ms == pytest.approx(base.stages[0].backward_weight_ms)
    assert sel.predicted.step_time_ms == pytest.approx(base.predicted.step_time_ms + 4.0)
    # under T=2 the dropped bytes and their recompute divide like the rest of attention
    tp = estimate(
        prof, _cluster(2), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
            selective_recompute=True,
        ),
    )
    tp0 = estimate(
        prof, _cluster(2), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            tensor_parallel=2,
        ),
    )
    assert tp0.stages[0].memory_bytes - tp.stages[0].memory_bytes == 150
    assert tp.stages[0].backward_ms == pytest.approx(tp0.stages[0].backward_ms + 4.0 * 0.5 / 2)
    back = parse_document("plan", json.loads(sel.model_dump_json()))
    assert reestimate(back, prof).predicted.step_time_ms == pytest.approx(sel.predicted.step_time_ms)


def test_selective_recompute_errors_name_the_fix() -> None:
    with pytest.raises(InputError, match="selective_recompute_bytes"):
        estimate(
            _profile(), _cluster(1), _training(),
            Layout(
                [(0, 2)],
                num_microbatches=1,
                selective_recompute=True,
            ),
        )
    prof = _profile(selective_recompute_bytes=[300], selective_recompute_ms=[4.0])
    with pytest.raises(InputError, match="exclude each other"):
        estimate(
            prof, _cluster(1), _training(),
            Layout(
                [(0, 2)],
                num_microbatches=1,
                selective_recompute=True,
                recompute=True,
            ),
        )
    plan = estimate(
        prof, _cluster(1), _training(),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            recompute=True,
        ),
    )
    bad = json.loads(plan.model_dump_json()) | {"selective_recompute": True}
    with pytest.raises(InputError, match="exclude each other"):
        parse_document("plan", bad)


def test_gradient_overlap_hides_its_share_of_the_collective() -> None:
    # D=2 on a 1 GB/s link: the all-reduce of 1,400 gradient bytes takes 1.4e-3 ms; half of it
    # overlaps the last backward, so half adds to the step; the plan still reports all of it
    plans = [estimate(
        _profile(), _cluster(2), _training(batch=2, gradient_overlap=w),
        Layout(
            [(0, 2)],
            num_microbatches=1,
            schedule="gpipe",
            data_parallel=2,
        ),
    ) for w in (0.0, 0.5)]
    ar = 1400 / BW * 1e3
    assert plans[0].predicted.allreduce_ms == pytest.approx(ar) == plans[1].predicted.allreduce_ms
    assert plans[0].predicted.step_time_ms - plans[1].predicted.step_time_ms == pytest.approx(ar / 2)
    with pytest.raises(Exception, match="less than 1"):
        _training(gradient_overlap=1.0)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_collectives_on_a_ring_across_two_nodes_by_hand(zero: int) -> None:
    """D = 4 replicas on two nodes of two devices (NVLink 100 GB/s inside, two 10 GB/s NICs per
    node, no latency): one ring through both nodes, each node's two NICs carrying it: bus
    bandwidth min(100, 2 x 10) = 20 GB/s.  By hand, per micro-batch (M = 2 here) and layer of P
    parameter bytes (embed 400, block 1000): a reduce-scatter or an all-gather moves 3/4 x P /
    20e9 s.  ZeRO-1 reduces once per step (as an all-reduce, 2 x 3/4 x 1400 / 20e9); ZeRO-2 adds a
    reduce-scatter per micro-batch and keeps the after-step all-gather; ZeRO-3 gathers before the
    forward and again before the backward (FSDP2 reshard_after_forward, DeepSpeed stage 3), and
    nothing after the step."""
    fast, nic = {"bandwidth_bytes_per_s": 100e9}, {"bandwidth_bytes_per_s": 10e9}
    cluster = parse_document("cluster", {"devices": 4, "memory": "1GiB", "devices_per_node": 2, "nics_per_node": 2,
                                         "intra_node": fast, "inter_node": nic})
    plan = estimate(_profile(), cluster, _training(batch=8, zero_overlap=0.0),
                    Layout([(0, 2)], num_microbatches=2, schedule="gpipe", data_parallel=4, zero_stage=zero))
    half = 3 / 4 / 20e9 * 1e3  # ms per byte of one reduce-scatter or all-gather
    per_microbatch = {1: 0.0, 2: 1400 * half, 3: 3 * 1400 * half}[zero]
    assert plan.predicted.zero_ms == pytest.approx(2 * per_microbatch)
    after = {1: 2 * 1400 * half, 2: 1400 * half, 3: 0.0}[zero]
    assert plan.predicted.allreduce_ms == pytest.approx(after)
    # nothing hides them (zero_overlap 0, the all-reduce after the last backward): the step is
    # the compute (M = 2 micro-batches of 33 ms, micro-batch 1) plus all of them
    compute = 2 * (1 + 2 + 10 + 20)
    assert plan.predicted.step_time_ms == pytest.approx(compute + 2 * per_microbatch + after)


@pytest.mark.parametrize(("t", "sp", "zero", "c"), [(2, False, 0, 1), (4, True, 3, 1), (2, True, 1, 4), (1, False, 2, 2)])
def test_identical_blocks_are_worked_out_once_with_the_same_result(t: int, sp: bool, zero: int, c: int) -> None:
    """mesh_problem works out a stack's identical blocks once (planner.mesh.same_layers): the
    result equals the one worked out block by block (the blocks told apart by their
    informational ``kind`` only), names kept."""
    from planner.cost import profile_in_dtype
    from planner.mesh import Mesh, mesh_problem, same_layers
    from planner.schema import Cluster, TrainingSetup
    from profiler.decoder import DecoderSpec
    from profiler.synth import synth_decoder

    spec = DecoderSpec(layers=4, hidden=1024, heads=16, kv_heads=4, seq=2048, vocab=32000, gated_mlp=True,
                       ffn=2816, norm="rmsnorm", bias=False, positions="rotary", dropout=False)
    profile = profile_in_dtype(synth_decoder(spec, microbatch_sizes=(1, 2)), "bfloat16")
    first = same_layers(profile.layers)
    assert first == [0, 1, 1, 1, 1, 5]  # embedding, four equal blocks, head
    apart = profile.model_copy(update={"layers": [
        x.model_copy(update={"kind": f"{x.kind}-{i}"}) for i, x in enumerate(profile.layers)]})
    assert same_layers(apart.layers) == list(range(6))
    # a difference deep inside (one operation's count) tells layers apart too
    ops = profile.layers[2].operations
    assert ops is not None
    changed = [[o.model_copy(update={"count": o.count + 1}) if j == 0 else o for j, o in enumerate(size)]
               for size in ops]
    odd = profile.model_copy(update={"layers": [
        x.model_copy(update={"operations": changed}) if i == 2 else x for i, x in enumerate(profile.layers)]})
    assert same_layers(odd.layers) == [0, 1, 2, 1, 1, 5]
    cluster = Cluster.model_validate({"devices": 64, "device_type": "h100-80g"})
    training = TrainingSetup(global_batch_size=64, optimizer="adam", dtype="bfloat16")
    mesh = Mesh(t, zero, sp, context_parallel=c)
    once = mesh_problem(profile, cluster, training, mesh, data_parallel=4, pipeline_degree=4)
    each = mesh_problem(apart, cluster, training, mesh, data_parallel=4, pipeline_degree=4)
    assert [x.name for x in once.profile.layers] == [x.name for x in profile.layers]
    for a, b in zip(once.profile.layers, each.profile.layers, strict=True):
        assert a.model_dump(exclude={"kind"}) == b.model_dump(exclude={"kind"})
    assert once.param_bytes == each.param_bytes and once.gathered_bytes == each.gathered_bytes
    assert once.cluster == each.cluster and once.training == each.training
