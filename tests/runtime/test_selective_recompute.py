"""Megatron's selective recompute at run time (:mod:`runtime.selective`): each block's attention
core runs under its own checkpoint, so the block keeps what the profile says it keeps
(``activation_bytes - selective_recompute_bytes``), trains exactly like the plain block (the
dropout on the probabilities redraws its mask), and ``pipeplan run --check`` passes end to end (with tensor parallelism, sequence parallelism and
ZeRO too: ``tests/runtime/test_matrix.py``).

Memory is measured on CPU for the zoo GPT with dropout on (``GPTConfig(dropout=0.1)``), one
micro-batch of 2: every tensor an operator makes during a unit's forward is followed (a
dispatch mode, weak references), and what is still alive after the forward, less the unit's
output, is what the unit keeps for its backward -- saved by autograd or by a checkpoint.  The
profile counts the unit's input among its ``activation_bytes`` (the first norm saves it); the
measurement made it outside, so it is added.
"""

from __future__ import annotations

import json
import re
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.cost import layer_costs
from profiler.measure import measure_split, resize_batch, state_storages
from profiler.split import RngStreams, SplitModel, split_model
from runtime.selective import CheckpointedRegion, recompute_attention, recompute_selectively
from tests.runtime.helpers import run_cli

MICROBATCH = 2
MODEL = "examples.gpt:tiny"


