"""Tensor-parallel roles in the profiler's operation census (profiler/census.py, ``tp_shard``).

The expected roles come from the runtime's own sharding rules (``runtime.mesh.match_rule``:
which projections it makes column- and row-parallel), the expected FLOPs from the modules'
sizes; the census finds its roles by following the data through the forward, so the two are
independent.  Measured (CPU) and fake-tensor profiles are checked alike, and a fake Llama
against synth's census of the same architecture.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import examples.gpt as gpt
from planner.cost.compute import shard_operation
from planner.mesh import Mesh, census_roles, flat_scaling_note, mesh_problem
from planner.schema import Cluster, Operation, Profile, TrainingSetup
from profiler.census import Census, census, gemm_flops
from profiler.fake import fake_profile
from profiler.loading import load_entrypoint
from profiler.measure import profile
from profiler.sharding import sharded_weights
from runtime.mesh import match_rule

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")


def _expand(ops: list[Operation]) -> list[Operation]:
    """One entry per operation (``count`` undone)."""
    return [o.model_copy(update={"count": 1}) for o in ops for _ in range(o.count)]


def _gpt_untied() -> tuple[nn.Module, Any, Any]:
    """The zoo GPT with dropout on (attention and residual) and an untied head (which then shards)."""
    model, inputs = gpt.build(dataclasses.replace(gpt.GPTConfig(), tied=False, layers=2, dropout=0.1))
    return model, inputs, None


def _measured(name: str) -> tuple[nn.Module, Profile]:
    if name == "gpt":
        model, inputs, loss, keywords = *_gpt_untied(), None
    else:
        entry = load_entrypoint(name)
        model, inputs, loss, keywords = entry.model, entry.example_inputs, entry.output_loss(), entry.keywords
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile(model, inputs, microbatch_sizes=(1, 2), loss_fn=loss, keywords=keywords, warmup=0, repeats=1,
                       progress=False)  # fmt: skip
    return model, prof


MODELS = ["gpt", *(pytest.param(f"examples.hf:{m}", marks=needs_transformers) for m in ("llama", "gpt2", "bert", "vit"))]


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[nn.Module, Profile]]:
    return {}


def _get(measured: dict[str, tuple[nn.Module, Profile]], name: str) -> tuple[nn.Module, Profile]:
    if name not in measured:
        measured[name] = _measured(name)
    return measured[name]


# --------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("name", MODELS)
def test_block_projections_get_the_runtimes_column_and_row_roles(
    measured: dict[str, tuple[nn.Module, Profile]], name: str
) -> None:
    model, prof = _get(measured, name)
    modules = dict(model.named_modules())
    blocks = [x for x in prof.layers if x.tensor_parallel == "block"]
    assert len(blocks) >= 2
    for layer in blocks:
        block = modules[layer.name]
        rule = match_rule(block)
        assert rule is not None, f"the runtime has no rule for {layer.name}"
        linears = {n: (int(m.weight.shape[0]), int(m.weight.shape[1])) for n, m in block.named_modules()
                   if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2}  # fmt: skip
        # the runtime's projections as GEMMs: n = out features, k = in features
        expected = collections.Counter(
            [(*rule.features(linears, m), "n") for m in rule.column] + [(*rule.features(linears, m), "k") for m in rule.row]
        )
        assert expected
        for b, ops in zip(prof.microbatch_sizes, layer.operations or [], strict=True):
            ops = _expand(ops)
            projections = collections.Counter((o.n, o.k, o.tp_shard) for o in ops if o.kind == "gemm" and o.batch == 1)
            assert projections == expected, (layer.name, b)
            # attention is by heads: fused, or materialised as two batched GEMMs of b·heads
            attention = [o for o in ops if o.kind == "attention" or (o.kind == "gemm" and o.batch > 1)]
            assert attention and all(o.tp_shard == "heads" for o in attention), (layer.name, b)
            # memory-bound kernels: some inside the sharded region, the norms and residual adds outside
            memory = [o for o in ops if o.kind == "memory"]
            assert any(o.tp_shard == "bytes" for o in memory) and sum(o.tp_shard is None for o in memory) >= 4


@pytest.mark.parametrize("name", MODELS)
def test_a_block_shards_all_its_flops_exactly_in_half_at_t2(
    measured: dict[str, tuple[nn.Module, Profile]], name: str
) -> None:
    model, prof = _get(measured, name)
    modules = dict(model.named_modules())
    for layer in (x for x in prof.layers if x.tensor_parallel == "block"):
        block = modules[layer.name]
        weights = sum(int(m.weight.numel()) for m in block.modules() if type(m).__name__ in ("Linear", "Conv1D"))
        for b, ops in zip(prof.microbatch_sizes, layer.operations or [], strict=True):
            sharded = [o for o in ops if o.tp_shard is not None and o.kind != "memory"]
            attention = gemm_flops([o for o in ops if o.kind == "attention" or (o.kind == "gemm" and o.batch > 1)])
            tokens = next(o.m for o in ops if o.kind == "gemm" and o.batch == 1)
            # every product of a dense block is in the sharded part: its projections' 2·t·weights
            # plus attention's, and nothing of it is left replicated
            assert tokens is not None and tokens % b == 0
            assert gemm_flops(sharded) == gemm_flops(ops) == 2 * tokens * weights + attention
            assert attention > 0
            per_rank = [shard_operation(o, 2) for o in ops]
            assert gemm_flops([shard_operation(o, 2) for o in sharded]) == gemm_flops(sharded) / 2
            assert gemm_flops(per_rank) == gemm_flops(ops) / 2, (layer.name, b)


@pytest.mark.parametrize("name", MODELS)
def test_the_head_marks_its_logits_gemm_only_and_the_embedding_nothing(
    measured: dict[str, tuple[nn.Module, Profile]], name: str
) -> None:
    _, prof = _get(measured, name)
    for layer in prof.layers:
        marked = [o for ops in layer.operations or [] for o in ops if o.tp_shard is not None]
        if layer.tensor_parallel == "column-head":
            # the logits GEMM (n = the vocabulary) column-parallel; the loss on the gathered logits whole
            assert marked and all(o.kind == "gemm" and o.tp_shard == "n" for o in marked)
            assert len(marked) == len(layer.operations or [])
        elif layer.tensor_parallel != "block":
            assert marked == [], layer.name


def test_the_zoo_gpt_profile_has_a_column_head_and_a_replicated_embedding(
    measured: dict[str, tuple[nn.Module, Profile]],
) -> None:
    """The case the head test above covers really occurs (the zoo GPT untied)."""
    _, prof = _get(measured, "gpt")
    assert prof.layers[0].tensor_parallel == "vocab-embedding" and prof.layers[-1].tensor_parallel == "column-head"
    assert any(o.tp_shard == "n" for o in (prof.layers[-1].operations or [[]])[0])


# --------------------------------------------------------------------------- fake against synth


def _shrunk_llama(tmp_path: Any, name: str = "llama3-8b", **wider: Any) -> str:
    """The shipped config ``name`` (Llama 3 8B), two blocks, tiny widths (or ``wider``)."""
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256)  # fmt: skip
    cfg.update(wider)
    folder = os.path.join(str(tmp_path), name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def _role_flops(ops: list[Operation]) -> dict[str | None, float]:
    out: dict[str | None, float] = collections.defaultdict(float)
    for o in ops:
        if o.kind != "memory":
            out[o.tp_shard] += gemm_flops([o])
    return dict(out)


@needs_transformers
def test_a_fake_llama_has_synths_roles(tmp_path: Any) -> None:
    from profiler.hf_config import hf_entrypoint
    from profiler.hf_spec import read_config, spec_from_config
    from profiler.synth import synth_decoder

    seq, sizes = 32, (1, 2)
    path = _shrunk_llama(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake = fake_profile(lambda: hf_entrypoint(path, seq=seq), device_type="h100-80g", microbatch_sizes=sizes)
    synth = synth_decoder(spec_from_config(read_config(path), seq=seq), device_type="h100-80g", microbatch_sizes=sizes)
    fake_blocks = [x for x in fake.layers if x.tensor_parallel == "block"]
    synth_blocks = [x for x in synth.layers if x.tensor_parallel == "block"]
    assert len(fake_blocks) == len(synth_blocks) == 2
    for f, s in zip(fake_blocks, synth_blocks, strict=True):
        for j in range(len(sizes)):
            fo, so = _expand((f.operations or [])[j]), _expand((s.operations or [])[j])
            # the same roles on the products, each role the same FLOPs (synth fuses Q, K and V
            # and counts gate and up as two of one shape; the model runs five projections)
            assert _role_flops(fo) == _role_flops(so) and set(_role_flops(fo)) == {"n", "k", "heads"}
            roles = collections.Counter(o.tp_shard for o in fo if o.kind != "memory")
            assert roles["n"] == 5 and roles["k"] == 2 and roles["heads"] == 1
            assert [o.tp_shard for o in fo if o.kind == "attention"] == [o.tp_shard for o in so if o.kind == "attention"]
            # the sharded memory kernels (rotary, the head reshapes, SwiGLU) and the whole ones (norms)
            assert any(o.tp_shard == "bytes" for o in fo) and any(o.tp_shard is None for o in fo if o.kind == "memory")
    head = next(x for x in fake.layers if x.tensor_parallel == "column-head")
    assert [o.tp_shard for o in (head.operations or [[]])[0] if o.kind == "gemm"] == ["n"]


# --------------------------------------------------------------------------- planned under T = 2


def _without_roles(prof: Profile) -> Profile:
    layers = [
        x.model_copy(update={"operations": None if x.operations is None else
                             [[o.model_copy(update={"tp_shard": None}) for o in ops] for ops in x.operations]})
        for x in prof.layers
    ]  # fmt: skip
    return prof.model_copy(update={"layers": layers})


def _block(prof: Profile, device_type: str, t: int) -> Any:
    """The first block of ``prof`` as one device of a T-group prices it."""
    cluster = Cluster.model_validate({"devices": 2, "devices_per_node": 2, "device_type": device_type})
    problem = mesh_problem(prof, cluster, TrainingSetup(global_batch_size=2), Mesh(tensor_parallel=t), data_parallel=1,
                           pipeline_degree=1)  # fmt: skip
    return next(x for x in problem.profile.layers if x.name.endswith(("blocks.0", "layers.0")))


def _block_ms(prof: Profile, device_type: str, t: int) -> float:
    layer = _block(prof, device_type, t)
    return float(layer.forward_ms[0] + layer.backward_ms[0])


def _wide_gpt() -> Any:
    from profiler.loading import Entrypoint

    model, inputs = gpt.build(gpt.GPTConfig(vocab=4096, seq=512, layers=2, hidden=1024, heads=16, batch=1))
    return Entrypoint(model, inputs, None, "wide gpt")


def _wide_llama(tmp_path: Any) -> Any:
    from profiler.hf_config import hf_entrypoint

    path = _shrunk_llama(tmp_path, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=4096)  # fmt: skip
    return lambda: hf_entrypoint(path, seq=512)


@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=needs_transformers)])
def test_a_fake_profile_is_priced_by_its_roles_under_t2(model: str, tmp_path: Any) -> None:
    """Wide enough (h = 1024, 512 tokens) that a block's share of T = 2 with its all-reduces is
    less than the whole block on an H100."""
    make = _wide_gpt if model == "gpt" else _wide_llama(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = fake_profile(make, device_type="h100-80g", microbatch_sizes=[1, 2])
    assert census_roles(prof)
    assert flat_scaling_note(prof, 2) is None
    assert _block_ms(prof, "h100-80g", 2) < _block_ms(prof, "h100-80g", 1)
    # the same census without its roles: the flat efficiency again, and the note says so
    plain = _without_roles(prof)
    assert not census_roles(plain)
    note = flat_scaling_note(plain, 2)
    assert note is not None and ("blocks.0" in note or "layers.0" in note)


def test_a_measured_profile_is_priced_by_its_roles_under_t2(measured: dict[str, tuple[nn.Module, Profile]]) -> None:
    """The tiny GPT's all-reduces on a CPU "cluster" cost more than its blocks' compute, so
    compare compute alone: the collectives are what the flat pricing adds to whole / (T x eff)."""
    _, prof = _get(measured, "gpt")
    plain = _without_roles(prof)
    assert census_roles(prof) and flat_scaling_note(prof, 2) is None
    assert flat_scaling_note(plain, 2) is not None
    eff = TrainingSetup(global_batch_size=2).tensor_parallel_efficiency
    whole = _block(prof, "cpu", 1).forward_ms[0]
    flat = _block(plain, "cpu", 2).forward_ms[0]
    comm = flat - whole / (2 * eff)
    share = _block(prof, "cpu", 2).forward_ms[0] - comm
    assert whole / 2 <= share < whole
    assert share != pytest.approx(whole / (2 * eff), rel=1e-3)  # the device model's ratio, not the flat one


# --------------------------------------------------------------------------- units without roles


class _MLP(nn.Module):
    """Two projections and no norm, none four times wider than its input: no transformer block,
    no head (profiler/sharding.py), replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


