"""The real-model zoo, split: every block its own layer, units that train exactly like the
model (dropout included), and memory that is true for every stage.

Entries: ``examples.hf`` (GPT-2, Llama, Qwen2, Mixtral, BERT, T5, ViT; skipped without
transformers), ``examples.vision`` (ResNet, MobileNetV3, ConvNeXt, DenseNet, GoogLeNet) and the
original ``examples.gpt``/``resnet``/``amoebanet``.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import torch

from planner.cost import layer_costs
from profiler.loading import load_entrypoint
from profiler.measure import measure_split, resize_batch, stage_saved_bytes
from profiler.split import CutWarning, RngStreams, split_model

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HF = ["gpt2", "llama", "qwen2", "mixtral", "bert", "t5", "vit"]
VISION = ["resnet", "mobilenet", "convnext", "densenet", "googlenet"]
ZOO = [
    *(pytest.param(f"examples.hf:{n}", marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers"))
      for n in HF),
    *(f"examples.vision:{n}" for n in VISION),
    "examples.gpt:tiny", "examples.resnet:tiny", "examples.amoebanet:tiny",
]  # fmt: skip

#: the blocks of each entry, which must each be a layer of their own
BLOCKS = {
    "examples.hf:gpt2": [f"transformer.h.{i}" for i in range(4)],
    "examples.hf:llama": [f"model.layers.{i}" for i in range(4)],
    "examples.hf:qwen2": [f"model.layers.{i}" for i in range(4)],
    "examples.hf:mixtral": [f"model.layers.{i}" for i in range(4)],
    "examples.hf:bert": [f"bert.encoder.layer.{i}" for i in range(4)],
    "examples.hf:t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    "examples.hf:vit": [f"vit.layers.{i}" for i in range(4)],
    "examples.vision:resnet": [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)],
    "examples.vision:mobilenet": [f"features.{i}" for i in range(5)],
    "examples.vision:convnext": ["stages.0", "stages.1", "stages.3", "stages.4"],
    "examples.vision:densenet": [f"body.{b}.denselayer{i}" for b in (0, 2) for i in range(1, 4)],
    "examples.vision:googlenet": ["inception3a.branch1", "inception4b.branch4.1"],
    "examples.gpt:tiny": [f"blocks.{i}" for i in range(4)],
    "examples.resnet:tiny": [f"stages.{i}.{j}" for i in range(3) for j in range(2)],
    "examples.amoebanet:tiny": [f"cells.{i}" for i in range(6)],
}


def _split(spec: str) -> tuple[Any, Any]:
    entry = load_entrypoint(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CutWarning)  # no block boundary may be given up
        split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
    return entry, split


@pytest.mark.parametrize("spec", ZOO)
def test_every_block_is_its_own_layer_and_the_units_train_like_the_model(spec: str) -> None:
    entry, split = _split(spec)
    assert split.method == "torch.export" and not split.warnings
    assert set(BLOCKS[spec]) <= set(split.names), split.names
    assert all(len(a) == 1 for a in split.anchors)  # nothing merged
    # one training step of the units and of the model, dropout on, the same random streams
    model = entry.model.train()
    streams = RngStreams(seed=3)
    hooks = split.seed_hooks(model, streams)
    want = entry.loss(entry.call(model, entry.example_inputs))
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    stage = split.stage_module(0, len(split))
    stage.rng = streams
    got = entry.loss(stage(*entry.example_inputs))
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-6)
    for name, p in model.named_parameters():
        if name in ref:
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("spec", ZOO)
def test_memory_is_exact_for_every_stage(spec: str) -> None:
    """For every contiguous range of layers, the predicted activation bytes equal the bytes
    the range keeps for backward when it runs as one stage (saved-tensor hooks), within 2 %."""
    entry, split = _split(spec)
    sizes = (1, 2)
    profile = measure_split(split, entry.example_inputs, microbatch_sizes=sizes, loss_fn=entry.loss_fn, warmup=0, repeats=1)
    n = len(split)
    ranges = [(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    for b in sizes:
        measured = stage_saved_bytes(split, resize_batch(entry.example_inputs, b), ranges, entry.loss)
        costs = layer_costs(profile, b)
        wrong = [
            (r, measured[r], costs.stage_activation_bytes(*r))
            for r in ranges
            if abs(costs.stage_activation_bytes(*r) - measured[r]) > 0.02 * max(measured[r], 1)
        ]
        assert not wrong, wrong[:5]
        assert all(measured[(a, n)] > 0 for a in range(n - 1))  # the stages really keep something
