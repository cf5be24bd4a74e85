"""Refuse a plan that does not fit the model or the job, before any training starts.

Torch-free: it compares a :class:`~planner.schema.Plan` with facts about the model (layer
names, parameter bytes, structure fingerprint) and the job (world size, optimizer), and
raises :class:`~planner.errors.PlanMismatchError` naming every mismatch and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.errors import PlanMismatchError
from planner.schema import Plan, structure_sha256

#: optimizers the executor builds (``--optimizer``); the plan's must be the same
SUPPORTED_OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")

_REMAKE = "make the plan again from a profile of this model (pipeplan profile --model ... then pipeplan plan)"


def plan_mismatches(
    plan: Plan,
    *,
    layer_names: Sequence[str],
    param_bytes: Sequence[int],
    sha256: str | None = None,
    world_size: int | None = None,
    optimizer: str | None = None,
    dtype: str | None = None,
) -> list[str]:
    """Every way ``plan`` does not fit the model (and, when given, the job); empty when it fits.

    ``dtype``: the run's compute dtype (``float32``, ``bfloat16``, ``float16``); a plan made
    without one is a float32 plan."""
    problems: list[str] = []
    names = list(layer_names)
    if plan.num_layers != len(names):
        problems.append(
            f"the plan is for {plan.num_layers} layers but the model splits into {len(names)} "
            f"({_span(names)})"
        )
    planned = [name for stage in plan.stages for name in stage.layer_names]
    if planned != names:
        problems.append(_name_difference(planned, names))
    # a hand-edited plan: the names agree but a stage's [start, stop) points elsewhere
    for stage in plan.stages if planned == names else ():
        if stage.stop > len(names):
            problems.append(
                f"stage {stage.index} covers layers {stage.start}:{stage.stop} but the model has "
                f"only {len(names)} layers"
            )
        elif names[stage.start : stage.stop] != stage.layer_names:
            problems.append(
                f"stage {stage.index} covers layers {stage.start}:{stage.stop}, which are "
                f"{_span(names[stage.start : stage.stop])} in the model, but the plan names "
                f"{_span(stage.layer_names)}"
            )
    model_sha = sha256 if sha256 is not None else structure_sha256(names, list(param_bytes))
    if plan.profile_sha256 != model_sha:
        detail = ""
        if len(param_bytes) == len(names) and planned == names:
            planned_bytes = [s.param_bytes for s in plan.stages]
            model_bytes = [
                sum(param_bytes[s.start : s.stop]) for s in plan.stages if s.stop <= len(param_bytes)
            ]
            diff = [
                f"stage {i}: plan {p} B, model {m} B"
                for i, (p, m) in enumerate(zip(planned_bytes, model_bytes, strict=False))
                if p != m
            ]
            if diff:
                detail = " (parameter bytes differ: " + "; ".join(diff[:4]) + ")"
        problems.append(
            f"profile_sha256 {plan.profile_sha256[:12]}... does not match the model's structure "
            f"fingerprint {model_sha[:12]}...{detail}: the plan was made for another model or "
            "another version of it"
        )
    if world_size is not None and world_size != plan.world_size:
        problems.append(
            f"the plan needs pipeline degree {plan.pipeline_degree} x data-parallel degree "
            f"{plan.data_parallel_degree}"
            + (f" x tensor-parallel degree {plan.tensor_parallel_degree}" if plan.tensor_parallel_degree > 1 else "")
            + (f" x context-parallel degree {plan.context_parallel_degree}" if plan.context_parallel_degree > 1 else "")
            + f" = {plan.world_size} processes but the job has "
            f"{world_size}: launch {plan.world_size} processes (torchrun --nproc-per-node "
            f"{plan.world_size}, or pipeplan run which launches them for you)"
        )
    if optimizer is not None and optimizer != plan.training.optimizer:
        problems.append(
            f"--optimizer {optimizer!r} does not match the plan's training optimizer "
            f"{plan.training.optimizer!r} (memory was planned for it): pass --optimizer "
            f"{plan.training.optimizer} or make the plan with --optimizer {optimizer}"
        )
    if dtype is not None and dtype != plan.training.run_dtype:
        made = plan.training.dtype or "float32 (made without --dtype)"
        problems.append(
            f"--dtype {dtype} does not match the dtype the plan was made for, {made} (its memory "
            f"counts activations of that size): pass --dtype {plan.training.run_dtype} or make the plan "
            f"with --dtype {dtype}"
        )
    return problems


def check_plan_matches(
    plan: Plan,
    *,
    layer_names: Sequence[str],
    param_bytes: Sequence[int],
    sha256: str | None = None,
    world_size: int | None = None,
    optimizer: str | None = None,
    dtype: str | None = None,
) -> None:
    """Raise :class:`PlanMismatchError` listing every mismatch between ``plan`` and the model/job."""
    problems = plan_mismatches(
        plan,
        layer_names=layer_names,
        param_bytes=param_bytes,
        sha256=sha256,
        world_size=world_size,
        optimizer=optimizer,
        dtype=dtype,
    )
    if problems:
        job_only = all("launch" in p or "--optimizer" in p or "--dtype" in p for p in problems)
        fix = "" if job_only else f"\n  fix: {_REMAKE}"
        raise PlanMismatchError(
            f"plan for {plan.model!r} does not match the model:\n  - " + "\n  - ".join(problems) + fix
        )


def check_optimizer_supported(name: str) -> None:
    """The executor builds SGD / SGD with momentum / Adam / AdamW on float32 master weights."""
    if name not in SUPPORTED_OPTIMIZERS:
        hint = ""
        if name.endswith("-mixed"):
            hint = (
                f" ({name!r} is the mixed precision of a 16-bit profile, counting its fp32 master copy; for a mixed-precision run "
                f"plan and run with --optimizer {name.removesuffix('-mixed')} --dtype bf16)"
            )
        raise PlanMismatchError(
            f"optimizer {name!r} is not supported by pipeplan run: choose one of "
            f"{', '.join(SUPPORTED_OPTIMIZERS)}{hint}"
        )


def _span(names: Sequence[str]) -> str:
    if not names:
        return "no layers"
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]}"


def _name_difference(planned: Sequence[str], model: Sequence[str]) -> str:
    for i, (a, b) in enumerate(zip(planned, model, strict=False)):
        if a != b:
            return f"layer {i} is {a!r} in the plan but {b!r} in the model"
    if len(planned) > len(model):
        return f"the plan has extra layers {_span(planned[len(model):])} that the model lacks"
    return f"the model has layers {_span(model[len(planned):])} that no stage of the plan covers"