class _Alive(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Bytes of the storages operators made that are still alive (each storage once)."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.exclude = exclude
        self.owners: dict[int, list[int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                if key not in self.exclude:
                    self.owners.setdefault(key, [t.untyped_storage().nbytes(), 0])[1] += 1
                    weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.owners[key][1] -= 1
        if not self.owners[key][1]:
            del self.owners[key]

    def bytes(self, but: set[int]) -> int:
        return sum(size for key, (size, _) in self.owners.items() if key not in but)


@pytest.fixture(scope="module")
def gpt() -> tuple[SplitModel, tuple[torch.Tensor, ...], Any, Any]:
    """The split zoo GPT with dropout, one micro-batch, its profile and its costs at that size."""
    from examples.gpt import GPTConfig, build, lm_loss

    model, inputs = build(GPTConfig(dropout=0.1))
    split = split_model(model, inputs)
    profile = measure_split(split, inputs, microbatch_sizes=(MICROBATCH,), loss_fn=lm_loss, warmup=0, repeats=1)
    return split, resize_batch(inputs, MICROBATCH), profile, layer_costs(profile, MICROBATCH)


def _unit_inputs(split: SplitModel, batch: tuple[torch.Tensor, ...], unit: int) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        x = split.stage_module(0, unit)(*batch) if unit else batch
    return tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in x)


def _kept(split: SplitModel, batch: tuple[torch.Tensor, ...], unit: int, *, selective: bool) -> int:
    """Bytes unit ``unit`` keeps after its forward (see the module doc), input not counted."""
    stage = split.stage_module(unit, unit + 1)
    stage.rng = RngStreams(seed=1)
    x = _unit_inputs(split, batch, unit)
    if selective:
        assert recompute_selectively(stage, [x]) == [0]
    alive = _Alive(state_storages(split))
    with alive:
        out = stage(*x)
    return alive.bytes({o.untyped_storage().data_ptr() for o in out})


@pytest.mark.parametrize("unit", [1, 3])
def test_a_selective_block_keeps_what_the_profile_says(gpt: Any, unit: int) -> None:
    split, batch, profile, costs = gpt
    dropped = profile.layers[unit].selective_recompute_bytes[0]
    received = costs.input_bytes if unit == 0 else costs.cut_bytes[unit - 1]
    plain = _kept(split, batch, unit, selective=False)
    kept = _kept(split, batch, unit, selective=True)
    # the plain block keeps its activations (the profile's measure of them)
    assert plain + received == pytest.approx(costs.activation_bytes[unit], rel=0.05)
    # the selective one all of them but the scores: the softmax output, the dropout's mask and output
    assert plain - kept == pytest.approx(dropped, rel=0.05), (plain, kept, dropped)
    assert kept + received == pytest.approx(costs.activation_bytes[unit] - dropped, rel=0.05)


def test_selective_recompute_trains_like_the_plain_model_and_redraws_the_dropout(gpt: Any, monkeypatch: Any) -> None:
    """Dropout on: the whole model with selective recompute gives the plain model's loss and
    gradients bit for bit, although the random streams have moved on before the backward; a
    checkpoint that does not restore the region's random state (monkeypatched) does not."""
    split, batch, _, _ = gpt
    inputs = [_unit_inputs(split, batch, u) for u in range(len(split))]

    def step(selective: bool) -> tuple[float, dict[str, torch.Tensor]]:
        stage = split.stage_module(0, len(split))
        stage.zero_grad(set_to_none=True)
        stage.rng = RngStreams(seed=5)
        if selective:
            assert recompute_selectively(stage, inputs) == [1, 2, 3, 4]  # the blocks, not the embedding or head
        out = stage(*batch)
        loss = sum(o.float().square().mean() for o in out)
        stage.rng.microbatch += 1
        loss.backward()  # type: ignore[union-attr]
        grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
        return loss.item(), grads

    loss, grads = step(False)
    got_loss, got = step(True)
    assert got_loss == loss and got.keys() == grads.keys() and grads
    for name, g in grads.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)
    import runtime.selective

    def forgetful(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(*args, **{**kwargs, "preserve_rng_state": False})

    monkeypatch.setattr(runtime.selective, "checkpoint", forgetful)
    _, wrong = step(True)
    assert any(not torch.equal(wrong[n], g) for n, g in grads.items())


def test_the_region_is_the_attention_core_and_other_units_are_left_alone(gpt: Any) -> None:
    split, batch, _, _ = gpt
    block = recompute_attention(split.units[1], _unit_inputs(split, batch, 1))
    assert block is not None and block is not split.units[1]
    regions = [m for m in block.modules() if isinstance(m, CheckpointedRegion)]
    assert len(regions) == 1
    ops = {str(n.target) for n in regions[0].inner.graph.nodes if n.op == "call_function"}
    # the score product, the softmax and the dropout on the probabilities, the context product
    assert {"aten.matmul.default", "aten.softmax.int", "aten.dropout.default"} <= ops, ops
    assert not any("linear" in op or "layer_norm" in op for op in ops), ops  # the projections stay outside
    # the block's parameters are the original's (shared, same names), in the original's modules:
    # tensor parallelism and FSDP2 replace parameters in their modules, and the runtime reads
    # them through the original (with copied containers, ZeRO 2/3 and T = 2 failed --check)
    assert dict(block.named_parameters()).keys() == dict(split.units[1].named_parameters()).keys()
    assert all(p is q for p, q in zip(block.parameters(), split.units[1].parameters(), strict=True))
    assert all(a is b for a, b in zip(block.children(), split.units[1].children(), strict=False))
    assert block.get_submodule("blocks.0.ln1") is split.units[1].get_submodule("blocks.0.ln1")
    # the embedding and the head make no scores
    assert recompute_attention(split.units[0], _unit_inputs(split, batch, 0)) is None
    assert recompute_attention(split.units[5], _unit_inputs(split, batch, 5)) is None


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeplan.cli import main

    path = tmp_path_factory.mktemp("selective") / "profile.json"
    code = main(["profile", "--model", MODEL, "--microbatch-sizes", "1,2", "--time-budget", "2", "-q", "-o", str(path)])
    assert code == 0
    return path


def _plan(profile: Path, out: Path, *extra: str) -> Path:
    from pipeplan.cli import main

    code = main([
        "plan", str(profile), "--devices", "2", "--devices-per-node", "2", "--device-type", "cpu",
        "--interconnect", "loopback", "--batch-size", "8", "--microbatches", "2", "--no-recompute",
        "--selective-recompute", "--no-sequence-parallel", "-o", str(out), *extra,
    ])  # fmt: skip
    assert code == 0
    assert json.loads(out.read_text())["selective_recompute"] is True
    return out


@pytest.mark.slow
def test_a_selective_plan_runs_and_passes_the_check_with_the_default_optimizer(profile: Path, tmp_path: Path) -> None:
    plan = _plan(profile, tmp_path / "sel.json", "--stages", "2")
    proc, _ = run_cli(["run", "--plan", str(plan), "--model", MODEL, "--steps", "2", "--check", "--timeout", "90"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check PASSED" in proc.stdout
    rows = [r for r in (line.split() for line in proc.stdout.splitlines()) if len(r) > 4 and re.fullmatch(r"\d+:\d+", r[2])]
    assert len(rows) == 2 and all(r[4] == "s" for r in rows), rows  # the stage table's rc column: selective


@pytest.mark.nightly
def test_a_selective_plan_of_hugging_face_gpt2_passes_the_check_with_dropout(tmp_path: Path) -> None:
    """Hugging Face's GPT-2 (eager attention, dropout on in its config): profile, plan with
    selective recompute, ``run --check`` with Adam."""
    from pipeplan.cli import main

    model = "examples.hf:gpt2"
    prof = tmp_path / "gpt2.json"
    assert main(["profile", "--model", model, "--microbatch-sizes", "1,2", "--time-budget", "2", "-q", "-o", str(prof)]) == 0
    layers = json.loads(prof.read_text())["layers"]
    assert sum(bool(x.get("selective_recompute_bytes")) for x in layers) >= 2  # the blocks it drops scores of
    plan = _plan(prof, tmp_path / "sel.json", "--stages", "2")
    proc, _ = run_cli(["run", "--plan", str(plan), "--model", model, "--steps", "2", "--check", "--timeout", "90"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check PASSED" in proc.stdout
