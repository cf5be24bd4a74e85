"""The profiler fills the tensor-parallel fields for the zoo's transformer blocks (profiler/sharding.py)."""

from __future__ import annotations

from typing import Any

import examples.gpt as gpt
from planner.cost import Layout, estimate
from planner.schema import parse_document
from profiler.measure import profile


def test_gpt_blocks_embedding_and_head_shard() -> None:
    model, inputs, _ = gpt.tiny()
    prof = profile(model, inputs, microbatch_sizes=(1,), warmup=0, repeats=1)
    kinds = [layer.tensor_parallel for layer in prof.layers]
    # the zoo's GPT ties the head to the embedding: both units share the weight, so both stay
    # replicated (the runtime shards exactly what is priced sharded, and it shards a table only
    # where one unit owns it; test_untied_head_is_column_parallel has the untied case)
    assert kinds[0] == "replicated" and kinds[-1] == "replicated"
    blocks = [layer for layer in prof.layers if layer.name.startswith("blocks.")]
    assert blocks and all(b.tensor_parallel == "block" for b in blocks)
    for b in blocks:
        # the linear layers shard, the norms do not; each forward all-reduces 2 outputs
        assert 0 < (b.tp_param_bytes or 0) < b.param_bytes
        assert b.tp_forward_bytes == [2 * x for x in b.output_bytes]
        assert b.tp_replicated_activation_bytes is not None
        assert 0 < b.tp_replicated_activation_bytes[0] < b.activation_bytes[0]
    # a measured profile plans with T > 1: blocks take less memory per device
    cl = parse_document("cluster", {"devices": 2, "memory": "1GiB"})
    tr = parse_document("training", {"global_batch_size": 1})
    n = prof.num_layers
    one = estimate(prof, cl, tr, Layout([(0, n)], num_microbatches=1))
    two = estimate(prof, cl, tr, Layout([(0, n)], num_microbatches=1, tensor_parallel=2))
    assert two.stages[0].param_bytes < one.stages[0].param_bytes
    assert two.stages[0].memory_bytes < one.stages[0].memory_bytes


def test_untied_head_is_column_parallel() -> None:
    import dataclasses

    model, inputs = gpt.build(dataclasses.replace(gpt.GPTConfig(), tied=False, layers=2))
    prof = profile(model, inputs, microbatch_sizes=(1,), warmup=0, repeats=1)
    head = prof.layers[-1]
    assert head.tensor_parallel == "column-head" and 0 < (head.tp_param_bytes or 0) <= head.param_bytes
    embed = prof.layers[0]
    assert embed.tensor_parallel == "vocab-embedding" and 0 < (embed.tp_param_bytes or 0) <= embed.param_bytes


def _conv1d_block() -> tuple[Any, Any]:
    """A GPT-2-style block whose projections are transposed linears (a class named ``Conv1D``,
    weight ``[in, out]``, as Hugging Face's), without importing transformers; and the same
    block with a look-alike whose weight is not ``[in, nf]``."""
    import torch
    from torch import nn

    class Conv1D(nn.Module):
        def __init__(self, nf: int, nx: int, *, consistent: bool = True) -> None:
            super().__init__()
            self.nf = nf if consistent else nf + 1
            self.weight = nn.Parameter(torch.zeros(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))

    def block(consistent: bool) -> nn.Module:
        m = nn.Module()
        m.ln_1, m.ln_2 = nn.LayerNorm(8), nn.LayerNorm(8)
        m.c_attn, m.c_proj = Conv1D(24, 8, consistent=consistent), Conv1D(8, 8, consistent=consistent)
        m.c_fc, m.c_out = Conv1D(32, 8, consistent=consistent), Conv1D(8, 32, consistent=consistent)
        return m

    return block(True), block(False)


def test_conv1d_projections_make_a_block() -> None:
    """Hugging Face GPT-2's projections (Conv1D, a transposed linear) count as a block's: the
    fused [Q | K | V] c_attn among them; the linear weights are what shards."""
    from profiler.sharding import module_bytes, projection_widths, tensor_parallel_fields

    gpt2_like, look_alike = _conv1d_block()
    layer = {"output_bytes": [256], "activation_bytes": [4096]}
    fields = tensor_parallel_fields(gpt2_like, layer, [256])
    assert fields["tensor_parallel"] == "block"
    norms = module_bytes(gpt2_like.ln_1) + module_bytes(gpt2_like.ln_2)
    assert fields["tp_param_bytes"] == module_bytes(gpt2_like) - norms
    assert projection_widths(gpt2_like.c_attn) == (8, 24)
    # a module that only shares the name is not a projection: nothing shards
    assert tensor_parallel_fields(look_alike, layer, [256]) == {}
