"""split_model: units that reproduce the model exactly, legal cuts, skip connections, tied weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import examples.amoebanet as amoebanet
import examples.gpt as gpt
import examples.resnet as resnet
from planner.errors import InputError
from planner.schema import structure_sha256
from profiler.split import default_leaves, split_model

EXAMPLES = {"gpt": gpt.tiny, "resnet": resnet.tiny, "amoebanet": amoebanet.tiny}


def _entry(name: str) -> tuple[nn.Module, tuple[Tensor, ...]]:
    res = EXAMPLES[name]()
    return res[0], tuple(res[1])


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_units_reproduce_the_model_and_its_gradients(name: str) -> None:
    model, inputs = _entry(name)
    split = split_model(model, inputs)
    assert len(split) >= 6
    # BatchNorm trains on batch statistics: same inputs -> same outputs on both runs
    ref = model(*inputs)
    ref.float().pow(2).mean().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    out = split.run(*inputs)
    assert torch.equal(out, ref)
    out.float().pow(2).mean().backward()
    got = _grads(model)
    assert want.keys() == got.keys() and len(want) == len(list(model.parameters()))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_units_chain_through_cut_tuples() -> None:
    model, inputs = _entry("gpt")
    split = split_model(model, inputs)
    x: Any = inputs
    for i, unit in enumerate(split.units):
        x = unit(*x)
        if i < len(split) - 1:
            assert isinstance(x, tuple) and all(isinstance(t, Tensor) for t in x)
            assert len(x) == len(split.cut_values[i])
    with torch.no_grad():
        assert torch.equal(split.rebuild_output(x), model(*inputs))


def test_default_granularity_is_the_blocks() -> None:
    model, inputs = _entry("gpt")
    assert default_leaves(model) == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert split_model(model, inputs).names == default_leaves(model)
    model, inputs = _entry("resnet")
    names = split_model(model, inputs).names
    assert names[0] == "stem" and names[-1] == "fc"
    assert [n for n in names if n.startswith("stages.")] == [f"stages.{i}.{j}" for i in range(3) for j in range(2)]


def test_sequential_model_splits_per_child() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    split = split_model(model, x)
    assert split.names == ["0", "1", "2", "3", "4"]
    assert all(len(c) == 1 for c in split.cut_values)  # a chain: one tensor per cut
    assert torch.equal(split.run(x), model(x))
    assert split.param_bytes() == [(8 * 16 + 16) * 4, 0, (16 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4]


def test_tied_weights_are_counted_once_and_reported_shared() -> None:
    model, inputs = _entry("gpt")
    split = split_model(model, inputs)
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups
    assert sum(split.param_bytes()) == unique
    head = split.names.index("head")
    assert split.param_bytes()[head] == 2 * 64 * 4  # only the final LayerNorm: the projection is tied
    (group,) = split.shared_parameters()
    assert [i for i, _ in group] == [0, head]
    shared = [dict(split.units[i].named_parameters())[n] for i, n in group]
    assert shared[0] is shared[1] is model.embed.tok.weight
    untied = gpt.build(gpt.GPTConfig(tied=False))
    assert split_model(untied[0], untied[1]).shared_parameters() == []


def test_units_share_the_models_parameters() -> None:
    model, inputs = _entry("resnet")
    split = split_model(model, inputs)
    model_params = {id(p) for p in model.parameters()}
    unit_params = {id(p) for u in split.units for p in u.parameters()}
    assert unit_params == model_params


def test_sha256_matches_structure_hash() -> None:
    model, inputs = _entry("amoebanet")
    split = split_model(model, inputs)
    assert split.sha256() == structure_sha256(split.names, split.param_bytes())
    other = amoebanet.build(amoebanet.AmoebaConfig(channels=8))
    assert split_model(other[0], other[1]).sha256() != split.sha256()


def test_skip_connections_cross_several_cuts() -> None:
    model, inputs = _entry("amoebanet")
    split = split_model(model, inputs)
    widths = [len(c) for c in split.cut_values]
    assert max(widths) == 3  # prev, prev-prev and the long skip
    assert widths[0] == 1 and widths[-1] == 1
    # every cut between cells carries the previous-previous state
    assert all(w >= 2 for w in widths[1:-1])
    assert any(not all(flags) for flags in split.cut_produced_by_previous)
    chain = amoebanet.build(amoebanet.AmoebaConfig(long_skip=0))
    assert max(len(c) for c in split_model(chain[0], chain[1]).cut_values) == 2


def test_every_crossing_value_is_produced_before_and_consumed_after() -> None:
    model, inputs = _entry("amoebanet")
    split = split_model(model, inputs)
    g = split.dataflow
    for cut, names in enumerate(split.cut_values):
        for name in names:
            assert g.nodes[name]["segment"] <= cut
            assert any(g.nodes[v]["segment"] > cut for v in g.successors(name))


def test_keyword_arguments_are_fixed_to_their_defaults() -> None:
    model, inputs = _entry("gpt")
    split = split_model(model, inputs)
    with torch.no_grad():
        assert torch.equal(split.run(*inputs), model(*inputs, causal=True))
        assert not torch.equal(split.run(*inputs), model(*inputs, causal=False))


class _NeedsArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: Tensor, scale: Tensor) -> Tensor:
        out: Tensor = self.a(x) * scale
        return out


def test_missing_input_without_default_is_a_clear_error() -> None:
    with pytest.raises(InputError, match="'scale' has no default"):
        split_model(_NeedsArg(), torch.ones(2, 4))
    split = split_model(_NeedsArg(), (torch.ones(2, 4), torch.full((2, 1), 2.0)))
    assert split.names == ["a"]


class _SizeUsedLate(nn.Module):
    """``x.size(1)`` (an int) is read before the first layer and used after the last."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        n = x.size(1)
        y = self.b(self.a(x))
        out: Tensor = self.c(y).reshape(-1, n * 2)
        return out


