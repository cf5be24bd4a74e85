"""torchtitan: a TOML ``[parallelism]`` fragment, with the same settings as command-line overrides.

Units: the embedding is ``tok_embeddings``, decoder layer *i* is ``layers.i``, the head is
``norm`` and ``lm_head`` (torchtitan 0.3's decoder; 0.2 called the output layer ``output``:
``head_fqns``).  ``module_fqns_per_model_part`` lists one part per stage; with
``Interleaved1F1B`` torchtitan places part *i* on pipeline rank ``i % pipeline_parallel_degree``
("loop" style), which is pipeplan's placement.  A Hugging Face decoder's ``model.embed_tokens``,
``model.layers.i``, ``model.norm``, ``lm_head`` are these modules; its ``model.rotary_emb``
(torchtitan keeps rope as a buffer) places nothing and goes with its stage.

Mixture of experts, when the profile is given: ``expert_parallel_degree`` is the plan's E; the
experts and top-k are torchtitan model settings, named in the header.  Its token-choice MoE is
dropless, so a profile routed with a capacity factor is refused.

Context parallelism: ``context_parallel_degree = C``.  torchtitan attends under context
parallelism by all-gathering K/V: its SDPA path runs torch's ``context_parallel`` with the default
rotate method, "allgather" (torchtitan 0.2 names it, ``context_parallel_rotate_method``), and
its FlexAttention path gathers K/V itself.  That is the plan's "all-gather" attention; a "ring"
plan (torch's ring pass, 0.2's "alltoall", which 0.3 cannot set) is refused with the same plan
on all-gather attention as the nearest.  torchtitan's FSDP mesh is data_parallel_shard x context
parallel, so it shards parameters over the C ranks that pipeplan prices as replicas (less memory
than predicted); with ZeRO 0 the export sets ``fsdp_reshard_after_forward = "never"`` (whole
parameters after the first all-gather).  The sequence length must be a multiple of 2 x C x T.

Expert parallelism: torchtitan draws the E ranks from data_parallel_shard x context_parallel x
tensor_parallel (0.3; 0.2 with its default ``expert_tensor_parallel_degree = 1``), context-parallel
ranks before data-parallel ones, with whole experts on each rank.  pipeplan's plan splits each
expert over the T tensor-parallel ranks and draws E from D x C, so E > 1 with T > 1 is refused
(nearest: E = 1), as is E not dividing data_parallel_shard_degree x C (with ZeRO 0 data
parallelism replicates and lends no rank: nearest ZeRO 1, or E dividing C).

torchtitan 0.2 reads the fragment from ``--job.config_file``.  torchtitan 0.3 configures a job in
Python (``config_registry``) and takes overrides on the command line; the header of the file holds
those overrides, ``--parallelism.<field> <value>``, ending with ``activation-checkpoint:full`` or
``activation-checkpoint:none``.

Micro-batches: ``pipeline_parallel_microbatch_size`` is the plan's micro-batch size and
``training.local_batch_size`` the batch of one data-parallel replica per step (micro-batch size x
M), so torchtitan cuts it into the plan's M micro-batches.  Data parallelism: ZeRO 0 replicates
(``data_parallel_replicate_degree`` = D), ZeRO 1-2 shard without resharding after forward
(``fsdp_reshard_after_forward = "never"``), ZeRO 3 shards (FSDP's default).

Refused, with the nearest plan: a cut inside a decoder layer, and recompute on some stages only or
on some decoder layers of a stage only (torchtitan's ``activation_checkpoint.mode = "full"``
checkpoints every transformer block, each on its own, as pipeplan's runtime checkpoints a
stage's layers; it has no count of blocks): recompute on every stage, or on none.  A plan that
carries its own action list is written as ``pipeline_parallel_schedule_csv`` plus the CSV.
"""

from __future__ import annotations

import json
import math
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
    cut_problems,
    decoder_checkpoints,
    empty_stage_problems,
    expert_problems,
    experts_off,
    recompute_problems,
    uniform_recompute,
)
from planner.export.mapping import DecoderStack, NotAStack, Unit, decoder_stack

