"""Recompute is activation checkpointing layer by layer: what a stage really keeps, measured.

``runtime.mesh.apply_mesh(..., checkpointed_layers=N)`` puts each of the stage's first N units
under its own ``torch.utils.checkpoint``.  Measured here on CPU for the zoo GPT
(``examples.gpt:tiny``: embed, blocks.0-3, head) cut into K = 2 stages, over one micro-batch
of 2, with saved-tensor hooks (each storage once, by its ``untyped_storage().data_ptr()``,
parameters and buffers left out, as the profiler counts them), and compared with what the
profile of the same model says (``activation_bytes``, ``cut_bytes``, ``input_bytes`` read by
:func:`planner.cost.layer_costs` at that micro-batch size):

* the forward keeps the input of every checkpointed unit (the stage's input, then what crosses
  the cut before each later one) and the activations of the units after them;
* the backward re-materialises one unit at a time: when unit j re-runs, the inputs of the
  checkpointed units before it are still kept, and the units after it have finished their
  backward and freed what they held.  Unit j's own input is kept by its checkpoint *and* saved
  again by the unit (a pre-LN block's LayerNorm saves its input): one storage, counted once
  here, and counted in the unit's ``activation_bytes`` by the profile.  So the peak is
  ``max_j (inputs of the checkpointed units before j + activation_bytes[j])`` over the
  checkpointed units, and at least what the forward kept -- about one layer's activations on
  top of the kept inputs, where the old whole-stage checkpoint held the whole stage's.

The stages are measured as the pipeline runs them, without the loss: the runtime computes the
loss outside the stage module (the schedule's ``loss_fn``), not checkpointed, so the loss's
saved tensors are not the stage's.  The profile folds them into the head's ``activation_bytes``,
so the last stage is compared fully checkpointed only (the head then keeps only its input, and
its re-run is never the largest term here); the partial cases are on the first stage.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.cost import layer_costs
from profiler.loading import load_entrypoint
from profiler.measure import measure_split, resize_batch, state_storages
from profiler.split import RngStreams, SplitModel, split_model
from runtime.mesh import MeshSpec, apply_mesh
from runtime.modules import CheckpointedUnit, checkpoint_layers

MICROBATCH = 2
STAGES = [(0, 3), (3, 6)]  # embed, blocks.0, blocks.1 | blocks.2, blocks.3, head


class LiveSaved:
    """Bytes of saved storages that are alive now, and the most alive at once since :meth:`mark`.

    A storage is held by owners (the object a saved-tensor hook packs, or a recomputed tensor)
    and released when its last owner dies; each storage counts once however many hold it."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.owners: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def hold(self, t: Any, owner: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return
        if not self.owners.get(key):
            self.size[key] = storage.nbytes()
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.owners[key] = self.owners.get(key, 0) + 1
        weakref.finalize(owner, self._release, key)

    def _release(self, key: int) -> None:
        self.owners[key] -= 1
        if not self.owners[key]:
            self.live -= self.size.pop(key)

    def mark(self) -> None:
        self.peak = self.live


class _Packed:
    """What the forward's saved-tensor hook hands autograd: its death frees the saved tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Recomputed(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts every tensor an operator makes while a checkpoint re-runs a unit (what the
    recomputation holds until the backward consumes it)."""

    def __init__(self, live: LiveSaved) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            self.live.hold(t, t)
        return out


@pytest.fixture(scope="module")
def gpt() -> tuple[SplitModel, tuple[torch.Tensor, ...], Any]:
    """The split model, one micro-batch of its inputs, and its profile's costs at that size."""
    entry = load_entrypoint("examples.gpt:tiny")
    split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
    profile = measure_split(
        split, entry.example_inputs, microbatch_sizes=(MICROBATCH,), loss_fn=entry.loss_fn, warmup=0, repeats=1
    )
    return split, resize_batch(entry.example_inputs, MICROBATCH), layer_costs(profile, MICROBATCH)


def _stage_inputs(split: SplitModel, batch: tuple[torch.Tensor, ...], start: int) -> tuple[torch.Tensor, ...]:
    """What stage ``start`` receives: the model inputs, or fresh contiguous tensors (as sent)."""
    if start == 0:
        return batch
    with torch.no_grad():
        sent = split.stage_module(0, start, pipeline=True)(*batch)
    return tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in sent)


def measure(
    split: SplitModel, batch: tuple[torch.Tensor, ...], stage: tuple[int, int], layers: int, monkeypatch: Any
) -> tuple[int, int]:
    """(bytes kept after the forward, peak bytes during the backward) of ``stage`` with its first
    ``layers`` units checkpointed by the runtime (``apply_mesh``)."""
    live = LiveSaved(state_storages(split))
    import runtime.modules

    counting = functools.partial(
        torch.utils.checkpoint.checkpoint, context_fn=lambda: (contextlib.nullcontext(), _Recomputed(live))
    )
    monkeypatch.setattr(runtime.modules, "checkpoint", counting)
    start, stop = stage
    ins = _stage_inputs(split, batch, start)
    module = apply_mesh(split.stage_module(start, stop, pipeline=True), MeshSpec(), None, checkpointed_layers=layers)
    assert sum(isinstance(u, CheckpointedUnit) for u in module.units) == layers

    def pack(t: torch.Tensor) -> _Packed:
        packed = _Packed(t)
        live.hold(t, packed)
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p.t):
        out = module(*ins)
    kept = live.live
    live.mark()
    torch.autograd.backward(list(out), [torch.ones_like(o) for o in out])
    assert live.live == 0  # everything saved was freed by the backward
    return kept, live.peak


