"""Megatron's selective recompute, measured per unit: attention's score tensors a unit keeps for
backward, and the time to recompute them (``LayerProfile.selective_recompute_bytes`` and
``selective_recompute_ms``; the planner's :func:`planner.mesh.selective_layer` prices them).

**Score tensors.**  One forward of the unit runs under a dispatch mode that sees every ATen
operator (below autograd) and follows where attention's scores go:

* a *score* tensor is the output of a batched matrix product (``bmm``, ``baddbmm``) of two
  operands that are not scores, whose last two dimensions are both sequence lengths of the
  unit's inputs (``q @ k^T``: ``[b·a, s, s]``; ``[b·a, s_q, s_k]`` in cross-attention, the
  encoder's output being an input of the decoder block); and every tensor an operator that is not a
  matrix product derives from a score tensor, whatever its shape (the scale, the mask, the
  softmax, its dtype casts, the dropout's output *and* its mask, views);
* a matrix product with a score operand (probabilities @ values: the context) ends the chain.

Shape alone is not enough: with a head size equal to the sequence length (tiny configurations)
the queries, keys and values are ``[b, a, s, s]`` too, but they come from linear layers, not
from a batched product, so they never count; and the context product, ``[b·a, s, s]`` then as
well, has a score operand, so it does not either.  (A 4-D test on the saved tensors alone,
"last two dimensions equal to the sequence length", would count both: a tiny T5's decoder,
head size 8 and 8 target positions, is one.)  A score-shaped tensor the unit did not compute
from its queries and keys (a causal-mask buffer, a relative position bias) is not counted
either: selective recompute keeps it.  Sequence lengths: every dimension of the unit's integer
inputs and every dimension but the last (the features) of its floating inputs.

**Bytes**: the storages of score tensors the unit saves for backward (``saved_tensors_hooks``,
each storage once, parameters and buffers excluded), as the unit's ``activation_bytes`` counts
them: the softmax's output, the dropout's mask and output (one storage when the dropout is off
and the softmax output is what the context product saves).

**Time, measured**: the operators of the chain (the score product, scale, mask, softmax,
dropout, the context product; what Megatron's selective recompute reruns) are recorded with
their arguments and replayed alone, interleaved with forwards of the whole unit, both timed by
the profiler's timer without autograd, ``REPEATS`` times after a warm-up; the ratio of the
medians (at most 1) times the unit's measured forward time is ``selective_recompute_ms``.  The
ratio, not the replay's own time, so the recompute carries its share of the forward's autograd
overhead and both timings see the same machine load.

A unit whose attention is fused (``scaled_dot_product_attention`` with a flash or
memory-efficient kernel, which saves no score matrix) has no score tensors: it gets no fields,
and the planner does not offer selective recompute for it (there is nothing to drop).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from profiler import _torch_private

#: replays of the attention core and of the whole unit (each), after one warm-up of both
REPEATS = 5

_aten = torch.ops.aten
#: batched matrix products: the score product (no score operand) and the context product
_PRODUCTS = {_aten.bmm.default, _aten.baddbmm.default}
#: other matrix products: never derive a score from a score
_CONTRACTIONS = _PRODUCTS | {_aten.mm.default, _aten.addmm.default, _aten.matmul.default}


def sequence_lengths(inputs: Sequence[Any]) -> set[int]:
    """The dimensions of the unit's inputs that can be a sequence length (see the module doc)."""
    out: set[int] = set()
    for t in inputs:
        if isinstance(t, Tensor) and t.dim() >= 1:
            dims = t.shape if not t.is_floating_point() else t.shape[:-1]
            out.update(int(d) for d in dims if d > 1)
    return out


def score_key(t: Tensor) -> int:
    """The key :class:`ScoreChain` knows a tensor by: its storage (views of a score are scores)."""
    return int(t.untyped_storage().data_ptr()) if t.untyped_storage().nbytes() else -1