TARGET = "torchtitan"
DEFAULT_FILE = "torchtitan_parallelism.toml"
#: pipeplan schedule -> torch.distributed.pipelining schedule name, as torchtitan takes it
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "zb-h1": "InterleavedZeroBubble",
    "interleaved-zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
#: the schedule names torchtitan takes with a per-rank action list read from CSV (by chunks per rank)
CSV_SCHEDULES = ("PipelineScheduleSingle", "PipelineScheduleMulti")
HEAD_FQNS = ("norm", "lm_head")
#: the export writes the model's expert settings when it knows them (the profile is given)
EXPERT_SETTINGS = True


def problems(d: Decisions, names: Sequence[str], *, experts: Sequence[ExpertLayer] | None = None) -> list[Problem]:
    """What torchtitan's settings cannot say of decisions ``d`` on layers ``names`` (``experts``:
    the profile's mixture-of-experts layers, when it was given)."""
    try:
        stack = decoder_stack(names)
    except NotAStack as err:
        return [Problem(f"torchtitan splits decoder models (tok_embeddings, layers.N, norm, lm_head): {err}")]
    out = expert_problems(names, stack, experts, "torchtitan's MoE (its router's num_experts and top_k)")
    capacity = [e for e in experts or () if e.capacity_factor is not None]
    if capacity:
        out.append(
            Problem(
                f"layer {capacity[0].name!r} routes with capacity factor {capacity[0].capacity_factor:g}: torchtitan's "
                "token-choice MoE is dropless (every routed token reaches its experts, no capacity): profile the "
                "model without --capacity-factor (balanced routing) and plan it again"
            )
        )
    out += mesh_problems(d)
    out += cut_problems(d, names, stack, "module_fqns_per_model_part places whole modules")
    out += empty_stage_problems(d, names, stack, "module_fqns_per_model_part")
    on_off = recompute_problems(d, stack, "torchtitan's activation checkpointing applies to every transformer block alike")
    return out + (on_off or partial_problems(d, stack))


def mesh_problems(d: Decisions) -> list[Problem]:
    """Context and expert parallelism torchtitan cannot run as the plan prices it: ring attention,
    experts split over tensor-parallel ranks, E not dividing its FSDP ranks."""
    out: list[Problem] = []
    c, e = d.context_parallel, d.expert_parallel
    if c > 1 and d.context_attention == "ring":
        out.append(
            Problem(
                f"context parallelism C={c} with ring attention: torchtitan all-gathers K/V (torch's context_parallel "
                "with its default rotate method; 0.3 has no setting for a ring pass)",
                lambda x: [("all-gather attention instead of ring", x.replace(context_attention="all-gather"))],
                "--context-attention all-gather",
            )
        )
    if e > 1 and d.tensor_parallel > 1:
        out.append(
            Problem(
                f"expert parallelism E={e} with tensor parallelism T={d.tensor_parallel}: torchtitan's expert-parallel "
                "ranks include the tensor-parallel ones (whole experts on each rank), the plan splits every expert "
                f"over T={d.tensor_parallel} and shards them over E of the D x C ranks",
                experts_off,
                "--expert-parallel 1",
            )
        )
    elif e > 1 and (shard := _shard_degree(d) * c) % e:
        zero = d.zero_stage == 0 and d.data_parallel > 1
        out.append(
            Problem(
                f"expert parallelism E={e} does not divide data_parallel_shard_degree x context_parallel_degree = "
                f"{_shard_degree(d)} x {c} = {shard}: torchtitan borrows the expert-parallel ranks from its FSDP ranks"
                + (f" (ZeRO 0 replicates over D={d.data_parallel}: data_parallel_replicate_degree lends none)" if zero else ""),
                _fsdp_or_fewer_experts,
                "--expert-parallel 1",
            )
        )
    return out


def _shard_degree(d: Decisions) -> int:
    """torchtitan's data_parallel_shard_degree for decisions ``d``: D under ZeRO 1-3, else 1."""
    return 1 if d.zero_stage == 0 else d.data_parallel