def test_shape_values_crossing_cuts_are_specialized_or_recomputed() -> None:
    """``x.size(1)`` is a constant of the model; ``x.size(0)`` scales with the batch."""
    model = _SizeUsedLate()
    x = torch.randn(4, 6)
    split = split_model(model, x)
    assert split.names == ["a", "b", "c"]
    for batch in (2, 4, 6):  # the model reshapes to (-1, 12): even batches
        xb = torch.randn(batch, 6)
        assert torch.equal(split.run(xb), model(xb))

    class _BatchShape(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

        def forward(self, x: Tensor) -> Tensor:
            shape = x.shape  # (batch, 6): crosses the cut, its batch entry recomputed after it
            out: Tensor = self.b(self.a(x)).reshape(shape[0], -1)
            return out

    split = split_model(_BatchShape(), x)
    assert split.names == ["a", "b"] and len(split.cut_values[0]) == 1  # only the tensor is sent
    for batch in (1, 3, 8):
        xb = torch.randn(batch, 6)
        assert torch.equal(split.run(xb), split.model(xb))


class _SquareUsedLate(nn.Module):
    """An int that grows with the square of the batch crosses the cut: it cannot be sent
    (not a tensor) nor recomputed (not k * batch + c)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0] * x.shape[0]
        y = self.b(self.a(x))
        out: Tensor = y * n
        return out


def test_cuts_crossed_by_values_that_cannot_cross_are_merged_with_a_warning() -> None:
    from profiler.split import CutWarning

    model = _SquareUsedLate()
    x = torch.randn(4, 6)
    with pytest.warns(CutWarning) as record:
        split = split_model(model, x)
    assert len(split) == 1 and split.anchors == [["a", "b"]]
    cut_warnings = [r for r in record if issubclass(r.category, CutWarning)]
    assert len(cut_warnings) == 1
    text = str(cut_warnings[0].message)
    # names both blocks and the user's line, never an fx node name
    assert "'a' and 'b'" in text and "test_profiler_split.py" in text and "n = x.shape[0] * x.shape[0]" in text
    assert "mul" not in text.replace("multiple", "")
    assert split.warnings == [text]
    assert torch.equal(split.run(x), model(x))
    with pytest.raises(InputError, match=r"cannot cut before 'b': an int .*n = x.shape\[0\] \* x.shape\[0\]"):
        split_model(model, x, split_points=["b"])


def test_split_points_cut_before_the_named_modules() -> None:
    model, inputs = _entry("gpt")
    split = split_model(model, inputs, split_points=["blocks.1", "blocks.3"])
    assert split.names == ["embed", "blocks.1", "blocks.3"]
    assert split.anchors == [["embed", "blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3", "head"]]
    with torch.no_grad():
        assert torch.equal(split.run(*inputs), model(*inputs))


def test_split_point_inside_a_block_opens_it() -> None:
    model, inputs = _entry("gpt")
    split = split_model(model, inputs, split_points=["blocks.1.mlp"])
    assert len(split) == 2
    assert "blocks.1.attn" in split.anchors[0] and split.anchors[1][0] == "blocks.1.mlp"
    # the residual stream and the LayerNorm output feeding the MLP both cross the cut
    assert len(split.cut_values[0]) == 2
    with torch.no_grad():
        assert torch.equal(split.run(*inputs), model(*inputs))


def test_bad_split_point_names_the_value_and_the_choices() -> None:
    model, inputs = _entry("gpt")
    with pytest.raises(InputError, match=r"'blocks\.9'.*blocks\.0"):
        split_model(model, inputs, split_points=["blocks.9"])


def test_stage_module_runs_a_range() -> None:
    model, inputs = _entry("resnet")
    split = split_model(model, inputs)
    with torch.no_grad():  # units run as the model trains (BatchNorm on batch statistics)
        first = split.stage_module(0, 3)(*inputs)
        assert isinstance(first, tuple)
        rest = split.stage_module(3, len(split))(*first)
        assert torch.equal(rest, model(*inputs))
        stage = split.stage_module(2, 5)
        assert len(list(stage.parameters())) == len({id(p) for u in split.units[2:5] for p in u.parameters()})
    with pytest.raises(InputError, match=r"\[3, 3\)"):
        split.stage_module(3, 3)


def test_split_leaves_model_state_alone() -> None:
    model, inputs = _entry("resnet")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    rng = torch.get_rng_state()
    split_model(model, inputs)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


class _RandomSkips(nn.Module):
    def __init__(self, width: int, layers: int, skips: list[tuple[int, int]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.skips = skips

    def forward(self, x: Tensor) -> Tensor:
        outs = [x]
        for i, layer in enumerate(self.layers):
            y = layer(outs[-1])
            for src, dst in self.skips:
                if dst == i:
                    y = y + outs[src]
            outs.append(y)
        return outs[-1]


@settings(max_examples=15, deadline=None)
@given(
    layers=st.integers(min_value=2, max_value=7),
    data=st.data(),
)
def test_random_skip_graphs_split_exactly(layers: int, data: st.DataObject) -> None:
    """Any skip pattern: exact results; a skip from output s to layer d crosses cuts s..d-1."""
    pairs = [(s, d) for d in range(layers) for s in range(d)]
    skips = data.draw(st.lists(st.sampled_from(pairs), unique=True, max_size=4)) if pairs else []
    torch.manual_seed(0)
    model = _RandomSkips(4, layers, skips)
    x = torch.randn(3, 4)
    split = split_model(model, x)
    assert len(split) == layers
    assert torch.equal(split.run(x), model(x))
    for cut in range(layers - 1):
        # outs[k] is available after cut k-1 (outs[0] = input); it is needed by layer k and skips
        needed = {k for k in range(layers + 1) if k <= cut + 1 and (k == cut + 1 or any(s == k and d > cut for s, d in skips))}
        assert len(split.cut_values[cut]) == len(needed), (skips, cut, split.cut_values[cut])


def test_split_for_profile_rebuilds_and_checks() -> None:
    from pathlib import Path

    from planner.errors import PlanMismatchError
    from planner.schema import load_document
    from profiler.split import split_for_profile

    path = Path(__file__).resolve().parents[2] / "examples" / "profiles" / "gpt-tiny-cpu.json"
    prof = load_document("profile", str(path))
    model, inputs = _entry("gpt")
    assert split_for_profile(model, inputs, prof).names == prof.layer_names()
    wider = gpt.build(gpt.GPTConfig(hidden=128))
    with pytest.raises(PlanMismatchError, match="'embed' holds"):
        split_for_profile(wider[0], wider[1], prof)
    other, oinputs = _entry("resnet")
    with pytest.raises(PlanMismatchError, match="its layers are"):
        split_for_profile(other, oinputs, prof)


class _Reused(nn.Module):
    """One block applied twice (weight sharing across depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.block(torch.relu(self.inp(x)))
        y: Tensor = self.out(self.block(torch.relu(h)))
        return y


def test_a_module_called_twice_is_two_layers_sharing_weights() -> None:
    torch.manual_seed(0)
    model, x = _Reused(), torch.randn(3, 4)
    split = split_model(model, x)
    assert split.names == ["inp", "block", "block#1", "out"]
    assert split.param_bytes()[2] == 0  # counted on the first use
    assert sorted(split.shared_parameters()) == [[(1, "block.bias"), (2, "block.bias")], [(1, "block.weight"), (2, "block.weight")]]
    assert torch.equal(split.run(x), model(x))


def test_profiler_package_exposes_names_lazily() -> None:
    import subprocess
    import sys

    code = "import sys, profiler; assert 'torch' not in sys.modules; profiler.synth_transformer; assert 'torch' not in sys.modules; profiler.split_model; assert 'torch' in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0


class _NanoGPTLike(nn.Module):
    """nanoGPT's layout: a ModuleDict of embeddings, blocks and final norm, a size assert
    and shape arithmetic at the root, an optional ``targets`` argument."""

    def __init__(self, vocab: int = 50, seq: int = 16, h: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.seq = seq
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, h),
                "wpe": nn.Embedding(seq, h),
                "h": nn.ModuleList([nn.Sequential(nn.LayerNorm(h), nn.Linear(h, h)) for _ in range(layers)]),
                "ln_f": nn.LayerNorm(h),
            }
        )
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.transformer["wte"].weight = self.lm_head.weight

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        _, t = idx.size()
        assert t <= self.seq, f"cannot forward a sequence of {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer["wte"](idx) + self.transformer["wpe"](pos)
        for block in self.transformer["h"]:
            x = x + block(x)
        logits: Tensor = self.lm_head(self.transformer["ln_f"](x))
        if targets is not None:
            return logits.sum()
        return logits