def expected(costs: Any, stage: tuple[int, int], layers: int) -> tuple[float, float]:
    """(kept, backward peak) from the profile: see the module docstring."""
    start, stop = stage
    first_ckpt = start + layers  # first unit that keeps its activations
    received = costs.input_bytes if start == 0 else costs.cut_bytes[start - 1]
    inputs = [received, *costs.cut_bytes[start : first_ckpt - 1]] if layers else []  # each checkpointed unit's
    kept = sum(inputs) + sum(costs.activation_bytes[first_ckpt:stop])
    peak = max([kept] + [sum(inputs[:j]) + costs.activation_bytes[start + j] for j in range(layers)])
    return kept, peak


@pytest.mark.parametrize("stage", STAGES)
def test_a_fully_checkpointed_stage_keeps_its_layers_inputs_and_rebuilds_one_layer_at_a_time(
    gpt: Any, stage: tuple[int, int], monkeypatch: Any
) -> None:
    split, batch, costs = gpt
    start, stop = stage
    kept, peak = measure(split, batch, stage, stop - start, monkeypatch)
    want_kept, want_peak = expected(costs, stage, stop - start)
    # (a) the forward keeps the checkpointed units' inputs: the stage's, and one cut per later unit
    assert kept == pytest.approx(want_kept, rel=0.05), (kept, want_kept)
    # what the cost model prices; a stage holding the model's last layer also keeps that layer's
    # activations there (its loss holds the float32 log-probabilities, LayerCosts.checkpoint_bytes),
    # which this measurement, a backward from ones without the loss, does not see
    loss = costs.activation_bytes[-1] if stop == costs.num_layers else 0.0
    assert kept + loss == pytest.approx(costs.checkpoint_bytes(start, stop), rel=0.05)
    # (b) the backward holds them plus about one layer's activations, not the whole stage's
    assert peak == pytest.approx(want_peak, rel=0.05), (peak, want_peak)
    largest = max(costs.activation_bytes[start:stop])
    assert want_kept < peak <= want_kept + largest
    # not the whole stage's at once (what the old whole-stage checkpoint re-materialised): each
    # stage holds two blocks of equal size, so one layer at a time is about half of it
    whole, _ = measure(split, batch, stage, 0, monkeypatch)  # no recompute: every layer's activations
    assert peak < 0.6 * whole


@pytest.mark.parametrize("layers", [1, 2])
def test_a_partly_checkpointed_stage_keeps_the_other_layers_activations(gpt: Any, layers: int, monkeypatch: Any) -> None:
    """Megatron's ``--recompute-method block`` on the first stage: its first ``layers`` units
    keep their inputs, the rest their activations, and their backward frees those before the
    checkpointed units re-run."""
    split, batch, costs = gpt
    stage = STAGES[0]
    kept, peak = measure(split, batch, stage, layers, monkeypatch)
    want_kept, want_peak = expected(costs, stage, layers)
    assert kept == pytest.approx(want_kept, rel=0.05), (kept, want_kept)
    assert kept == pytest.approx(costs.checkpoint_bytes(*stage, layers), rel=0.05)
    assert peak == pytest.approx(want_peak, rel=0.05), (peak, want_peak)
    more, _ = measure(split, batch, stage, layers + 1, monkeypatch)
    assert more < kept  # one more checkpointed layer keeps less


def test_recompute_draws_the_forwards_random_numbers(monkeypatch: Any) -> None:
    """Dropout on: a stage checkpointed layer by layer gives the loss and gradients of the stage
    run plainly, although the random streams have moved on (next micro-batch) before the
    backward; the checkpoint restores each unit's stream."""
    from examples.gpt import GPTConfig, build, lm_loss

    model, inputs = build(GPTConfig(dropout=0.1))
    split = split_model(model, inputs)

    def step(layers: int) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        stage = split.stage_module(0, len(split))
        stage.rng = RngStreams(seed=5)
        loss = lm_loss(checkpoint_layers(stage, layers)(*inputs))
        stage.rng.microbatch += 1
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step(0)
    for layers in (2, len(split)):
        got_loss, got = step(layers)
        assert got_loss == loss and got.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)
    # without the checkpoint's RNG state the recomputed dropout masks differ: this test can fail
    import runtime.modules

    def forgetful(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(*args, **{**kwargs, "preserve_rng_state": False})

    monkeypatch.setattr(runtime.modules, "checkpoint", forgetful)
    _, wrong = step(len(split))
    assert any(not torch.equal(wrong[n], g) for n, g in grads.items())


def test_checkpoint_layers_refuses_a_count_beyond_the_stage(gpt: Any) -> None:
    split = gpt[0]
    with pytest.raises(ValueError, match="cannot checkpoint 4 layer.* of a stage of 3: give a count from 0 to 3"):
        checkpoint_layers(split.stage_module(0, 3), 4)