def _fsdp_or_fewer_experts(d: Decisions) -> list[tuple[str, Decisions]]:
    """ZeRO 1 (FSDP over the D replicas lends them to expert parallelism), or the largest E that
    divides the context-parallel ranks (1: expert parallelism off)."""
    out: list[tuple[str, Decisions]] = []
    if d.zero_stage == 0 and d.data_parallel > 1:
        out.append(("ZeRO stage 1 (data_parallel_shard_degree = D)", d.replace(zero_stage=1)))
    fewer = math.gcd(d.expert_parallel, d.context_parallel)
    out.append((f"E={fewer} instead of {d.expert_parallel}", d.replace(expert_parallel=fewer)))
    return out


def partial_problems(d: Decisions, stack: DecoderStack) -> list[Problem]:
    """Stages that checkpoint only some of their decoder layers: full activation checkpointing
    wraps every transformer block of every stage, or none."""
    ckpts = decoder_checkpoints(d, stack)
    present = [c for c in ckpts if c is not None]
    if all(c.touched == 0 for c in present) or all(c.whole == c.layers for c in present):
        return []
    some = [s for s, c in enumerate(ckpts) if c is not None and c.whole < c.layers]
    applies = [c is not None for c in ckpts]
    return [
        Problem(
            f"stage(s) {','.join(map(str, some[:6]))} checkpoint only some of their decoder layers: torchtitan's "
            'activation_checkpoint.mode = "full" checkpoints every transformer block, and has no count of blocks',
            lambda x: uniform_recompute(x, applies),
            "--no-recompute",
        )
    ]


def fqns(unit: Unit, head_fqns: Sequence[str] = HEAD_FQNS) -> list[str]:
    if unit.kind == "embedding":
        return ["tok_embeddings"]
    if unit.kind == "decoder":
        return [f"layers.{unit.index}"]
    return list(head_fqns)


def model_parts(d: Decisions, stack: DecoderStack, head_fqns: Sequence[str] = HEAD_FQNS) -> list[list[str]]:
    return [[f for u in stack.stage_units(a, b) for f in fqns(u, head_fqns)] for a, b in d.stages]


def settings(
    d: Decisions,
    names: Sequence[str],
    *,
    head_fqns: Sequence[str] = HEAD_FQNS,
    csv_path: str = "",
    experts: Sequence[ExpertLayer] | None = None,
) -> dict[str, dict[str, object]]:
    """The TOML tables as a dict: ``parallelism``, ``training``, ``activation_checkpoint`` and
    ``optimizer`` (its ``implementation``: the step's kernels the plan's memory counts, fused or
    torch's foreach) (``csv_path``: where the plan's action list is written, when it has one; ``experts``: a
    model with mixture-of-experts layers gets ``expert_parallel_degree``, the plan's E, which is
    also written for E > 1 without them; C > 1 adds ``context_parallel_degree``)."""
    stack = decoder_stack(names)
    runs_list = d.actions is not None or d.schedule not in SCHEDULES
    schedule = CSV_SCHEDULES[d.virtual_stages > 1] if runs_list else SCHEDULES[d.schedule]
    par: dict[str, object] = {
        "pipeline_parallel_degree": d.pipeline_degree,
        "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatch_size": d.microbatch_size,
        "module_fqns_per_model_part": model_parts(d, stack, head_fqns),
        "tensor_parallel_degree": d.tensor_parallel,
        "data_parallel_replicate_degree": d.data_parallel if d.zero_stage == 0 else 1,
        "data_parallel_shard_degree": 1 if d.zero_stage == 0 else d.data_parallel,
    }
    if d.tensor_parallel > 1:
        par["enable_sequence_parallel"] = d.sequence_parallel
    if d.zero_stage in (1, 2) or (d.zero_stage == 0 and d.context_parallel > 1):
        par["fsdp_reshard_after_forward"] = "never"  # ZeRO 0 under C > 1: FSDP over the C ranks, kept whole
    if runs_list:
        par["pipeline_parallel_schedule_csv"] = csv_path
    if d.context_parallel > 1:
        par["context_parallel_degree"] = d.context_parallel
    if experts or d.expert_parallel > 1:
        par["expert_parallel_degree"] = d.expert_parallel
    return {
        "parallelism": par,
        "training": {
            "local_batch_size": d.microbatch_size * d.num_microbatches,
            "global_batch_size": d.global_batch_size,
        },
        "activation_checkpoint": (
            {"mode": "selective", "selective_ac_option": "op"} if d.selective_recompute
            else {"mode": "full" if any(c is not None and c.whole for c in decoder_checkpoints(d, stack)) else "none"}
        ),
        "optimizer": {"implementation": "fused" if d.fused_optimizer else "foreach"},
    }


