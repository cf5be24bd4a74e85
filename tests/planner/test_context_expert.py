"""Context parallelism (axis C, planner/context.py) and expert parallelism (axis E,
planner/experts.py): time and memory against hand-computed cases, the plan's fields and flags,
the refusals, and the mesh search's bound against brute force with C and E fixed or free."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.context import context_group, context_layer, kv_bytes
from planner.cost import Layout, estimate, plan_fits
from planner.cost.collectives import all_gather_ms, all_to_all_ms, reduce_scatter_ms
from planner.errors import InfeasibleError, InputError
from planner.experts import expert_group, expert_layer
from planner.mesh import Mesh, mesh_problem
from planner.schema import (
    Cluster,
    LayerProfile,
    MeasuredOn,
    MoELayer,
    Operation,
    PlanOptions,
    Profile,
    TrainingSetup,
)
from planner.solver import solve
from tests.planner.helpers import MiB

SEQ, HEADS, KV, HD = 256, 8, 2, 64


def _cluster(n: int, memory: int = 80 * 1024 * MiB, per_node: int | None = None) -> Cluster:
    return Cluster.model_validate({"devices": n, "memory": memory, "intra_node": "nvlink4",
                                   "inter_node": "ib-hdr", "devices_per_node": per_node or n})


def _ops(b: int, *, expert: bool = False) -> list[Operation]:
    t = b * SEQ
    ops = [
        Operation(kind="gemm", m=t, n=1024, k=512, tp_shard="n"),
        Operation(kind="attention", batch=b, heads=HEADS, kv_heads=KV, query_len=SEQ, key_len=SEQ, head_dim=HD,
                  causal=True, tp_shard="heads"),
        Operation(kind="gemm", m=t, n=512, k=1024, tp_shard="k"),
        Operation(kind="memory", bytes=4 * t * 512),
    ]
    if expert:
        ops.append(Operation(kind="gemm", m=max(1, t // 4), n=512, k=512, count=8, expert=True))
    return ops


def _profile(seed: int, layers: int, *, moe: bool = False) -> Profile:
    rng = random.Random(seed)
    sizes = (1, 2)
    out = []
    for i in range(layers):
        f = rng.uniform(0.5, 3.0)
        act = rng.randint(1, 8) * MiB
        params = rng.randint(2, 24) * MiB
        is_moe = moe and i % 2 == 1
        extra: dict[str, object] = {}
        if is_moe:
            extra["moe"] = MoELayer(experts=8, top_k=2, expert_param_bytes=params // 2,
                                    dispatch_bytes=[b * SEQ * 2 * 512 * 2 for b in sizes])
        out.append(LayerProfile(
            name=f"l{i}", param_bytes=params, forward_ms=[f * b for b in sizes],
            backward_ms=[2 * f * b for b in sizes], backward_input_ms=[f * b for b in sizes],
            backward_weight_ms=[f * b for b in sizes], activation_bytes=[act * b for b in sizes],
            output_bytes=[MiB * b for b in sizes], operations=[_ops(b, expert=is_moe) for b in sizes],
            **extra,  # type: ignore[arg-type]
        ))
    return Profile(model=f"cp-{seed}", measured_on=MeasuredOn(device="synthetic:h100-80g", dtype="bfloat16"),
                   microbatch_sizes=list(sizes), layers=out)


# ----------------------------------------------------------------------------- hand-computed


def test_context_layer_by_hand() -> None:
    cl = _cluster(8)
    layer = _profile(0, 1).layers[0]
    out = context_layer(layer, layer, 2, t=1, sequence_parallel=False, cluster=cl, device=None)
    # K and V of the whole sequence: 2 x b x s x g x d x 2 bytes
    kv = [2 * b * SEQ * KV * HD * 2 for b in (1, 2)]
    assert [kv_bytes(ops, 1) for ops in layer.operations or []] == kv
    group = context_group(cl, 1, 2)
    for i in range(2):
        # without census pricing (device None): compute / C, plus the all-gather forward and the
        # reduce-scatter backward of K and V
        assert out.forward_ms[i] == pytest.approx(layer.forward_ms[i] / 2 + all_gather_ms(kv[i], group, cl))
        assert out.backward_input_ms[i] == pytest.approx(  # type: ignore[index]
            layer.backward_input_ms[i] / 2 + reduce_scatter_ms(kv[i], group, cl))  # type: ignore[index]
        assert out.backward_weight_ms[i] == pytest.approx(layer.backward_weight_ms[i] / 2)  # type: ignore[index]
        # activations / C, plus the gathered half of K and V kept for the backward
        assert out.activation_bytes[i] == math.ceil(layer.activation_bytes[i] / 2) + kv[i] // 2
        assert out.output_bytes[i] == layer.output_bytes[i] // 2
    assert out.param_bytes == layer.param_bytes
    # tensor parallelism shards the heads: a T-rank gathers 1/T of them
    assert kv_bytes(layer.operations[0], 2) == kv[0] // 2  # type: ignore[index]
    # the ring keeps nothing gathered and hides its pass behind attention (0 without pricing)
    ring = context_layer(layer, layer, 2, t=1, sequence_parallel=False, cluster=cl, device=None, mode="ring")
    assert ring.activation_bytes[0] == math.ceil(layer.activation_bytes[0] / 2)
    assert ring.forward_ms[0] == pytest.approx(layer.forward_ms[0] / 2 + all_gather_ms(kv[0], group, cl))
    priced_ring = context_layer(layer, layer, 2, t=1, sequence_parallel=False, cluster=cl, device="h100-80g",
                                mode="ring")
    priced_gather = context_layer(layer, layer, 2, t=1, sequence_parallel=False, cluster=cl, device="h100-80g")
    assert priced_ring.forward_ms[0] < priced_gather.forward_ms[0]  # attention's compute hides (part of) the pass


def test_census_pricing_divides_the_tokens() -> None:
    cl = _cluster(8)
    layer = _profile(1, 1).layers[0]
    out = context_layer(layer, layer, 4, t=1, sequence_parallel=False, cluster=cl, device="h100-80g", mode="ring")
    # without collectives (a ring pass shorter than attention), the census ratio: at most 1/C, about
    # 1/C for the GEMMs (rounding and launch floors make a small shard a little dearer)
    assert layer.forward_ms[0] / 4 <= out.forward_ms[0] + 1e-12


def test_expert_layer_by_hand() -> None:
    cl = _cluster(8)
    layer = _profile(0, 2, moe=True).layers[1]
    assert layer.moe is not None
    out = expert_layer(layer, 2, t=1, c=1, sequence_parallel=False, cluster=cl, pipeline_degree=1, expert_tp_share=1.0)
    # half the experts' bytes held; the rest of the layer whole
    assert out.param_bytes == layer.param_bytes - layer.moe.expert_param_bytes // 2
    group = expert_group(cl, 2, t=1, c=1, pipeline_degree=1)
    for i in range(2):
        a2a = 2 * all_to_all_ms(layer.moe.dispatch_bytes[i], group, cl)  # dispatch and combine
        assert out.forward_ms[i] == pytest.approx(layer.forward_ms[i] + a2a)
        assert out.backward_ms[i] == pytest.approx(layer.backward_ms[i] + a2a)
        assert out.activation_bytes[i] == layer.activation_bytes[i]
    # a dense layer is untouched
    dense = _profile(0, 2, moe=True).layers[0]
    assert expert_layer(dense, 2, t=1, c=1, sequence_parallel=False, cluster=cl, pipeline_degree=1,
                        expert_tp_share=1.0) == dense


def test_estimate_records_the_axes_and_adds_the_gradient_reduction() -> None:
    prof = _profile(2, 4, moe=True)
    cl = _cluster(8)
    training = TrainingSetup(global_batch_size=8)
    base = estimate(prof, cl, training, Layout([(0, 4)], num_microbatches=2, data_parallel=4, pipeline_degree=1,
                                               tensor_parallel=1))
    plan = estimate(prof, cl, training, Layout([(0, 4)], num_microbatches=2, data_parallel=4, pipeline_degree=1,
                                               context_parallel=2, expert_parallel=2))
    assert (plan.context_parallel_degree, plan.expert_parallel_degree, plan.world_size) == (2, 2, 8)
    assert plan.stages[0].devices == [0, 2, 4, 6]  # the first device of each T x C group
    assert plan.predicted.context_parallel_ms > 0 and plan.predicted.expert_parallel_ms > 0
    # the experts' halves leave the parameters; the activations halve
    experts = sum(x.moe.expert_param_bytes for x in prof.layers if x.moe is not None)
    assert plan.stages[0].param_bytes == sum(x.param_bytes for x in prof.layers) - experts // 2
    assert plan.stages[0].memory_bytes < base.stages[0].memory_bytes
    # the same plan without the gradients' reduction over C is faster by exactly that term
    mesh = Mesh(1, 0, False, False, 2, 2)
    problem = mesh_problem(prof, cl, training, mesh, data_parallel=4, pipeline_degree=1)
    assert problem.cluster.num_devices == 4
    again = estimate(prof, cl, training, Layout.of(plan))
    assert again.predicted.step_time_ms == pytest.approx(plan.predicted.step_time_ms)


@pytest.mark.parametrize(
    ("layout", "needle"),
    [
        ({"context_parallel": 3}, "does not divide the 8 devices"),
        ({"context_parallel": 2, "expert_parallel": 3}, "does not divide the layers' expert counts"),
        ({"context_parallel": 1, "expert_parallel": 8}, r"needs E to divide the D x C = 4"),
    ],
)
def test_bad_axes_are_refused(layout: dict[str, int], needle: str) -> None:
    prof = _profile(3, 2, moe=True)
    with pytest.raises(InputError, match=needle):
        estimate(prof, _cluster(8), TrainingSetup(global_batch_size=8),
                 Layout([(0, 2)], num_microbatches=2, data_parallel=4, pipeline_degree=1, **layout))


def test_a_dense_profile_refuses_expert_parallelism_and_short_sequences_refuse_context() -> None:
    dense = _profile(4, 2)
    with pytest.raises(InputError, match="no mixture-of-experts layers"):
        estimate(dense, _cluster(4), TrainingSetup(global_batch_size=4),
                 Layout([(0, 2)], num_microbatches=1, data_parallel=4, pipeline_degree=1, expert_parallel=2))
    with pytest.raises(InputError, match="does not divide the sequence length 256"):
        estimate(dense, _cluster(3 * 4), TrainingSetup(global_batch_size=4),
                 Layout([(0, 2)], num_microbatches=1, data_parallel=4, pipeline_degree=1, context_parallel=3))


# ----------------------------------------------------------------------------- the search


def _brute(profile: Profile, cl: Cluster, training: TrainingSetup, *, cs: tuple[int, ...], es: tuple[int, ...],
           zeros: tuple[int, ...] = (0, 1, 2, 3)) -> float:
    """Best fitting 1F1B step over C, E, ZeRO, D, K, M, split and recompute (T = 1)."""
    n_dev, n, g = cl.num_devices, profile.num_layers, training.global_batch_size
    best = math.inf
    for c, e, z in itertools.product(cs, es, zeros):
        for d in range(1, n_dev // c + 1):
            if g % d or (d * c) % e or n_dev % c:
                continue
            for k in range(1, n_dev // (c * d) + 1):
                for m in range(k, g // d + 1):
                    if (g // d) % m or g // (d * m) > 2:
                        continue
                    for cuts in itertools.combinations(range(1, n), k - 1):
                        b = (0, *cuts, n)
                        for rc in itertools.product((False, True), repeat=k):
                            plan = estimate(profile, cl, training, Layout(
                                [(b[i], b[i + 1]) for i in range(k)], num_microbatches=m, schedule="1f1b",
                                recompute=list(rc), data_parallel=d, pipeline_degree=k, zero_stage=z,
                                context_parallel=c, expert_parallel=e))
                            if plan_fits(plan):
                                best = min(best, plan.predicted.step_time_ms)
    return best


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), memory_mib=st.sampled_from([30, 60, 400]))
def test_fixed_context_parallel_bound_is_valid_against_brute_force(seed: int, memory_mib: int) -> None:
    profile = _profile(seed, 3)
    cl = _cluster(4, memory_mib * MiB)
    training = TrainingSetup(global_batch_size=4)
    optimum = _brute(profile, cl, training, cs=(2,), es=(1,), zeros=(0,))
    options = PlanOptions(schedule="1f1b", time_limit_s=2.0, context_parallel=2, tensor_parallel=1, zero_stage=0,
                          partial_recompute=False)
    if optimum == math.inf:
        with pytest.raises(InfeasibleError):
            solve(profile, cl, training, options)
        return
    plan = solve(profile, cl, training, options)
    assert plan.context_parallel_degree == 2 and plan_fits(plan)
    step = plan.predicted.step_time_ms
    assert step >= optimum * (1 - 1e-9)
    assert step * (1 - plan.solver.gap) <= optimum * (1 + 1e-9), (plan.solver.message, optimum)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), memory_mib=st.sampled_from([40, 80, 400]))
def test_expert_parallel_search_bound_is_valid_against_brute_force(seed: int, memory_mib: int) -> None:
    profile = _profile(seed, 3, moe=True)
    cl = _cluster(4, memory_mib * MiB)
    training = TrainingSetup(global_batch_size=4)
    optimum = _brute(profile, cl, training, cs=(1,), es=(1, 2, 4))
    options = PlanOptions(schedule="1f1b", time_limit_s=2.0, tensor_parallel=1, partial_recompute=False)
    if optimum == math.inf:
        with pytest.raises(InfeasibleError):
            solve(profile, cl, training, options)
        return
    plan = solve(profile, cl, training, options)
    assert plan_fits(plan)
    step = plan.predicted.step_time_ms
    assert step >= optimum * (1 - 1e-9)
    assert step * (1 - plan.solver.gap) <= optimum * (1 + 1e-9), (plan.solver.message, optimum)


def test_expert_parallelism_is_what_makes_it_fit() -> None:
    """Experts too large for one device fit when E shards them; the diagnosis names it."""
    profile = _profile(7, 2, moe=True)
    big = [x.model_copy(update={"param_bytes": 400 * MiB, "moe": x.moe.model_copy(update={"expert_param_bytes": 380 * MiB})})
           if x.moe is not None else x for x in profile.layers]
    profile = profile.model_copy(update={"layers": big})
    cl = _cluster(4, 1200 * MiB)
    training = TrainingSetup(global_batch_size=4)
    with pytest.raises(InfeasibleError, match="--expert-parallel"):
        solve(profile, cl, training, PlanOptions(time_limit_s=2.0, expert_parallel=1, zero_stage=0, tensor_parallel=1))
    plan = solve(profile, cl, training, PlanOptions(time_limit_s=2.0, zero_stage=0, tensor_parallel=1))
    assert plan.expert_parallel_degree > 1 and plan_fits(plan)


def test_a_float32_profile_run_in_bfloat16_holds_its_experts_share_in_master_bytes() -> None:
    """The memory-by-dtype hook scales a layer's parameters to float32 master bytes: the experts'
    share scales with them, so E still removes (1 - 1/E) of the experts (it removed half of that)."""
    from planner.cost import profile_in_dtype

    fp32 = _profile(0, 2, moe=True).model_copy(update={"measured_on": MeasuredOn(device="cpu", dtype="float32")})
    bf16 = profile_in_dtype(fp32, "bfloat16")
    layer, run = fp32.layers[1], bf16.layers[1]
    assert layer.moe is not None and run.moe is not None
    assert run.param_bytes == layer.param_bytes and run.moe.expert_param_bytes == layer.moe.expert_param_bytes
    assert run.moe.dispatch_bytes == [x // 2 for x in layer.moe.dispatch_bytes]  # tokens in bf16
    half = fp32.model_copy(update={"measured_on": MeasuredOn(device="cpu", dtype="bfloat16")})
    doubled = profile_in_dtype(half, "bfloat16").layers[1]  # bf16 weights, fp32 masters: x2
    assert doubled.moe is not None and doubled.param_bytes == 2 * layer.param_bytes
    assert doubled.moe.expert_param_bytes == 2 * layer.moe.expert_param_bytes
    out = expert_layer(doubled, 4, t=1, c=1, sequence_parallel=False, cluster=_cluster(8), pipeline_degree=1,
                       expert_tp_share=1.0)
    assert out.param_bytes == doubled.param_bytes - math.ceil(doubled.moe.expert_param_bytes * 3 / 4)


def test_the_experts_gemms_of_a_layer_run_as_one_grouped_gemm() -> None:
    """count expert products of one shape: one grouped kernel (their tiles share the waves), not
    count kernels each filling a few SMs; never slower than one by one, and exactly the batched
    product's price."""
    from planner.cost.compute import gemm_ms, operation_ms

    op = Operation(kind="gemm", m=128, n=2048, k=7168, count=256, expert=True)
    grouped = operation_ms(op, device_type="h100-80g")
    alone = operation_ms(op.model_copy(update={"expert": False}), device_type="h100-80g")
    assert grouped.forward == pytest.approx(gemm_ms(128, 2048, 7168, batch=256, dtype="bfloat16", device_type="h100-80g"))
    assert grouped.forward < 0.5 * alone.forward and grouped.backward <= alone.backward


