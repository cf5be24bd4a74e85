"""The runtime refuses, before training, a tensor-parallel degree that would cut a head in two
(``runtime.tp_heads``): Llama's grouped-query attention has 4 query heads but 2 key/value
heads, so T = 4 divides every projection's width but not its key/value heads."""

from __future__ import annotations

from typing import Any

import pytest

from planner.errors import InputError


def _split(model: str) -> Any:
    from profiler.loading import load_entrypoint
    from profiler.split import split_model

    entry = load_entrypoint(model)
    return split_model(entry.model, entry.example_inputs, keywords=entry.keywords)


def test_the_heads_are_read_from_the_view_after_each_projection() -> None:
    from runtime.tp_heads import heads_of

    llama = _split("examples.hf:llama")
    layer = llama.units[llama.names.index("model.layers.0")]
    attn = "model.layers.0.self_attn"
    assert heads_of(layer, f"{attn}.q_proj") == (4, 32)
    assert heads_of(layer, f"{attn}.k_proj") == (2, 16)
    assert heads_of(layer, f"{attn}.v_proj") == (2, 16)
    assert heads_of(layer, "model.layers.0.mlp.gate_proj") is None  # no view: not cut into heads
    gpt = _split("examples.gpt:tiny")
    # the zoo GPT's fused projection is viewed head-major: (4 heads, 3 projections, 16 dims)
    assert heads_of(gpt.units[1], "blocks.0.attn.qkv") == (4, 192)


@pytest.mark.parametrize("sp", [False, True])
def test_llama_at_t4_is_refused_naming_the_key_value_projections(sp: bool) -> None:
    from runtime.mesh import MeshSpec, split_sharding

    llama = _split("examples.hf:llama")
    assert split_sharding(llama, MeshSpec(tensor_parallel_degree=2, sequence_parallel=sp))
    with pytest.raises(InputError) as err:
        split_sharding(llama, MeshSpec(tensor_parallel_degree=4, sequence_parallel=sp))
    text = str(err.value)
    assert "model.layers.0.self_attn.k_proj has 16 output features viewed as 2 heads of 8: 2 heads not divisible by T=4" in text
    assert "self_attn.v_proj" in text and "q_proj" not in text and "mlp" not in text, text
    assert text.count("heads not divisible by T=4") == 8, text  # k and v of the 4 layers
    assert "fix: replan with a tensor-parallel degree that divides" in text


def test_the_zoo_gpt_at_t4_is_not_refused() -> None:
    from runtime.mesh import MeshSpec, split_sharding

    assert split_sharding(_split("examples.gpt:tiny"), MeshSpec(tensor_parallel_degree=4))