def test_nanogpt_layout_with_assert_and_optional_targets() -> None:
    torch.manual_seed(0)
    model = _NanoGPTLike()
    idx = torch.randint(0, 50, (2, 16))
    split = split_model(model, idx)
    blocks = [f"transformer.h.{i}.{j}" for i in range(3) for j in range(2)]  # nested containers open up
    assert split.names == ["transformer.wte", "transformer.wpe", *blocks, "transformer.ln_f", "lm_head"]
    assert len(split.cut_values[2]) == 2  # residual stream + LayerNorm output
    assert torch.equal(split.run(idx), model(idx))
    assert len(split.shared_parameters()) == 1 and sum(split.param_bytes()) == sum(p.numel() * 4 for p in model.parameters())
    # the tracer specialized the assert to the example, it did not drop the model's state
    assert model.training


class _Branchy(nn.Module):
    def __init__(self, on_values: bool) -> None:
        super().__init__()
        self.on_values = on_values
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.a(x)
        if self.on_values:
            if y.sum() > 0:  # a value: cannot be specialized
                y = -y
        elif x.dim() == 2 and x.shape[1] == 4:  # shapes: specialized like torch.export does
            y = y * 2
        out: Tensor = self.b(y)
        return out


def test_control_flow_on_shapes_is_specialized_on_values_refused() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = _Branchy(on_values=False)
    assert torch.equal(split_model(model, x).run(x), model(x))
    with pytest.raises(InputError, match="depends on tensor values"):
        split_model(_Branchy(on_values=True), x)