def cli_overrides(tables: dict[str, dict[str, object]]) -> list[str]:
    """torchtitan 0.3's command-line form of the same settings."""
    args: list[str] = []
    for section in ("parallelism", "training", "optimizer"):
        for key, value in tables[section].items():
            args.append(f"--{section}.{key}")
            if isinstance(value, bool):  # tyro's flag form
                args[-1] = f"--{section}.{key}" if value else f"--{section}.no_{key}"
            elif isinstance(value, list):
                args += [",".join(part) for part in value]
            else:
                args.append(str(value))
    args.append(f"activation-checkpoint:{tables['activation_checkpoint']['mode']}")
    return args


def to_toml(tables: dict[str, dict[str, object]]) -> str:
    """TOML for the value types used here: integers, strings, booleans, lists of string lists."""
    lines: list[str] = []
    for section, values in tables.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, int):
                lines.append(f"{key} = {value}")
            elif isinstance(value, str):
                lines.append(f"{key} = {json.dumps(value)}")
            elif isinstance(value, list):
                lines.append(f"{key} = [")
                lines += [f"  [{', '.join(json.dumps(x) for x in part)}]," for part in value]
                lines.append("]")
            else:  # pragma: no cover - only the types above are written
                raise TypeError(f"cannot write {type(value).__name__} {key!r} to TOML")
        lines.append("")
    return "\n".join(lines)


def render(d: Decisions, info: PlanInfo, *, output: str = DEFAULT_FILE, head_fqns: Sequence[str] = HEAD_FQNS) -> Export:
    tables = settings(
        d, info.layer_names, head_fqns=head_fqns, csv_path=output + SCHEDULE_CSV_SUFFIX, experts=info.experts
    )
    files: list[ExportFile] = []
    if d.actions is not None or d.schedule not in SCHEDULES:
        files.append(ExportFile(actions_csv(d.action_lines()), SCHEDULE_CSV_SUFFIX))
    overrides = " ".join(cli_overrides(tables))
    head = [f"# {line}" for line in info.header(TARGET, d)]
    head += [
        f"# torchtitan <= 0.2: merge these tables into the job's TOML (--job.config_file); launch "
        f"{d.world_size} ranks.",
        *_expert_comment(info.experts),
        *_mesh_comment(d),
        "# torchtitan 0.3 takes the same settings as command-line overrides:",
        f"#   {overrides}",
        "",
    ]
    text = "\n".join(head) + to_toml(tables)
    return Export(TARGET, (ExportFile(text), *files))



def _mesh_comment(d: Decisions) -> list[str]:
    """What torchtitan does with the plan's context and expert parallelism."""
    lines: list[str] = []
    c = d.context_parallel
    if c > 1:
        lines += [
            f"# Context parallelism C={c}: torchtitan all-gathers K/V, as the plan (0.2: context_parallel_rotate_method "
            f'"allgather", its default); training.seq_len must be a multiple of {2 * c * d.tensor_parallel} (2 x C x T).',
            "# torchtitan shards parameters over the context-parallel ranks too (FSDP over data_parallel_shard x "
            "context_parallel): less memory than pipeplan predicts.",
        ]
    if d.expert_parallel > 1:
        lines.append(
            f"# Expert parallelism E={d.expert_parallel}: experts sharded over {d.expert_parallel} of the "
            "data_parallel_shard x context_parallel ranks (context-parallel ranks first), as pipeplan prices it."
        )
    return lines


def _expert_comment(experts: Sequence[ExpertLayer] | None) -> list[str]:
    """torchtitan sets a model's experts in its model configuration, not in the job's."""
    if not experts:
        return []
    e = experts[0]
    shared = f" and {e.shared_experts} shared expert(s)" if e.shared_experts else ""
    return [
        f"# The model's {len(experts)} mixture-of-experts layers have {e.experts} experts{shared}, top-{e.top_k}: "
        "set them in the model's configuration (its router's num_experts and top_k)."
    ]
