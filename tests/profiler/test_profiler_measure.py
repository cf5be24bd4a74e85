"""profiler.profile: schema, activation bytes, upstream gradients, and the user's model untouched."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import examples.amoebanet as amoebanet
import examples.gpt as gpt
import examples.resnet as resnet
import profiler
from planner.errors import InputError
from planner.schema import Profile, parse_document
from profiler.loading import default_loss
from profiler.measure import reference_pass, resize_batch
from profiler.split import split_model

FAST = {"warmup": 1, "repeats": 3, "progress": False, "num_threads": 1}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_profile_is_a_valid_document_with_the_model_fingerprint() -> None:
    model, inputs, loss = gpt.tiny()
    p = profiler.profile(model, inputs, microbatch_sizes=(2, 1), loss_fn=loss, **FAST)
    assert isinstance(p, Profile)
    assert parse_document("profile", p.model_dump(mode="json")) == p
    assert p.microbatch_sizes == [1, 2]
    assert p.sha256() == split_model(model, inputs).sha256()
    assert p.layer_names() == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert [layer.kind for layer in p.layers] == ["Embedding", "Block", "Block", "Block", "Block", "Head"]
    assert p.measured_on.device == "cpu" and p.measured_on.num_threads == 1
    assert p.measured_on.dtype == "float32" and p.measured_on.torch_version == torch.__version__
    assert p.input_bytes == [32 * 8, 2 * 32 * 8]
    # a layer of a tiny model may time at 0 on a coarse clock (the cost model's fit keeps it
    # positive); the model as a whole takes time
    assert sum(layer.forward_ms[0] for layer in p.layers) > 0 and sum(layer.backward_ms[0] for layer in p.layers) > 0
    for layer in p.layers:
        assert all(t >= 0 for t in layer.forward_ms + layer.backward_ms)
        assert layer.forward_ms_spread is not None and all(s >= 0 for s in layer.forward_ms_spread)
        assert layer.activation_bytes[1] > layer.activation_bytes[0]
    blocks = [layer for layer in p.layers if layer.name.startswith("blocks.")]
    assert all(b.output_bytes == [32 * 64 * 4, 2 * 32 * 64 * 4] for b in blocks)
    assert all(b.flops is not None and b.flops[1] == pytest.approx(2 * b.flops[0]) for b in blocks)
    assert p.layers[-1].output_bytes == [32 * 256 * 4, 2 * 32 * 256 * 4]  # the logits
    (group,) = p.metadata["profiler"]["shared_parameters"]
    assert [i for i, _ in group] == [0, 5] and group[0][1] == group[1][1]  # one tensor, named once


def test_tied_weights_are_counted_once() -> None:
    model, inputs, loss = gpt.tiny()
    p = profiler.profile(model, inputs, microbatch_sizes=(1,), loss_fn=loss, **FAST)
    assert sum(layer.param_bytes for layer in p.layers) == sum(q.numel() * 4 for q in model.parameters())
    assert p.layers[-1].param_bytes == 2 * 64 * 4


def test_activation_bytes_are_the_saved_tensors_once_each() -> None:
    """Linear saves its input; ReLU saves its output, which the next Linear saves again
    (the same storage: counted once, on ReLU); weights are parameters, never counted."""
    p = profiler.profile(_mlp(), torch.randn(4, 16), microbatch_sizes=(1, 3), **FAST)
    assert [layer.activation_bytes for layer in p.layers] == [[16 * 4, 3 * 16 * 4], [32 * 4, 3 * 32 * 4], [0, 0]]
    assert [layer.output_bytes for layer in p.layers] == [[128, 384], [128, 384], [32, 96]]
    assert all(layer.cut_bytes == layer.output_bytes for layer in p.layers)  # a chain: no skips


def test_skip_connections_make_cut_bytes_larger_than_outputs() -> None:
    model, inputs = amoebanet.tiny()
    p = profiler.profile(model, inputs, microbatch_sizes=(1, 2), **FAST)
    cells = [layer for layer in p.layers if layer.name.startswith("cells.")]
    assert all(c.cut_bytes is not None for c in cells)
    assert all(c.cut_bytes[i] > c.output_bytes[i] for c in cells[:-1] for i in range(2))
    assert max(c.transfer_bytes()[0] for c in cells) == 3 * cells[0].output_bytes[0]


def test_resize_batch_slices_and_repeats() -> None:
    x = torch.arange(3).view(3, 1)
    assert resize_batch((x,), 2)[0].flatten().tolist() == [0, 1]
    assert resize_batch((x,), 7)[0].flatten().tolist() == [0, 1, 2, 0, 1, 2, 0]
    y = resize_batch((x,), 2)[0]
    assert y.untyped_storage().nbytes() == 2 * 8  # compact: not a view of the example


def test_backward_gets_the_real_upstream_gradients() -> None:
    model, inputs = resnet.build(resnet.ResNetConfig())
    work = copy.deepcopy(model)
    split = split_model(work, inputs)
    ref = reference_pass(split, inputs, resnet.class0_loss)
    # the same gradients by plain autograd on the whole model, captured at every cut
    whole = copy.deepcopy(model)
    wsplit = split_model(whole, inputs)
    x = inputs
    outs = []
    for i, unit in enumerate(wsplit.units):
        x = unit(*x)
        if i < len(wsplit) - 1:
            for t in x:
                t.retain_grad()
            outs.append(x)
    resnet.class0_loss(wsplit.rebuild_output(x)).backward()
    for i, cut in enumerate(outs):
        got = ref.upstream[i]
        assert got is not None
        for t, g in zip(cut, got, strict=True):
            assert g is not None and t.grad is not None
            torch.testing.assert_close(g, t.grad)
            assert not torch.all(g == g.flatten()[0])  # not a constant (ones) stand-in
    assert ref.upstream[-1] is None


def test_user_model_state_is_untouched() -> None:
    model, inputs, loss = resnet.tiny()
    model.eval()  # the profiler trains a copy; the user's flag must stay
    model.layer_flag = "keep"  # type: ignore[assignment]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: m.training for n, m in model.named_modules()}
    rng = torch.get_rng_state()
    torch.set_num_threads(2)
    p = profiler.profile(model, inputs, microbatch_sizes=(2,), loss_fn=loss, warmup=1, repeats=2, progress=False, num_threads=1)
    assert p.measured_on.num_threads == 1
    assert torch.get_num_threads() == 2
    assert torch.equal(rng, torch.get_rng_state())
    assert {n: m.training for n, m in model.named_modules()} == flags
    after = model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)  # incl. BatchNorm running stats
    assert all(q.grad is None for q in model.parameters())
    assert any("running_mean" in k for k in state)


def test_profile_can_detect_a_mutation() -> None:
    """The state comparison above can fail: a training step does change BatchNorm stats."""
    model, inputs, loss = resnet.tiny()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    loss(model(*inputs)).backward()
    assert not all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_progress_and_summary_go_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs = amoebanet.tiny()
    profiler.profile(model, inputs, microbatch_sizes=(1,), warmup=0, repeats=1, progress=True, num_threads=1)
    err = capsys.readouterr().err
    assert "cells.5" in err and "total" in err


def test_bfloat16_profile_halves_parameter_bytes() -> None:
    p32 = profiler.profile(_mlp(), torch.randn(2, 16), microbatch_sizes=(2,), **FAST)
    p16 = profiler.profile(_mlp(), torch.randn(2, 16), microbatch_sizes=(2,), dtype="bfloat16", **FAST)
    assert p16.measured_on.dtype == "bfloat16"
    assert [2 * layer.param_bytes for layer in p16.layers] == [layer.param_bytes for layer in p32.layers]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"microbatch_sizes": (0, 2)}, "positive"),
        ({"dtype": "int8"}, "int8"),
        ({"device": "tpu"}, "tpu"),
        ({"repeats": 0}, "repeats"),
        ({"num_threads": 0}, "num_threads"),
        ({"split_points": ["nope"]}, "nope"),
        ({"clock": "sundial"}, "sundial"),
        ({"clock": "cpu", "num_threads": 2}, "one thread"),
    ],
)
def test_bad_arguments_are_input_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        profiler.profile(_mlp(), torch.randn(2, 16), **{**FAST, **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(InputError, match="--device cpu"):
        profiler.profile(_mlp(), torch.randn(2, 16), device="cuda", **FAST)


@pytest.mark.cuda
def test_cuda_profile_records_peak_memory_and_agrees_with_hooks() -> None:
    model, inputs, loss = gpt.build(gpt.GPTConfig(hidden=256, heads=8, seq=128, vocab=1024))
    p = profiler.profile(model, inputs, microbatch_sizes=(1, 4), device="cuda", loss_fn=loss, **FAST)
    assert p.measured_on.device == "cuda"
    for layer in p.layers:
        assert layer.peak_memory_bytes is not None
        if layer.name.startswith("blocks."):
            # the forward peak holds at least what is saved for backward, and not wildly more
            for hook, peak in zip(layer.activation_bytes, layer.peak_memory_bytes, strict=True):
                assert 0.8 * hook <= peak <= 3 * hook + 4 * 2**20


def test_default_loss_is_documented_mean() -> None:
    out = torch.arange(6.0).view(2, 3)
    assert default_loss(out).item() == pytest.approx(2.5)


def test_flops_count_the_matmuls() -> None:
    p = profiler.profile(_mlp(), torch.randn(4, 16), microbatch_sizes=(4,), **FAST)
    assert p.layers[0].flops == [2 * 4 * 16 * 32]
    assert p.layers[2].flops == [2 * 4 * 32 * 8]


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        out: Tensor = self.b(self.a(x)) * mask
        return out


def test_model_input_used_late_is_carried_across_cuts() -> None:
    torch.manual_seed(0)
    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    p = profiler.profile(_TwoInputs(), (x, mask), microbatch_sizes=(1, 2), **FAST)
    a = p.layers[0]
    assert a.output_bytes == [16, 32]
    assert a.cut_bytes == [32, 64]  # a's output and the mask


@settings(max_examples=8, deadline=None)
@given(
    widths=st.lists(st.integers(min_value=1, max_value=24), min_size=2, max_size=5),
    batch=st.integers(min_value=1, max_value=5),
)
def test_activation_and_cut_bytes_of_random_mlps(widths: list[int], batch: int) -> None:
    """Linear(w_i, w_{i+1}) + ReLU pairs: each Linear keeps its input (the first one the
    model input, the others the ReLU output already counted), each ReLU its output."""
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers)
    p = profiler.profile(model, torch.randn(2, widths[0]), microbatch_sizes=(batch,), warmup=0, repeats=1, progress=False)
    expect_act = []
    expect_out = []
    for i, w in enumerate(widths[1:]):
        expect_act += [batch * widths[0] * 4 if i == 0 else 0, batch * w * 4]
        expect_out += [batch * w * 4, batch * w * 4]
    assert [layer.activation_bytes[0] for layer in p.layers] == expect_act
    assert [layer.transfer_bytes()[0] for layer in p.layers] == expect_out


def test_cpu_clock_is_recorded_and_close_to_wall_time() -> None:
    model, inputs = amoebanet.tiny()
    p = profiler.profile(model, inputs, microbatch_sizes=(2,), clock="cpu", **FAST)
    assert p.metadata["profiler"]["clock"] == "cpu"
    assert all(layer.forward_ms[0] > 0 and layer.backward_ms[0] > 0 for layer in p.layers)
    wall = profiler.profile(model, inputs, microbatch_sizes=(2,), **FAST)
    assert wall.metadata["profiler"]["clock"] == "wall"
    # CPU time never exceeds wall time by much (one thread does all the work)
    assert sum(layer.forward_ms[0] for layer in p.layers) < 5 * sum(layer.forward_ms[0] for layer in wall.layers)


def test_a_size_the_model_cannot_train_at_is_a_clear_error() -> None:
    """BatchNorm1d cannot train on one sample: the error names the size and the fix."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(InputError, match="micro-batch size 1 failed.*drop that size"):
        profiler.profile(model, torch.randn(4, 4), microbatch_sizes=(1, 2), **FAST)
    assert profiler.profile(model, torch.randn(4, 4), microbatch_sizes=(2,), **FAST).num_layers == 3