class _KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor, *, mask: Tensor) -> Tensor:
        out: Tensor = self.b(self.a(x) * mask)
        return out


def test_keyword_only_and_dict_inputs() -> None:
    """``forward(x, *, mask)`` takes ``(x, mask)`` (mask bound by keyword) or a dict."""
    from profiler.loading import check_entrypoint_result

    torch.manual_seed(0)
    model, x, mask = _KeywordOnly(), torch.randn(3, 4), torch.ones(3, 4)
    entry = check_entrypoint_result((model, (x, mask)), spec="t")
    assert entry.keywords == ("mask",)
    split = split_model(model, (x, mask))
    assert split.names == ["a", "b"] and split.keywords == ("mask",)
    assert torch.equal(split.run(x, mask), model(x, mask=mask))
    as_dict = check_entrypoint_result((model, {"x": x, "mask": mask}), spec="t")
    assert as_dict.keywords == ("x", "mask") and torch.equal(as_dict.call(model, as_dict.example_inputs), model(x, mask=mask))
    with pytest.raises(InputError, match="'mask' has no default"):
        split_model(model, x)
    with pytest.raises(InputError, match="'masks' is not a parameter"):
        check_entrypoint_result((model, {"x": x, "masks": mask}), spec="t")


class _ValueBranchInside(nn.Module):
    """torch.export refuses the data-dependent branch in ``gate``; torch.fx keeps ``gate`` a
    leaf, and the root tests a dtype (not a value)."""

    class Gate(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x * 2 if x.sum() > 0 else -x

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.gate = self.Gate()
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        out: Tensor = self.b(self.gate(self.a(x)))
        return out


def test_fx_captures_what_export_refuses() -> None:
    torch.manual_seed(0)
    model, x = _ValueBranchInside(), torch.randn(3, 4)
    split = split_model(model, x)
    assert split.method == "torch.fx" and split.names == ["a", "gate", "b"]
    assert torch.equal(split.run(x), model(x)) and torch.equal(split.run(-x), model(-x))


class _InplaceFirst(nn.Module):
    """torchvision's ResNet root: ``ReLU(inplace=True)`` is a layer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16, 2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc(torch.flatten(self.pool(self.relu(self.conv(x))), 1))
        return out


def test_a_unit_writing_into_its_input_clones_it() -> None:
    torch.manual_seed(0)
    model, x = _InplaceFirst(), torch.randn(2, 3, 4, 4)
    split = split_model(model, x)
    assert split.names == ["conv", "relu", "pool", "fc"]
    # as a pipeline stage receives it: a fresh leaf that requires grad
    h = split.units[0](x)[0].detach().requires_grad_(True)
    out = split.units[1](h)[0]
    out.sum().backward()
    assert h.grad is not None and torch.equal(h.grad, (h > 0).float())
    assert not torch.equal(h, out)  # the leaf itself was not written
    assert "clone" in split.units[1].code and "clone" not in split.units[2].code


def test_stage_boundaries_send_contiguous_tensors() -> None:
    """ConvNeXt in channels_last: a pipeline stage returns contiguous tensors, and the
    gradient it sends back for its input is contiguous too."""
    import examples.vision as vision

    model, (x,), _ = vision.convnext()
    split = split_model(model, x)
    first = split.units[0](x)
    assert not all(t.is_contiguous() for t in first)  # channels_last inside
    stage = split.stage_module(0, 3, pipeline=True)
    sent = stage(x)
    assert all(t.is_contiguous() for t in sent)
    received = tuple(t.detach().requires_grad_(True) for t in sent)
    out = split.stage_module(3, 5, pipeline=True)(*received)
    # torch.distributed.pipelining takes input gradients with autograd.grad (no layout contract)
    grads = torch.autograd.grad(list(out), list(received), [torch.ones_like(t) for t in out])
    assert all(g.is_contiguous() for g in grads)


class _DropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.drop(self.fc(x))
        return out


class _SharedBlockTwice(nn.Module):
    """One block (with dropout) under two names, as T5's shared embedding is
    ``encoder.embed_tokens`` and ``decoder.embed_tokens``."""

    def __init__(self) -> None:
        super().__init__()
        block = _DropBlock()
        self.first = nn.ModuleList([block])
        self.second = nn.ModuleList([block])

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.second[0](torch.tanh(self.first[0](x)))
        return out


def test_random_streams_are_the_same_in_the_units_and_the_model() -> None:
    from profiler.split import RngStreams

    torch.manual_seed(0)
    model, x = _SharedBlockTwice(), torch.randn(16, 8)
    split = split_model(model, x)
    assert split.names == ["first.0", "second.0"]
    streams = RngStreams(seed=7, step=2, microbatch=1)
    stage = split.stage_module(0, 2)
    stage.rng = streams
    hooks = split.seed_hooks(model, streams)
    for microbatch in range(3):
        streams.microbatch = microbatch
        got, want = stage(x), model(x)
        assert torch.equal(got, want)
        assert (got == 0).any()  # dropout really dropped something
    for h in hooks:
        h.remove()
    streams.microbatch = 0
    first = stage(x)
    streams.microbatch = 1
    assert not torch.equal(stage(x), first)  # another micro-batch, another mask