class _Leaky(nn.Module):
    """Four projections and a norm, but one column-parallel output reaches the output without a
    row-parallel projection: Megatron's split does not hold, the census marks nothing."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.a, self.b, self.c, self.d = nn.Linear(h, 2 * h), nn.Linear(2 * h, h), nn.Linear(h, 2 * h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out: torch.Tensor = x + self.b(torch.relu(self.a(h)) * self.c(h)) + self.d(h) * 2
        return out


def test_a_unit_that_is_no_block_keeps_no_roles() -> None:
    mlp = _MLP()
    assert sharded_weights(mlp) is None
    ops = census(mlp, [torch.randn(2, 8, 16)], sharded=sharded_weights(mlp))
    assert ops and all(o.tp_shard is None for o in ops)
    # the same weights, given as a block's, would be marked: the test above is not vacuous
    from profiler.census import ShardedWeights

    marked = census(mlp, [torch.randn(2, 8, 16)], sharded=ShardedWeights("block", (mlp.up.weight, mlp.down.weight)))
    assert [o.tp_shard for o in marked if o.kind == "gemm"] == ["n", "k"]
    assert [o.tp_shard for o in marked if o.kind == "memory"] == ["bytes"]  # the ReLU between them


def test_a_block_whose_split_does_not_hold_keeps_no_roles() -> None:
    leaky = _Leaky()
    sharded = sharded_weights(leaky)
    assert sharded is not None and sharded.kind == "block"
    recorder = Census(sharded=sharded)
    with recorder.recording():
        out = leaky(torch.randn(2, 8, 16))
        recorder.finish(out)
    assert recorder.roles_dropped is not None and "output" in recorder.roles_dropped
    ops = recorder.operations()
    assert ops and all(o.tp_shard is None for o in ops)
    # the products are all still there, merged as without roles
    assert sorted((o.n, o.k, o.count) for o in ops if o.kind == "gemm") == [(16, 16, 1), (16, 32, 1), (32, 16, 2)]


def test_a_batched_gemm_shards_by_heads_and_a_memory_kernel_cannot() -> None:
    scores = Operation(kind="gemm", m=32, n=32, k=16, batch=8 * 4, tp_shard="heads")
    assert shard_operation(scores, 4).batch == 8 and shard_operation(scores, 4).n == 32
    with pytest.raises(ValueError, match=r"a memory operation cannot shard 'heads'.*'bytes'"):
        shard_operation(Operation(kind="memory", bytes=100, tp_shard="heads"), 2)


def test_context_parallel_keys_of_materialised_attention_divide_by_its_heads_role() -> None:
    """Under T and C both: a device holds the keys and values of its heads only, where the
    census says the batched products shard by heads (planner/context.py)."""
    from planner.context import kv_bytes

    b, h, s, d = 2, 4, 64, 16
    scores = Operation(kind="gemm", m=s, n=s, k=d, batch=b * h, dtype="float32", tp_shard="heads")
    probs_v = Operation(kind="gemm", m=s, n=d, k=s, batch=b * h, dtype="float32", tp_shard="heads")
    ops = [scores, Operation(kind="memory", bytes=4 * b * h * s * s, tp_shard="bytes"), probs_v]
    whole = [o.model_copy(update={"tp_shard": None}) for o in ops]
    assert kv_bytes(ops, 1) == kv_bytes(whole, 1) == kv_bytes(whole, 2) == 2 * b * h * s * d * 4
    assert kv_bytes(ops, 2) == kv_bytes(ops, 1) // 2


class _Stack(nn.Module):
    """A zoo GPT block and a :class:`_Leaky` one (a transformer block to the profiler)."""

    def __init__(self, cfg: gpt.GPTConfig) -> None:
        super().__init__()
        self.embed = gpt.Embedding(cfg)
        self.blocks = nn.ModuleList([gpt.Block(cfg), _Leaky(cfg.hidden)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_block_without_roles_in_a_profile_with_them_is_scaled_flat() -> None:
    """The planner prices a layer's share from its census only where the census says what
    divides: the leaky block, sharded by the profile (its parameters, its all-reduces), is scaled
    by the flat efficiency as in a profile without roles, not priced as replicated work."""
    from profiler.loading import Entrypoint

    cfg = gpt.GPTConfig(vocab=512, seq=256, layers=2, hidden=512, heads=8, batch=1)

    def make() -> Entrypoint:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return Entrypoint(_Stack(cfg), (torch.randint(0, cfg.vocab, (1, cfg.seq)),), None, "stack")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = fake_profile(make, device_type="h100-80g", microbatch_sizes=[1])
    good, leaky = (next(x for x in prof.layers if x.name == f"blocks.{i}") for i in (0, 1))
    assert good.tensor_parallel == leaky.tensor_parallel == "block"
    assert any(o.tp_shard for o in (good.operations or [[]])[0])
    assert leaky.operations and not any(o.tp_shard for o in leaky.operations[0])
    note = flat_scaling_note(prof, 2)
    assert note is not None and "blocks.1" in note and "blocks.0" not in note
    cluster = Cluster.model_validate({"devices": 2, "device_type": "h100-80g"})

    def share(p: Profile, name: str) -> float:
        problem = mesh_problem(p, cluster, TrainingSetup(global_batch_size=2), Mesh(tensor_parallel=2),
                               data_parallel=1, pipeline_degree=1)  # fmt: skip
        return float(next(x for x in problem.profile.layers if x.name == name).forward_ms[0])

    # the leaky block: as in the profile without any roles (flat); the good one: the device model's
    plain = _without_roles(prof)
    assert share(prof, "blocks.1") == pytest.approx(share(plain, "blocks.1"), rel=1e-12)
    assert share(prof, "blocks.0") != pytest.approx(share(plain, "blocks.0"), rel=1e-3)


def test_repeated_blocks_carry_the_traced_blocks_roles() -> None:
    """``--fake`` traces a few blocks of a stack and copies them (profiler/repeat.py): every
    block of the zoo GPT has the roles, as a fake profile traced whole gives them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        repeated = fake_profile(lambda: load_entrypoint("examples.gpt:tiny"), device_type="h100-80g", microbatch_sizes=[1])
        whole = fake_profile(lambda: load_entrypoint("examples.gpt:tiny"), device_type="h100-80g", microbatch_sizes=[1],
                             repeated_blocks=False)  # fmt: skip
    assert "repeated_blocks" in repeated.metadata["profiler"] and "repeated_blocks" not in whole.metadata["profiler"]
    blocks = [x for x in repeated.layers if x.name.startswith("blocks.")]
    assert len(blocks) == 4
    for r, w in zip(blocks, (x for x in whole.layers if x.name.startswith("blocks.")), strict=True):
        assert r.operations == w.operations and any(o.tp_shard == "k" for o in (r.operations or [[]])[0]), r.name


