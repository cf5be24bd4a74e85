"""Balanced routing for Hugging Face mixture-of-experts layers on fake tensors (the one place
that relies on transformers internals; ``tests/profiler/test_hf_config.py`` checks them, so a
transformers upgrade that renames one fails there with its name).

A Hugging Face MoE forward is data-dependent: the router's ``topk`` picks experts, and the
experts module then loops over the experts that were hit (``one_hot(...).nonzero()``,
``torch.where``), which fake tensors cannot run (no values).  A fake profile prices what a
training step of *balanced* routing runs instead: every expert receives ``tokens·top_k/experts``
of the routed tokens (``capacity_factor`` times that with capacity routing), rounded up.

What transformers 5 gives (``transformers.integrations.moe.use_experts_implementation``): every
experts module -- ``MixtralExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``, ... -- has
``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``, the experts' weights
as 3-D parameters ``gate_up_proj [E, 2I, H]`` (or ``up_proj`` without a gate) and ``down_proj
[E, H, I]`` (``is_transposed``: the last two dimensions swapped; ``has_bias``: ``*_bias [E, n]``),
``num_experts``, ``_apply_gate`` (the gated activation) or ``act_fn``, and its ``config``
(``num_experts_per_tok``).  :func:`install` gives each such module (its instance, not its
class) a forward that runs the same weights on a fixed, balanced assignment: the router still
runs (its GEMM and ``topk`` are in the census), the tokens are dispatched by a static index (a
gather of ``E·c`` rows), each expert's two GEMMs run batched over the experts (``bmm``: the
census records them as ``E`` GEMMs of ``c`` tokens, :func:`mark_expert_operations`), and the
outputs, scaled by their routing weights, are added back (the combine: a sum over each token's
slots, which keeps nothing for backward, as transformers' own; ``index_add`` when capacity rounding
leaves an uneven share).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor, nn

from planner.errors import InputError
from planner.schema import Operation

#: the transformers decorator whose modules :func:`install` recognises
EXPERTS_DECORATOR = "transformers.integrations.moe.use_experts_implementation"


@dataclass(frozen=True)
class Experts:
    """One routed-experts module of the model, as installed."""

    name: str
    module: nn.Module
    experts: int
    top_k: int
    shared_experts: int
    #: (n, k) of the experts' GEMMs: the gate-and-up projection and the down projection
    gemm_dims: frozenset[tuple[int, int]]
    #: the model width a routed token carries (the dispatch's row size)
    hidden: int

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (3-D expert weights, the
    ``(hidden_states, top_k_index, top_k_weights)`` forward of ``use_experts_implementation``)."""
    forward = getattr(type(module), "forward", None)
    decorated = getattr(forward, "__wrapped__", None) is not None and hasattr(module, "is_transposed")
    up = getattr(module, "gate_up_proj", None)
    if up is None:
        up = getattr(module, "up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        decorated
        and isinstance(up, Tensor) and up.dim() == 3
        and isinstance(down, Tensor) and down.dim() == 3
        and isinstance(getattr(module, "num_experts", None), int)
    )  # fmt: skip


def _shared_experts(parent: nn.Module | None, config: Any) -> int:
    n = getattr(config, "n_shared_experts", None)
    if isinstance(n, int) and n > 0 and parent is not None and hasattr(parent, "shared_experts"):
        return n
    if parent is not None and (hasattr(parent, "shared_expert") or hasattr(parent, "shared_experts")):
        return 1
    return 0


def _top_k(module: nn.Module, parent: nn.Module | None) -> int:
    config = getattr(module, "config", None)
    for source in (config, parent, getattr(parent, "gate", None)):
        for attr in ("num_experts_per_tok", "top_k"):
            k = getattr(source, attr, None)
            if isinstance(k, int) and k > 0:
                return k
    raise InputError(
        f"cannot find the top-k of the experts module {type(module).__name__}: its config has no "
        "num_experts_per_tok; profile it with --model module:builder and your own balanced-routing module"
    )


