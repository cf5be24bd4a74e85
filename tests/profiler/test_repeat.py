"""Repeated blocks (profiler/repeat.py): a fake profile that traces one block of each kind and
copies its layer to the others equals, field for field, the profile that traces every block."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from planner.schema import Profile
from profiler.fake import fake_profile
from profiler.loading import Entrypoint
from profiler.repeat import traced_blocks

transformers = pytest.importorskip("transformers")

from tests.profiler.test_hf_config import SEQ, _shrunk  # noqa: E402

#: six blocks each; DeepSeek-style: two dense blocks, then MoE ones; Gemma 2 alternates sliding
#: and global attention
CASES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"num_hidden_layers": 6},
    "gemma2-9b": {"num_hidden_layers": 6},
    "mixtral-8x7b": {"num_hidden_layers": 6},
    "qwen3-30b-a3b": {"num_hidden_layers": 6},
    "deepseek-v3": {"num_hidden_layers": 6, "first_k_dense_replace": 2},
}


def _both(make: Any) -> tuple[Profile, Profile]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(  # type: ignore[return-value]
            fake_profile(make, device_type="h100-80g", microbatch_sizes=(1, 2), repeated_blocks=r) for r in (True, False)
        )


def _assert_same(repeated: Profile, whole: Profile) -> None:
    assert [x.name for x in repeated.layers] == [x.name for x in whole.layers]
    for a, b in zip(repeated.layers, whole.layers, strict=True):
        assert a == b, a.name
    meta = dict(repeated.metadata["profiler"])
    meta.pop("repeated_blocks")
    assert meta == whole.metadata["profiler"]
    strip = {"layers": [], "metadata": {}}
    assert repeated.model_copy(update=strip) == whole.model_copy(update=strip)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tracing_one_block_of_each_kind_gives_the_whole_trace(tmp_path: Any, name: str) -> None:
    from profiler.hf_config import hf_entrypoint

    path = _shrunk(tmp_path, name, **CASES[name])
    repeated, whole = _both(lambda: hf_entrypoint(path, seq=SEQ))
    info = repeated.metadata["profiler"]["repeated_blocks"]
    assert info["blocks"] == 6 and len(info["traced"]) < 6, info
    _assert_same(repeated, whole)
    if name == "gemma2-9b":  # two kinds; the cuts after block 4 no longer carry the sliding mask
        assert info["traced"] == [0, 1, 2, 4, 5]
    if name == "deepseek-v3":  # dense block 1, MoE block 2; latent attention runs fused (V padded)
        assert info["traced"] == [0, 1, 2, 5]
        block = next(x for x in whole.layers if x.name == "model.layers.3")
        assert block.operations is not None
        assert [op.kind for op in block.operations[0]].count("attention") == 1


def test_traced_blocks_keep_the_ends_and_one_inner_block_of_each_kind() -> None:
    assert traced_blocks(list("aaaaaa")) == ([0, 1, 5], [0, 1, 1, 1, 1, 2])
    assert traced_blocks(list("abababa")) == ([0, 1, 2, 5, 6], [0, 1, 2, 1, 2, 3, 4])
    # the only inner 'b' is traced; the 'a' blocks after it share block 2's layer
    assert traced_blocks(list("abaaaa")) == ([0, 1, 2, 5], [0, 1, 2, 2, 2, 3])
    assert traced_blocks(list("aabbbb")) == ([0, 1, 2, 5], [0, 1, 2, 2, 2, 3])


class _Indexing(nn.Module):
    """A stack its forward indexes by a count it keeps (cutting the stack breaks it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.count = 6
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i in range(self.count):
            h = torch.relu(self.blocks[i](h))
        return self.head(h)


def test_a_model_whose_forward_needs_the_whole_stack_is_traced_whole() -> None:
    def make() -> Entrypoint:
        return Entrypoint(model=_Indexing(), example_inputs=(torch.randn(1, 8),), loss_fn=None, spec="indexing")

    repeated, whole = _both(make)
    assert "repeated_blocks" not in repeated.metadata["profiler"]
    assert repeated == whole