@needs_transformers
def test_a_mixture_of_experts_block_keeps_its_census_without_roles(tmp_path: Any) -> None:
    """Mixtral's blocks (routed experts): no roles, the expert GEMMs as before (``expert``), the
    block scaled by the flat efficiency and named in the note; its head still has its role."""
    from profiler.hf_config import hf_entrypoint

    path = _shrunk_llama(tmp_path, "mixtral-8x7b", num_local_experts=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = fake_profile(lambda: hf_entrypoint(path, seq=32), device_type="h100-80g", microbatch_sizes=[1])
    blocks = [x for x in prof.layers if x.tensor_parallel == "block"]
    assert len(blocks) == 2 and all(x.moe is not None for x in blocks)
    for x in blocks:
        ops = (x.operations or [[]])[0]
        assert any(o.expert for o in ops) and not any(o.tp_shard for o in ops)
    head = next(x for x in prof.layers if x.tensor_parallel == "column-head")
    assert [o.tp_shard for o in (head.operations or [[]])[0] if o.kind == "gemm"] == ["n"]
    for x in blocks:
        # the runtime shards the experts along their hidden width (runtime/tp_experts.py): their
        # bytes divide by T; the block's all-reduces move attention's output and the MoE output
        # (the routed rows combined before the one reduction) forward; backward also the routing
        # weights' gradient (num_experts_per_tok 2 per token, next to hidden_size 64): 3 collectives
        assert x.moe is not None and x.tp_param_bytes is not None
        assert x.moe.expert_param_bytes < x.tp_param_bytes < x.param_bytes  # (the router and norms stay whole)
        assert x.tp_forward_bytes == [2 * o for o in x.output_bytes], x.tp_forward_bytes
        assert x.tp_backward_bytes == [round((2 + 2 / 64) * o) for o in x.output_bytes], x.tp_backward_bytes
        assert (x.tp_forward_collectives, x.tp_backward_collectives) == (2, 3)
    note = flat_scaling_note(prof, 2)
    assert note is not None and all(x.name in note for x in blocks) and head.name not in note


# --------------------------------------------------------------------------- low-rank projections


class _Rms(nn.Module):
    """An RMS norm over the last dimension, written out (as transformers' RMSNorms are)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)


class _LowRankAttention(nn.Module):
    """Attention whose queries come through a low-rank down-projection and its norm
    (DeepSeek's ``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj``), or, with ``rank=0``, a plain
    query projection with a per-head norm (Qwen3's ``q_norm``)."""

    def __init__(self, hidden: int = 32, heads: int = 4, rank: int = 8, per_head_norm: bool = False) -> None:
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.q_a = nn.Linear(hidden, rank, bias=False) if rank else None
        self.q_a_norm = _Rms(rank) if rank else None
        self.q_b = nn.Linear(rank or hidden, hidden, bias=False)
        self.q_norm = _Rms(self.d) if per_head_norm else None
        self.kv = nn.Linear(hidden, 2 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q_in = self.q_a_norm(self.q_a(x)) if self.q_a is not None and self.q_a_norm is not None else x
        q = self.q_b(q_in).view(b, s, self.heads, self.d)
        if self.q_norm is not None:
            q = self.q_norm(q)
        k, v = self.kv(x).view(b, s, 2, self.heads, self.d).unbind(2)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + self.o(out.transpose(1, 2).reshape(b, s, h))


def _projection_roles(block: _LowRankAttention) -> dict[str, str | None]:
    from profiler.census import ShardedWeights

    weights = [m.weight for m in (block.q_a, block.q_b, block.kv, block.o) if m is not None]
    ops = census(block, [torch.randn(2, 8, 32)], sharded=ShardedWeights("block", tuple(weights)))
    # the projections in the order they run (the census keeps first-run order), one each
    names = ["q_a", "q_b", "kv", "o"] if block.q_a is not None else ["q_b", "kv", "o"]
    products = [o for o in ops if o.kind == "gemm" and o.batch == 1]
    assert [o.count for o in products] == [1] * len(names)
    return {name: o.tp_shard for name, o in zip(names, products, strict=True)}


def test_a_low_rank_down_projection_into_its_norm_stays_replicated() -> None:
    # Megatron keeps DeepSeek's q_a/kv_a replicated: their norm needs the whole features; the
    # up-projection after it is column-parallel and the output projection row-parallel (one
    # all-reduce).  Following the data alone would shard the down-projection, normalise a shard
    # and make the up-projection row-parallel
    assert _projection_roles(_LowRankAttention()) == {"q_a": None, "q_b": "n", "kv": "n", "o": "k"}


def test_a_per_head_norm_keeps_its_projection_column_parallel() -> None:
    # Qwen3's q_norm normalises each head's own features, which a rank holds whole
    roles = _projection_roles(_LowRankAttention(rank=0, per_head_norm=True))
    assert roles == {"q_b": "n", "kv": "n", "o": "k"}


@needs_transformers
def test_deepseeks_latent_attention_gets_megatrons_split() -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
                           first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256,
                           n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)  # fmt: skip
    model = DeepseekV3ForCausalLM(cfg)
    layer = model.model.layers[0]
    x = torch.randn(2, 8, 64)
    rope = model.model.rotary_emb(x, torch.arange(8)[None].expand(2, 8))

    class Unit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, h: torch.Tensor) -> Any:
            return self.layer(h, position_embeddings=rope, attention_mask=None)

    sharded = sharded_weights(layer)
    assert sharded is not None
    ops = census(Unit(), [x], sharded=sharded)
    attn = layer.self_attn
    roles = {}
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        n, k = getattr(attn, name).weight.shape
        roles[name] = [o.tp_shard for o in ops if o.kind == "gemm" and o.batch == 1 and (o.n, o.k) == (n, k)]
    assert roles == {"q_a_proj": [None], "q_b_proj": ["n"], "kv_a_proj_with_mqa": [None], "kv_b_proj": ["n"],
                     "o_proj": ["k"]}  # fmt: skip