def _tensors(value: Any) -> list[Tensor]:
    leaves, _ = _torch_private.tree_flatten(value)
    return [x for x in leaves if isinstance(x, Tensor)]


@dataclass
class ScoreChain:
    """Follows attention's score tensors through a unit's operator calls, in order (the rule of
    the module doc): :meth:`see` each call with its output.  The profiler records the chain's
    calls to time them; the runtime's selective recompute (:mod:`runtime.selective`) recomputes
    the calls that make a score and keeps every other output."""

    seq: set[int]
    scores: set[int] = field(default_factory=set)
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    #: keep the chain's calls (with their arguments) in :attr:`calls`
    record: bool = True
    #: the score tensors seen, held so that no other tensor reuses a score's storage (the key)
    #: while the chain is followed: a transient of the unit's forward, dropped with the chain
    held: list[Tensor] = field(default_factory=list)

    def see(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
        """Record one operator call; True when it made a score tensor (the score product, and
        every call deriving from a score that is not a matrix product)."""
        ins = _tensors((args, kwargs))
        score_in = any(score_key(t) in self.scores for t in ins if t.untyped_storage().nbytes())
        outs = _tensors(out)
        if func in _PRODUCTS and not score_in:
            new = [t for t in outs if t.dim() >= 3 and {int(t.shape[-2]), int(t.shape[-1])} <= self.seq]
        elif func not in _CONTRACTIONS and score_in:
            new = outs
        else:
            new = []
        if self.record and (score_in or new):
            self.calls.append((func, args, kwargs))
        new = [t for t in new if t.untyped_storage().nbytes()]
        self.scores.update(score_key(t) for t in new)
        self.held.extend(new)
        return bool(new)


def _tracer(trace: ScoreChain) -> Any:
    base = _torch_private.dispatch_mode()

    class Tracer(base):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            trace.see(func, args, kwargs, out)
            return out

    return Tracer()


@dataclass
class ScoreTrace:
    """One unit's score tensors: the bytes it keeps of them, and the recorded attention core."""

    saved_bytes: int
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]]


def trace_scores(unit: nn.Module, inputs: Sequence[Any], *, exclude: set[int]) -> ScoreTrace:
    """Run ``unit`` forward once (with autograd, as in training) and find its score tensors.

    ``inputs``: the unit's inputs (fresh leaves; those that need a gradient do); ``exclude``:
    storages of the model's parameters and buffers."""
    trace = ScoreChain(sequence_lengths(inputs))
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        saved.setdefault(score_key(t), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _tracer(trace):
        out = unit(*inputs)
    del out
    nbytes = sum(nb for key, nb in saved.items() if key in trace.scores and key not in exclude)
    return ScoreTrace(nbytes, trace.calls if nbytes else [])


def recompute_share(
    unit: nn.Module,
    inputs: Sequence[Any],
    calls: Sequence[tuple[Any, tuple[Any, ...], dict[str, Any]]],
    time: Callable[[Callable[[], Any]], tuple[float, Any]],
    *,
    repeats: int = REPEATS,
) -> float:
    """The attention core's share (0 to 1) of the unit's forward: the recorded ``calls``
    replayed and the whole unit run, without autograd, interleaved, ``time`` (the profiler's
    timer) on each; the ratio of the medians.  The RNG is left as it was."""

    def core() -> None:
        for func, args, kwargs in calls:
            func(*args, **kwargs)

    def whole() -> None:
        unit(*inputs)

    devices = sorted({t.device.index or 0 for t in _tensors(inputs) if t.device.type == "cuda"})
    t_core: list[float] = []
    t_unit: list[float] = []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for rep in range(1 + repeats):
            a, _ = time(core)
            b, _ = time(whole)
            if rep:
                t_core.append(a)
                t_unit.append(b)
    whole_ms = statistics.median(t_unit)
    if whole_ms <= 0:
        return 0.0
    return min(1.0, statistics.median(t_core) / whole_ms)