def test_materialised_attention_counts_for_context_parallelism() -> None:
    """softmax(q @ k^T) @ v recorded as two batched GEMMs (the zoo GPT, eager attention): the
    sequence length and the K/V bytes come from them; a lone batched GEMM is no attention."""
    from planner.context import materialised_attention, sequence_length

    b, h, s, d = 2, 4, 64, 16
    scores = Operation(kind="gemm", m=s, n=s, k=d, batch=b * h, dtype="float32")
    probs_v = Operation(kind="gemm", m=s, n=d, k=s, batch=b * h, dtype="float32")
    ops = [Operation(kind="gemm", m=b * s, n=3 * h * d, k=h * d), scores, Operation(kind="memory", bytes=4 * b * h * s * s),
           probs_v, Operation(kind="gemm", m=b * s, n=h * d, k=h * d)]
    assert materialised_attention(ops) == [(scores, probs_v)]
    assert kv_bytes(ops, 1) == 2 * b * h * s * d * 4
    assert materialised_attention([scores]) == [] and kv_bytes([scores], 1) == 0
    layer = LayerProfile(name="block", param_bytes=MiB, forward_ms=[1.0], backward_ms=[2.0], activation_bytes=[MiB],
                         output_bytes=[MiB], operations=[ops])
    profile = Profile(model="eager", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=[b], layers=[layer])
    assert sequence_length(profile) == s