def test_inputs_that_do_not_fit_the_model_are_a_clear_error() -> None:
    with pytest.raises(InputError, match=r"example inputs \(\(2, 5\) float32\) failed"):
        profiler.profile(_mlp(), torch.randn(2, 5), **FAST)


def test_adaptive_repeats_record_how_the_timing_went(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``repeats`` the profiler repeats adaptively within the budget and records the
    repeats, why it stopped, each median's error and the flagged layers."""
    model = _mlp()
    p = profiler.profile(model, torch.randn(4, 16), microbatch_sizes=(1, 2), warmup=1, progress=False, num_threads=1,
                         time_budget_s=2.0, target_error=0.05)
    meta = p.metadata["profiler"]
    assert len(meta["repeats"]) == 2 and all(r >= 5 for r in meta["repeats"])
    assert meta["adaptive"]["stopped"] and set(meta["adaptive"]["stopped"]) <= {"stable", "budget", "max"}
    assert meta["adaptive"]["target_error"] == 0.05 and meta["timer"]["useful_ms"] > 0
    assert set(meta["median_error"]) == {"1", "2"} and len(meta["median_error"]["2"]) == 3
    for size, stopped in zip(("1", "2"), meta["adaptive"]["stopped"], strict=True):
        unstable = set(meta["unstable"].get(size, []))
        errors = dict(zip(p.layer_names(), meta["median_error"][size], strict=True))
        tiny = set(meta["below_resolution"].get(size, []))
        # every layer is stable, flagged as too fast for the timer, or listed as unstable
        assert all(n in unstable or n in tiny or (e is not None and e <= 0.05) for n, e in errors.items()), meta
        assert stopped != "stable" or not unstable
    # fixed repeats: exactly that many, nothing adaptive
    fixed = profiler.profile(model, torch.randn(4, 16), microbatch_sizes=(2,), **FAST)
    assert fixed.metadata["profiler"]["repeats"] == [3] and fixed.metadata["profiler"]["adaptive"] is None
    # a timer too coarse for every layer: all flagged, none waited for (5 steps, the minimum)
    monkeypatch.setattr("profiler.measure.useful_resolution", lambda floor, tick: 1e9)
    coarse = profiler.profile(model, torch.randn(4, 16), microbatch_sizes=(2,), warmup=0, progress=False, num_threads=1)
    meta = coarse.metadata["profiler"]
    assert meta["below_resolution"] == {"2": coarse.layer_names()} and meta["repeats"] == [5]
    assert meta["adaptive"]["stopped"] == ["stable"] and meta["unstable"] == {}


@pytest.mark.parametrize(("kwargs", "message"), [({"time_budget_s": 0.0}, "time budget"), ({"target_error": 1.5}, "target error")])
def test_adaptive_settings_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InputError, match=message):
        profiler.profile(_mlp(), torch.randn(2, 16), progress=False, **kwargs)  # type: ignore[arg-type]