def install(model: nn.Module, *, capacity_factor: float | None = None) -> list[Experts]:
    """Give every transformers experts module of ``model`` the balanced-routing forward (see the
    module docstring); returns them in model order.  ``capacity_factor``: tokens per expert over
    the balanced share (``None``: exactly the balanced share)."""
    if capacity_factor is not None and not capacity_factor > 0:
        raise InputError(f"--capacity-factor {capacity_factor!r}: give a positive number such as 1.25")
    ratio = Fraction(1) if capacity_factor is None else Fraction(capacity_factor).limit_denominator(1000)
    named = dict(model.named_modules())
    out = []
    for name, module in named.items():
        if not is_experts_module(module):
            continue
        if getattr(module, "has_post_expert_norm", False):
            raise InputError(
                f"experts module {name!r} ({type(module).__name__}) normalises each expert's output, which "
                "the balanced-routing stand-in does not run: profile this model for real"
            )
        parent = named.get(name.rpartition(".")[0]) if "." in name else model
        up = module.gate_up_proj if getattr(module, "has_gate", True) else module.up_proj
        down = module.down_proj
        transposed = bool(getattr(module, "is_transposed", False))
        # weights [E, out, in] (transposed: [E, in, out]); a GEMM of x [c, in] -> n = out, k = in
        dims = [(w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2]) for w in (up, down)]
        module.forward = types.MethodType(_balanced_forward(ratio), module)
        out.append(
            Experts(
                name=name,
                module=module,
                experts=int(module.num_experts),
                top_k=_top_k(module, parent),
                shared_experts=_shared_experts(parent, getattr(module, "config", None)),
                gemm_dims=frozenset((int(n), int(k)) for n, k in dims),
                hidden=int(dims[0][1]),
            )
        )
    return out


def _balanced_forward(ratio: Fraction) -> Any:
    num, den = ratio.numerator, ratio.denominator

    def forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        tokens, hidden = hidden_states.shape
        k = top_k_index.shape[-1]
        e = int(self.num_experts)  # type: ignore[arg-type]
        per_expert = (tokens * k * num + e * den - 1) // (e * den)  # ceil(ratio · tokens·k / E)
        slots = torch.arange(e * per_expert, device=hidden_states.device)
        token = slots % tokens  # the balanced assignment: routed slot -> token
        x = hidden_states.index_select(0, token).view(e, per_expert, hidden)  # dispatch
        gated = getattr(self, "has_gate", True)
        up_name = "gate_up_proj" if gated else "up_proj"
        up = _project(self, x, self.get_parameter(up_name), up_name)
        h = self._apply_gate(up) if gated else self.act_fn(up)  # type: ignore[operator]
        y = _project(self, h, self.get_parameter("down_proj"), "down_proj")
        weight = top_k_weights.reshape(-1).index_select(0, slots % (tokens * k)).view(e, per_expert, 1)
        y = (y * weight).view(e * per_expert, hidden)
        if (e * per_expert) % tokens == 0:
            # slot s holds token s mod tokens: the combine is a sum over the slots of each token,
            # which (like transformers' own reshape + sum) keeps nothing for backward
            return y.view(-1, tokens, hidden).sum(dim=0).to(hidden_states.dtype)
        # capacity rounding left an uneven share: index_add, which keeps its source (one more row
        # per slot than transformers' combine)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token, y.to(out.dtype))  # combine

    return forward


def _project(module: nn.Module, x: Tensor, weight: Tensor, name: str) -> Tensor:
    """``x [E, c, in]`` through every expert's weight at once (a batch of E GEMMs)."""
    w = weight if getattr(module, "is_transposed", False) else weight.transpose(1, 2)
    y = torch.bmm(x, w.to(x.dtype))
    bias = getattr(module, f"{name}_bias", None) if getattr(module, "has_bias", False) else None
    return y + bias.unsqueeze(1) if isinstance(bias, Tensor) else y


def mark_expert_operations(ops: Sequence[Operation], experts: Sequence[Experts]) -> list[Operation]:
    """``ops`` (a unit's census) with the experts' GEMMs -- a batch of ``E`` products of an
    expert weight's shape -- as ``count·E`` GEMMs marked ``expert`` (expert parallelism divides
    ``count``)."""
    out = []
    for op in ops:
        match = next(
            (x for x in experts if op.kind == "gemm" and op.batch == x.experts and (op.n, op.k) in x.gemm_dims), None
        )
        if match is not None:
            op = op.model_copy(update={"count": op.count * match.experts, "batch": 1, "expert": True})
        out.append(op)
    return out


def routed_slots(ops: Sequence[Operation], experts: Experts) -> int | None:
    """Tokens per expert in a marked census (the ``m`` of its expert GEMMs) times the experts:
    the routed rows one forward dispatches (``None``: no expert GEMM found)."""
    for op in ops:
        if op.expert and (op.n, op.k) in experts.gemm_dims and op.m is not None:
            return op.m * experts.experts
    return None


__all__ = ["EXPERTS_DECORATOR", "Experts", "install", "is_experts_module", "mark_expert_operations", "routed_slots"]
