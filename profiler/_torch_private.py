"""Every private torch API the profiler and the runtime use, in one place.

``tests/profiler/test_torch_private.py`` checks each of them, so a torch upgrade that
moves one fails there with its name instead of deep inside a profile or a run.

* ``torch.utils._pytree``: flattening and rebuilding nested values (tuples, dicts,
  ``torch.Size``, Hugging Face ``ModelOutput``, which transformers registers there);
* ``Tensor._version``: the in-place version counter (a unit that writes into its input);
* ``torch._ops.OpOverload`` and its ``_schema``: whether an ATen operator is random or writes
  into an argument (such operations keep their place in the program);
* ``torch.fx._symbolic_trace._maybe_revert_all_patches``: runs real module calls while fx
  is tracing (to evaluate a shape condition on the example inputs);
* ``torch.distributed.pipelining._backward.stage_backward_input`` / ``stage_backward_weight``:
  the backward split into its input-gradient and weight-gradient parts, exactly as the
  pipeline runtime runs a zero-bubble schedule's ``I`` and ``W`` (what the profiler times);
* ``torch.utils._python_dispatch.TorchDispatchMode``: sees every ATen operator a forward runs,
  below autograd (the profiler finds attention's score tensors with it, :mod:`profiler.selective`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.utils._pytree as _pytree

TreeSpec = _pytree.TreeSpec


def tree_flatten(value: Any) -> tuple[list[Any], Any]:
    """Leaves of ``value`` (tuples, lists, dicts, ``torch.Size``, registered types) and its spec."""
    leaves, spec = _pytree.tree_flatten(value)
    return list(leaves), spec


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """Rebuild what :func:`tree_flatten` took apart (a ``torch.Size`` stays one: pytree
    itself rebuilds it as a plain tuple)."""
    return _sizes(_pytree.tree_unflatten(leaves, spec), spec)


def _sizes(value: Any, spec: Any) -> Any:
    """``value`` with every ``torch.Size`` of ``spec`` a ``torch.Size`` again."""
    if spec.type is torch.Size:
        return torch.Size(value)
    children = _children(spec)
    if not any(_has_size(c) for c in children):
        return value
    if spec.type in (tuple, list):
        return spec.type(_sizes(v, c) for v, c in zip(value, children, strict=True))
    if spec.type is dict:
        return {k: _sizes(value[k], c) for k, c in zip(spec.context, children, strict=True)}
    return value


def _has_size(spec: Any) -> bool:
    return spec.type is torch.Size or any(_has_size(c) for c in _children(spec))


def _children(spec: Any) -> list[Any]:
    """The child specs of ``spec`` (``children()`` since torch 2.10; ``children_specs`` before,
    now deprecated)."""
    if hasattr(spec, "children"):
        return list(spec.children())
    return list(spec.children_specs)


def is_leaf_spec(spec: Any) -> bool:
    """Whether ``spec`` describes a single leaf (no container)."""
    return bool(spec.is_leaf())


def version_counter(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (bumped by every in-place write, views included)."""
    return int(t._version)


def op_is_random(target: Any) -> bool | None:
    """For an ATen operator: whether it draws random numbers (``None``: not an ATen operator)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return torch.Tag.nondeterministic_seeded in target.tags


def op_is_mutating(target: Any) -> bool | None:
    """For an ATen operator: whether it writes into an argument (``None``: not an ATen operator)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return bool(target._schema.is_mutable)


def fx_real_calls() -> AbstractContextManager[Any]:
    """A context in which module calls run for real although fx is tracing."""
    import torch.fx._symbolic_trace as symbolic_trace

    revert: Any = getattr(symbolic_trace, "_maybe_revert_all_patches", None)
    return revert() if revert is not None else nullcontext()


def backward_input(
    outputs: list[torch.Tensor],
    output_grads: list[torch.Tensor] | None,
    inputs: list[Any],
    weights: list[Any],
) -> list[dict[str, Any]]:
    """The input-gradient half of a backward (``I``): the gradients of ``inputs`` (accumulated
    into their ``.grad``) from ``outputs`` (a loss when ``output_grads`` is ``None``); returns
    the state the weight-gradient half needs (torch's ``param_groups``)."""
    from torch.distributed.pipelining._backward import stage_backward_input

    # torch detaches the outputs in place afterwards, which a view refuses: give it a copy
    outputs = [o.clone() if o._is_view() else o for o in outputs]
    _, groups = stage_backward_input(outputs, output_grads, inputs, iter(weights))
    return list(groups)


def backward_weight(weights: list[Any], state: list[dict[str, Any]]) -> None:
    """The weight-gradient half (``W``) of :func:`backward_input`'s backward, accumulated into
    the weights' ``.grad``."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(iter(weights), state)


def dispatch_mode() -> type[Any]:
    """The base class of a mode that intercepts every ATen operator call (``__torch_dispatch__``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


__all__ = [
    "TreeSpec",
    "backward_input",
    "backward_weight",
    "dispatch_mode",
    "fx_real_calls",
    "is_leaf_spec",
    "op_is_mutating",
    "op_is_random",
    "tree_flatten",
    "tree_unflatten",
    "version_counter",
]
