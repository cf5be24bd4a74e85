"""DeepSpeed: a ``ds_config.json`` with the plan's stage boundaries.

DeepSpeed's ``PipelineModule`` balances its ``layers`` list by parameters, by layer type or
uniformly; it has no way to take explicit boundaries.  The config written here holds the usual
batch and ZeRO settings, and under ``pipeline.pipeplan`` the boundaries as positions in the
layer list (``parts``: stage *s* holds ``layers[parts[s]:parts[s+1]]``) with per-stage recompute.
``examples/deepspeed_pipeline.py`` is a short ``PipelineModule`` subclass that reads them
(it overrides ``_partition_layers``); copy it next to your training script.  Its ``layers``
must be one entry per plan layer, in the plan's order (the config lists their names).  A stage
that recomputes checkpoints its layers one by one (``activation_checkpoint_interval`` = 1), as
pipeplan's cost model prices it.

Units are list positions, so any model whose layers you can list works.  Refused, with the
nearest plan: interleaving and GPipe (the pipeline engine runs one stage per rank with its 1F1B
``TrainSchedule``), ZeRO 2-3 (the pipeline engine allows ZeRO 0-1), an action list, and a stage
that checkpoints only its first layers (the interval checkpoints every layer of the stage: every
layer of such stages, or none), context parallelism (C > 1) and expert parallelism (E > 1): the
pipeline engine has neither, so the nearest plan turns them off (C = 1 or E = 1, the same D, T, K,
priced).  DeepSpeed's ``train_batch_size`` is micro-batch x gradient
accumulation x data-parallel size, i.e. the plan's global batch with M accumulation steps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from planner.export.common import (
    CLASSIC_SCHEDULES,
    Decisions,
    ExpertLayer,
    Export,
    ExportFile,
    PlanInfo,
    Problem,
    axis_problems,
    merge_chunks,
    to_1f1b,
    to_classic,
)

TARGET = "deepspeed"
DEFAULT_FILE = "ds_config.json"
EXAMPLE = "examples/deepspeed_pipeline.py"
#: what a new plan needs to stay within DeepSpeed pipeline's ZeRO stages (added to every replan hint)
REPLAN_SCHEDULES = "--zero 0"


def problems(d: Decisions, names: Sequence[str], *, experts: Sequence[ExpertLayer] | None = None) -> list[Problem]:
    """What this target cannot express of decisions ``d`` on layers ``names`` (``experts`` does not
    matter here: the target places layers, experts and all, and takes no expert settings)."""
    out: list[Problem] = axis_problems(d, "DeepSpeed's pipeline engine")
    if d.schedule not in CLASSIC_SCHEDULES:
        out.append(
            Problem(
                f"schedule {d.schedule!r}: DeepSpeed's pipeline engine runs only its 1F1B TrainSchedule",
                lambda x: [(c, y) for c, y in to_classic(x) if y.virtual_stages == 1],
                "--schedule 1f1b",
            )
        )
    elif d.virtual_stages > 1:
        out.append(
            Problem(
                f"interleaved-1f1b with {d.virtual_stages} chunks per rank: DeepSpeed's pipeline engine runs "
                "one stage per rank",
                merge_chunks,
                "--schedule 1f1b",
            )
        )
    elif d.schedule == "gpipe":
        out.append(
            Problem("schedule 'gpipe': DeepSpeed's pipeline engine runs only its 1F1B TrainSchedule", to_1f1b, "--schedule 1f1b")
        )
    if d.selective_recompute:
        out.append(
            Problem(
                "selective recompute: DeepSpeed's activation checkpointing recomputes whole layers",
                lambda x: [("full recompute on every stage",
                            x.replace(selective_recompute=False).with_recompute((True,) * len(x.stages))),
                           ("no recompute", x.replace(selective_recompute=False))],
                "--no-selective-recompute",
            )
        )
    if d.partial_stages:
        out.append(
            Problem(
                f"stage(s) {','.join(map(str, d.partial_stages[:6]))} checkpoint only their first layers "
                f"({', '.join(str(d.checkpointed_layers[s]) for s in d.partial_stages[:6])}): DeepSpeed's "
                "activation_checkpoint_interval checkpoints every layer of a stage",
                _whole_stages,
            )
        )
    if d.zero_stage >= 2:
        out.append(
            Problem(
                f"ZeRO stage {d.zero_stage}: DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 only",
                lambda x: [("ZeRO stage 1", x.replace(zero_stage=1))],
            )
        )
    if d.actions is not None and d.schedule in CLASSIC_SCHEDULES:
        out.append(
            Problem(
                "the plan carries its own action list: DeepSpeed runs only its TrainSchedule",
                lambda x: [("1F1B instead of the action list", x.replace(actions=None))],
            )
        )
    return out


def _whole_stages(d: Decisions) -> list[tuple[str, Decisions]]:
    """The stages that checkpoint only their first layers checkpoint all of them, or none."""
    partial = set(d.partial_stages)
    return [
        ("those stages checkpoint every layer", d.with_recompute(d.recompute)),
        ("those stages do not recompute", d.with_recompute([r and s not in partial for s, r in enumerate(d.recompute)])),
    ]


def config(d: Decisions, info: PlanInfo) -> dict[str, object]:
    """The ``ds_config.json`` document."""
    parts = [a for a, _ in d.stages] + [d.num_layers]
    return {
        "train_batch_size": d.global_batch_size,
        "train_micro_batch_size_per_gpu": d.microbatch_size,
        "gradient_accumulation_steps": d.num_microbatches,
        "zero_optimization": {"stage": d.zero_stage},
        "pipeline": {
            "stages": d.pipeline_degree,
            "pipeplan": {
                "parts": parts,
                "recompute": list(d.recompute),
                "layer_names": list(info.layer_names),
                "data_parallel": d.data_parallel,
                "tensor_parallel": d.tensor_parallel,
                "model": info.model,
                "profile_sha256": info.profile_sha256,
                "predicted_step_ms": None if info.step_time_ms is None else round(info.step_time_ms, 3),
            },
        },
    }


def render(d: Decisions, info: PlanInfo, *, output: str = DEFAULT_FILE) -> Export:
    text = _dump(config(d, info)) + "\n"
    world = d.world_size
    spans = ", ".join(f"{info.layer_names[a]}..{info.layer_names[b - 1]}" for a, b in d.stages[:4])
    notes = (
        *info.header(TARGET, d),
        f"stages: {spans}{', ...' if len(d.stages) > 4 else ''}",
        f"build the model with PlannedPipelineModule.from_config(layers, {output!r}) from {EXAMPLE} "
        f"(one entry of `layers` per plan layer) and launch {world} ranks",
    )
    return Export(TARGET, (ExportFile(text),), notes)


def _dump(value: object, indent: str = "") -> str:
    """JSON with one key per line and lists of numbers or strings kept on one line."""
    if isinstance(value, dict):
        inner = indent + "  "
        items = [f"{inner}{json.dumps(k)}: {_dump(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    return json.dumps(value)
