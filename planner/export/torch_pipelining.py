"""``torch.distributed.pipelining``: the split spec for ``pipeline()`` and the schedule to run.

Units are the model's own module names: pipeplan's layer names are the modules each layer
starts with, so stage *s* starts at ``SplitPoint.BEGINNING`` of its first layer's module.
``pipeline(model, mb_args, split_spec=SPLIT_SPEC)`` then makes one stage per plan stage; stage
*s* runs on pipeline rank ``s % K`` (what ``ScheduleInterleaved1F1B`` expects).  Written as a
Python module of constants (``-o split_plan.py``) to import next to the training script.

Every schedule pipeplan plans exists in torch (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``), and per-stage recompute is yours to apply: stage *s* checkpoints its
first ``RECOMPUTE_LAYERS[s]`` layers, each under its own ``torch.utils.checkpoint``
(``RECOMPUTE_STAGES``: the stages with any).
Refused: a stage that starts at a module's second call (``name#1``), which has no name to split
at; the cut moves to the nearest layer that has one.  Context parallelism (C > 1) and expert
parallelism (E > 1) are refused too (the split plan places stages; it has no mesh of its own),
with the nearest plan without them.  A plan with its own action list is written
for torch's ``_PipelineScheduleRuntime`` (private API) with the CSV beside it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from planner.export.common import (
    SCHEDULE_CSV_SUFFIX,
    Decisions,
    ExpertLayer,
    Export,
    ExportFile,
    PlanInfo,
    Problem,
    actions_csv,
    axis_problems,
    snap_cuts,
)
from planner.export.mapping import split_point_ok

TARGET = "torch"
DEFAULT_FILE = "split_plan.py"
#: pipeplan schedule -> torch's class running the same order (tests/test_schedules_torch.py compares
#: them action for action); zb-h2 and planned have none and run their action list
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
#: the classes that take one stage (the others take a list of a rank's stages)
SINGLE_STAGE_CLASSES = ("ScheduleGPipe", "Schedule1F1B")
RUNTIME_CLASS = "_PipelineScheduleRuntime"


def problems(d: Decisions, names: Sequence[str], *, experts: Sequence[ExpertLayer] | None = None) -> list[Problem]:
    """What this target cannot express of decisions ``d`` on layers ``names`` (``experts`` does not
    matter here: the target places layers, experts and all, and takes no expert settings)."""
    out = axis_problems(d, "torch.distributed.pipelining's split plan")
    bad = [a for a, _ in d.stages[1:] if not split_point_ok(names[a])]
    if not bad:
        return out
    return [
        *out,
        Problem(
            f"stage boundary at layer {bad[0]} ({names[bad[0]]!r}): a module's second call has no name "
            "to give pipeline() as a split point",
            lambda x: snap_cuts(x, lambda i: i >= len(names) or split_point_ok(names[i]), "cuts moved to named modules"),
        ),
    ]


def split_spec(d: Decisions, names: Sequence[str]) -> dict[str, str]:
    """Module name -> ``"BEGINNING"`` for the first layer of every stage but the first."""
    return {names[a]: "BEGINNING" for a, _ in d.stages[1:]}


def render(d: Decisions, info: PlanInfo, *, output: str = DEFAULT_FILE) -> Export:
    k = d.pipeline_degree
    spec = split_spec(d, info.layer_names)
    runs_list = d.actions is not None or d.schedule not in SCHEDULE_CLASSES
    schedule = RUNTIME_CLASS if runs_list else SCHEDULE_CLASSES[d.schedule]
    single = schedule in SINGLE_STAGE_CLASSES
    first_arg = "stages[0]" if single else "stages"
    lines = ['"""' + info.header(TARGET, d)[0], info.header(TARGET, d)[1], ""]
    lines += [
        f"Launch {d.world_size} ranks: pipeline rank k = rank % {k}, replica d = rank // {k}.",
        "",
        "    pipe = pipeline(model, mb_args=(one_microbatch,), split_spec=SPLIT_SPEC)",
        "    stages = [pipe.build_stage(s, device, group=pp_group) for s in STAGES_OF_RANK[pp_rank]]",
        f"    schedule = SCHEDULE_CLASS({first_arg}, loss_fn=loss_fn, **SCHEDULE_KWARGS)",
    ]
    if runs_list:
        lines.append('    schedule._load_csv(SCHEDULE_CSV, format="compute_only")')
    lines += [
        "",
        "Wrap each of the first RECOMPUTE_LAYERS[s] layers of stage s (STAGE_LAYERS[s]) in its own",
        "torch.utils.checkpoint: pipeplan prices activation checkpointing layer by layer (a checkpointed",
        "layer keeps only its input per micro-batch in flight and re-runs its forward in the backward).",
        '"""',
        "",
        "from torch.distributed.pipelining import SplitPoint",
        "from torch.distributed.pipelining.schedules import " + schedule,
        "",
        "SPLIT_SPEC = {",
        *[f"    {json.dumps(name)}: SplitPoint.{where}," for name, where in spec.items()],
        "}",
        f"NUM_STAGES = {len(d.stages)}",
        f"PIPELINE_DEGREE = {k}",
        f"DATA_PARALLEL = {d.data_parallel}",
        f"STAGES_OF_RANK = {_stages_of_rank(d)}",
        f"STAGE_LAYERS = {[list(info.layer_names[a:b]) for a, b in d.stages]!r}",
        f"MICROBATCH_SIZE = {d.microbatch_size}",
        f"NUM_MICROBATCHES = {d.num_microbatches}",
        f"SCHEDULE_CLASS = {schedule}",
        f'SCHEDULE_KWARGS = {{"n_microbatches": {d.num_microbatches}}}',
        f"RECOMPUTE_STAGES = {[s for s, r in enumerate(d.recompute) if r]}",
        f"RECOMPUTE_LAYERS = {list(d.checkpointed_layers)}",
    ]
    if d.selective_recompute:  # Megatron's selective recompute on every block (yours to apply)
        lines.append("SELECTIVE_RECOMPUTE = True  # recompute attention's scores, softmax and dropout in the backward")
    files: list[ExportFile] = []
    if runs_list:
        lines.append(f"SCHEDULE_CSV = {json.dumps(output + SCHEDULE_CSV_SUFFIX)}")
        files.append(ExportFile(actions_csv(d.action_lines()), SCHEDULE_CSV_SUFFIX))
    return Export(TARGET, (ExportFile("\n".join(lines) + "\n"), *files))


def _stages_of_rank(d: Decisions) -> dict[int, list[int]]:
    return d.stages_of_rank()
