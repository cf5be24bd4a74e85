"""The private torch APIs the operation census (:mod:`profiler.census`) relies on, in one place.

``tests/profiler/test_census.py`` checks each of them, so a torch upgrade that moves one fails
there with its name instead of leaving every layer of a profile with an empty census:

* ``torch.utils._python_dispatch.TorchDispatchMode``: sees every ATen operator a forward runs,
  below autograd (re-exported from :mod:`profiler._torch_private`, which wraps it);
* ``torch._ops.OpOverload`` and its ``_schema``: an operator's argument names and defaults (to
  read ``is_causal`` wherever it sits) and whether its result aliases an input without writing
  it (a view: ``Tensor(a)`` in the schema);
* the ATen operator overloads the census maps by name (:data:`GEMM_OPS`, :data:`CONV_OPS`,
  :data:`ATTENTION_OPS`): an overload this torch lacks is left out (:func:`aten_overloads`), and
  the test names it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from profiler._torch_private import dispatch_mode

#: matrix products, by (operator, overload): their shapes make a GEMM
GEMM_OPS = (
    ("mm", "default"),
    ("addmm", "default"),
    ("_addmm_activation", "default"),
    ("bmm", "default"),
    ("baddbmm", "default"),
    ("addbmm", "default"),
    ("mv", "default"),
    ("addmv", "default"),
)
#: convolutions (an implicit GEMM)
CONV_OPS = (("convolution", "default"), ("_convolution", "default"))
#: fused attention kernels: query, key, value ``[batch, heads, length, head_dim]``
ATTENTION_OPS = (
    ("_scaled_dot_product_flash_attention_for_cpu", "default"),
    ("_scaled_dot_product_flash_attention", "default"),
    ("_scaled_dot_product_efficient_attention", "default"),
    ("_scaled_dot_product_cudnn_attention", "default"),
    ("_scaled_dot_product_fused_attention_overrideable", "default"),
)
#: fused attention kernels called directly: query, key, value ``[batch, length, heads, head_dim]``
#: (or ``[tokens, heads, head_dim]`` with cumulative sequence offsets)
ATTENTION_BSHD_OPS = (("_flash_attention_forward", "default"), ("_efficient_attention_forward", "default"))


def is_operator(func: Any) -> bool:
    """Whether ``func`` (what a dispatch mode receives) is an ATen operator overload."""
    return isinstance(func, torch._ops.OpOverload)


def operator_name(func: Any) -> str:
    """The operator's name without namespace and overload (``aten.addmm.default`` -> ``addmm``)."""
    return str(func._schema.name).split("::")[-1]


def returns_view(func: Any) -> bool:
    """Whether a result of ``func`` aliases an input without writing it (a view, ``detach``,
    ``alias``; not an in-place operator, whose alias is written)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def bind_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in (as ``func``'s schema declares them)."""
    out: dict[str, Any] = {}
    positional = iter(args)
    for arg in func._schema.arguments:
        if not arg.kwarg_only:
            value = next(positional, _MISSING)
            if value is not _MISSING:
                out[arg.name] = value
                continue
        if arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


_MISSING = object()


def aten_overloads(names: Iterable[tuple[str, str]]) -> frozenset[Any]:
    """The ATen operator overloads of ``names`` (operator, overload) that this torch has."""
    out = []
    for op, overload in names:
        packet = getattr(torch.ops.aten, op, None)
        found = getattr(packet, overload, None) if packet is not None else None
        if found is not None:
            out.append(found)
    return frozenset(out)


__all__ = [
    "ATTENTION_BSHD_OPS",
    "ATTENTION_OPS",
    "CONV_OPS",
    "GEMM_OPS",
    "aten_overloads",
    "bind_arguments",
    "dispatch_mode",
    "is_operator",
    "operator_name",
    "returns_view",
]
