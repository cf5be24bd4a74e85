"""The optimizer of a run, built the same way by every stage and by the unsplit reference:
its torch class and kernels (:func:`optimizer_class`) and one parameter group per device mesh
(:func:`make_optimizer`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from runtime.plan_check import check_optimizer_supported


def optimizer_class(name: str, *, fused: bool = False) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer of ``name`` (``sgd``, ``sgd-momentum`` (0.9), ``adam``, ``adamw``; torch
    defaults otherwise) and its keyword arguments, with the kernels the plan's memory counts
    (``TrainingSetup.fused_optimizer``): fused Adam/AdamW, which allocate nothing in their step,
    or foreach kernels, torch's default on GPUs, whose Adam/AdamW step holds one temporary the size
    of the parameters (``planner.presets.OPTIMIZER_STEP_TEMPORARIES``).  Asked for explicitly,
    so a CPU run (torch's default there: one tensor at a time) holds what the plan says."""
    check_optimizer_supported(name)
    kernels: dict[str, Any] = {"fused": True} if fused and name in ("adam", "adamw") else {"foreach": True}
    if name == "sgd":
        return torch.optim.SGD, kernels
    if name == "sgd-momentum":
        return torch.optim.SGD, {"momentum": 0.9, **kernels}
    if name == "adam":
        return torch.optim.Adam, kernels
    return torch.optim.AdamW, kernels


def make_optimizer(
    name: str, params: Iterable[nn.Parameter], *, lr: float, fused: bool = False
) -> torch.optim.Optimizer:
    """The optimizer :func:`optimizer_class` says, over ``params``: one parameter group per
    device mesh (DTensor parameters of a tensor-parallel or FSDP2 mesh) and one for plain
    tensors, since a foreach or fused kernel runs one group's tensors together and DTensor
    refuses a list that mixes them."""
    cls, extra = optimizer_class(name, fused=fused)
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return cls([{"params": ps} for ps in groups.values()], **{"lr": lr, **extra})
