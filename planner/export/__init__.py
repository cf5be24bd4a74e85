"""Export a plan to the frameworks people already train with.

``export_plan(plan, "megatron" | "torchtitan" | "deepspeed" | "torch")`` returns the files that
make the target run the plan: Megatron-LM flags, a torchtitan ``[parallelism]`` fragment, a
DeepSpeed ``ds_config.json`` with explicit stage boundaries, or the split spec and schedule of
``torch.distributed.pipelining``.  One module per target; :mod:`planner.export.mapping` reads
the plan's layer names as each target's units.  A plan a target cannot express raises
:class:`ExportRefused` with the reasons and the nearest plan it can express, priced by the cost
model when the profile is given; ``use_nearest=True`` exports that plan instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

from planner.errors import InputError
from planner.export import deepspeed, megatron, torch_pipelining, torchtitan
from planner.export.common import (
    Decisions,
    Export,
    ExportFile,
    ExportRefused,
    Nearest,
    PlanInfo,
    Problem,
    nearest,
)
from planner.schema import Plan, Profile

TARGETS: dict[str, ModuleType] = {
    "megatron": megatron,
    "torchtitan": torchtitan,
    "deepspeed": deepspeed,
    "torch": torch_pipelining,
}

__all__ = ["TARGETS", "Decisions", "Export", "ExportFile", "ExportRefused", "Nearest", "export_plan", "problems"]


def _module(target: str) -> ModuleType:
    if target not in TARGETS:
        raise InputError(f"unknown export target {target!r}: choose one of {', '.join(TARGETS)}")
    return TARGETS[target]


def problems(plan: Plan, target: str, *, profile: Profile | None = None) -> list[Problem]:
    """What ``target`` cannot express in ``plan`` (empty when it can express all of it);
    ``profile`` (the model's) tells of its mixture-of-experts layers."""
    info = PlanInfo.from_plan(plan, profile=profile)
    found: list[Problem] = _module(target).problems(Decisions.from_plan(plan), info.layer_names, experts=info.experts)
    return found


def export_plan(
    plan: Plan,
    target: str,
    *,
    profile: Profile | None = None,
    use_nearest: bool = False,
    output: str | None = None,
) -> tuple[Export, Nearest | None]:
    """The files that run ``plan`` on ``target``, and the nearest plan when one was used.

    ``profile`` (the model's profile) prices the nearest plan of a refused one; ``output`` is
    the file name the main file will be written to (side files and comments refer to it).
    Raises :class:`ExportRefused` when the target cannot express the plan (unless
    ``use_nearest`` and a nearest plan exists).
    """
    module = _module(target)
    if profile is not None and profile.sha256() != plan.profile_sha256:
        raise InputError(
            f"the profile (model {profile.model!r}, {profile.num_layers} layers) is not the model this plan was "
            f"made for ({plan.model!r}, {plan.num_layers} layers): its structure fingerprint "
            f"{profile.sha256()[:12]}... differs from the plan's {plan.profile_sha256[:12]}...; give that model's profile"
        )
    info = PlanInfo.from_plan(plan, profile=profile)
    check: Callable[[Decisions], list[Problem]] = lambda d: module.problems(d, info.layer_names, experts=info.experts)  # noqa: E731
    found = check(Decisions.from_plan(plan))
    out = output or module.DEFAULT_FILE
    if not found:
        result: Export = module.render(Decisions.from_plan(plan), info, output=out)
        return _unknown_experts_note(result, target, module, profile), None
    near = nearest(plan, check, profile=profile)
    if not use_nearest or near is None:
        raise ExportRefused(target, found, near, plan, replan_base=getattr(module, "REPLAN_SCHEDULES", ""))
    near_info = (
        PlanInfo.from_plan(near.plan, profile=profile)
        if near.plan is not None
        else PlanInfo.from_plan(plan, priced=False, profile=profile)
    )
    result = module.render(near.decisions, near_info, output=out)
    return _unknown_experts_note(result, target, module, profile), near


def _unknown_experts_note(result: Export, target: str, module: ModuleType, profile: Profile | None) -> Export:
    """Without the profile, a target that takes expert settings cannot tell whether the model has
    mixture-of-experts layers: say so."""
    if profile is not None or not getattr(module, "EXPERT_SETTINGS", False):
        return result
    note = (
        f"note: no profile given, so this {target} export has no mixture-of-experts settings; if the model has "
        "experts, export again with --profile PROFILE (the profile the plan was made from)"
    )
    return dataclasses.replace(result, notes=(*result.notes, note))
