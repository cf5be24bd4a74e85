"""Megatron-LM: the command-line flags that run a plan.

Units: the embedding is ``E``, decoder layer *i* is the *i*-th ``t``, the head (final norm,
output layer, loss) is ``L`` (a Hugging Face decoder's ``model.embed_tokens``, ``model.layers.i``,
``model.norm`` + ``lm_head``; its ``model.rotary_emb`` places nothing and goes with its stage).
``--num-layers`` (a model flag, named in the header) is the number of decoder layers.

Mixture of experts, when the profile is given: ``--num-experts N --moe-router-topk k
--expert-model-parallel-size E`` (the plan's expert-parallel degree), ``--moe-layer-freq``
when only some decoder layers have experts (DeepSeek-V3's dense first layers), and a profile routed
with a capacity factor as ``--moe-expert-capacity-factor`` with padding.  Shared experts need
``--moe-shared-expert-intermediate-size``, which the profile does not know: the header asks for it.
Layers with different expert settings are refused (one set of flags for every MoE layer).

Context and expert parallelism: ``--context-parallel-size C`` with ``--cp-comm-type all_gather``
(K/V all-gathered before attention, the plan's "all-gather") or ``p2p`` (K/V passed around a ring
overlapped with attention, the plan's "ring"); both need Transformer Engine's attention, and
Megatron cuts each sequence into 2C chunks (``--seq-length`` a multiple of 2C, as pipeplan's cost
model assumes).  ``--expert-model-parallel-size E`` shards each MoE layer's experts over E ranks;
Megatron orders ranks ``tp-cp-ep-dp-pp`` (tensor-parallel ranks innermost) and draws an expert
group from the CP x DP ranks, context-parallel ranks first, each expert split over the
tensor-parallel ranks (expert tensor parallelism defaults to TP): pipeplan's group and sharding
(:mod:`planner.experts`).  Megatron checks that E divides DP x CP (``world_size`` divisible by
TP x EP x PP) and the expert count, and Megatron-LM asserts ``--sequence-parallel`` for a MoE model
with TP > 1: plans without it are refused, with the nearest plan.  The launch line counts
TP x CP x PP x DP ranks.

``--pipeline-model-parallel-layout`` lists the stages separated by
``|``; stage *i* of that flat list runs on pipeline rank ``i % PP`` as virtual stage ``i // PP``,
which is pipeplan's placement.  Megatron-LM refuses ``--num-virtual-stages-per-pipeline-rank``
next to a layout (the layout implies it), so the flag is written only when the plan's split is
Megatron's own even split and no layout is needed.

What the flags cannot say, and the nearest plan offered instead:

* a cut inside a decoder layer (a profile cut with ``--split-points`` inside blocks): the cut
  moves to the nearest layer boundary;
* GPipe (Megatron runs 1F1B, or interleaved 1F1B): 1F1B, same split;
* interleaving on one pipeline rank: the chunks merge into one stage;
* recompute on some stages only: ``--recompute-*`` apply to every stage's decoder layers alike
  (the embedding and the loss head are never recomputed), so recompute on all or none;
* a different number of checkpointed decoder layers per stage: ``--recompute-num-layers`` is one
  count N, so every stage checkpoints its first N (the largest count of the plan) or none does;
  likewise a count that ends inside a decoder layer cut into parts: whole layers, fewer or more;
* ZeRO-3: ``--use-distributed-optimizer`` shards optimizer state and gradients (ZeRO 1-2).

Recompute is activation checkpointing layer by layer, in Megatron as in pipeplan's cost model and
runtime: each checkpointed decoder layer keeps only its input and re-runs its forward in the
backward.  A plan that checkpoints every decoder layer of every stage is written as
``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``; one that
checkpoints the first N decoder layers of each stage as ``--recompute-granularity full
--recompute-method block --recompute-num-layers N`` (Megatron's block method checkpoints the first
N layers of each pipeline stage, or of each virtual chunk, and all of them on a stage with fewer).
Megatron never checkpoints the embedding or the output layer and loss; pipeplan counts them among
a stage's layers, so where a plan checkpoints them its prediction for the first and the last
stage is below what Megatron keeps there (on the last, the output layer's logits and the loss's
float32 tensors: a large share with a large vocabulary).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from planner.export.common import (
    CLASSIC_SCHEDULES,
    Decisions,
    DecoderCheckpoints,
    ExpertLayer,
    Export,
    ExportFile,
    PlanInfo,
    Problem,
    checkpoint_decoders,
    cut_problems,
    decoder_checkpoints,
    empty_stage_problems,
    expert_decoders,
    expert_problems,
    experts_off,
    merge_chunks,
    recompute_problems,
    to_1f1b,
    to_classic,
)
from planner.export.mapping import DecoderStack, NotAStack, decoder_stack

TARGET = "megatron"
DEFAULT_FILE = "megatron_args.sh"
LAYER_CHARS = {"embedding": "E", "decoder": "t", "head": "L"}
ARRAY = "PIPEPLAN_MEGATRON_ARGS"
#: the export writes the model's expert settings when it knows them (the profile is given)
EXPERT_SETTINGS = True
#: the plan's context attention -> Megatron's --cp-comm-type (megatron-core's TransformerConfig.cp_comm_type,
#: Transformer Engine's names; Megatron-LM's help text spells the first "allgather", which TE does not take)
CP_COMM_TYPES = {"all-gather": "all_gather", "ring": "p2p"}
#: what a new plan needs to stay within Megatron's schedules (added to every replan hint)
REPLAN_SCHEDULES = "--schedules 1f1b,interleaved-1f1b --zero 0"


def problems(d: Decisions, names: Sequence[str], *, experts: Sequence[ExpertLayer] | None = None) -> list[Problem]:
    """What Megatron-LM's flags cannot say of decisions ``d`` on layers ``names`` (``experts``:
    the profile's mixture-of-experts layers, when it was given)."""
    try:
        stack = decoder_stack(names)
    except NotAStack as err:
        return [Problem(f"Megatron places an embedding (E), decoder layers (t) and a loss head (L): {err}")]
    out = expert_problems(names, stack, experts, "Megatron-LM (--num-experts, --moe-router-topk)")
    out += mesh_problems(d, experts)
    out += cut_problems(d, names, stack, "Megatron's layout places whole decoder layers")
    out += empty_stage_problems(d, names, stack, "Megatron's layout")
    if d.schedule == "gpipe":
        out.append(
            Problem(
                "schedule 'gpipe': Megatron-LM has no GPipe schedule (it runs 1F1B, or interleaved 1F1B "
                "with virtual stages)",
                to_1f1b,
                "--schedule 1f1b",
            )
        )
    if d.virtual_stages > 1 and d.pipeline_degree == 1:
        out.append(
            Problem(
                f"{d.virtual_stages} virtual stages on pipeline degree 1: Megatron interleaves only "
                "with --pipeline-model-parallel-size > 1",
                merge_chunks,
                "--virtual-stages 1",
            )
        )
    on_off = recompute_problems(d, stack, "Megatron's --recompute-* flags apply to the decoder layers of every stage alike")
    out += on_off or checkpoint_problems(d, stack)
    if d.schedule not in CLASSIC_SCHEDULES:
        out.append(
            Problem(
                f"schedule {d.schedule!r}: Megatron-LM's flags name 1F1B and interleaved 1F1B only",
                to_classic,
                REPLAN_SCHEDULES,
            )
        )
    elif d.actions is not None:
        out.append(
            Problem(
                "the plan carries its own action list: Megatron runs only its named schedules",
                lambda x: [("its named schedule instead of the action list", x.replace(actions=None))],
            )
        )
    if d.zero_stage > 2:
        out.append(
            Problem(
                "ZeRO stage 3: --use-distributed-optimizer shards optimizer state and gradients (ZeRO 1-2), "
                "not parameters",
                lambda x: [("ZeRO stage 2", x.replace(zero_stage=2))],
            )
        )
    return out


def mesh_problems(d: Decisions, experts: Sequence[ExpertLayer] | None) -> list[Problem]:
    """Expert parallelism Megatron cannot set up: E not dividing DP x CP (its expert rank
    generator needs ``world_size`` divisible by TP x EP x PP) or the expert count; and a MoE model
    with TP > 1 without sequence parallelism, which Megatron-LM's argument check refuses."""
    out: list[Problem] = []
    e, dc = d.expert_parallel, d.data_parallel * d.context_parallel
    if e > 1 and dc % e:
        out.append(
            Problem(
                f"expert parallelism E={e} does not divide DP x CP = {d.data_parallel} x {d.context_parallel} = {dc}: "
                "Megatron draws the expert-parallel ranks from the data- and context-parallel ranks "
                "(world size divisible by TP x EP x PP)",
                experts_off,
                "--expert-parallel 1",
            )
        )
    counts = sorted({x.experts for x in experts or ()})
    if e > 1 and any(n % e for n in counts):
        out.append(
            Problem(
                f"expert parallelism E={e} does not divide the {counts[0]} experts of a layer: Megatron "
                "(--expert-model-parallel-size) gives every expert-parallel rank the same number of experts",
                experts_off,
                "--expert-parallel 1",
            )
        )
    moe = bool(experts) or e > 1
    if moe and d.tensor_parallel > 1 and not d.sequence_parallel:
        out.append(
            Problem(
                f"a mixture-of-experts model with tensor parallelism T={d.tensor_parallel} and no sequence parallelism: "
                "Megatron-LM requires --sequence-parallel with experts and TP > 1",
                lambda x: [("sequence parallelism on", x.replace(sequence_parallel=True))],
                "--sequence-parallel",
            )
        )
    return out


def checkpoint_problems(d: Decisions, stack: DecoderStack) -> list[Problem]:
    """Checkpointed decoder layers that ``--recompute-num-layers`` cannot count: part of a layer,
    or counts no single N gives (``--recompute-method block``: the first N of each stage)."""
    ckpts = decoder_checkpoints(d, stack)
    cut = [s for s, c in enumerate(ckpts) if c is not None and c.whole != c.touched]
    if cut:
        s = cut[0]
        return [
            Problem(
                f"stage {s} checkpoints its first {d.checkpointed_layers[s]} layers, which end inside a decoder "
                "layer: Megatron checkpoints whole decoder layers",
                lambda x: _whole_decoders(x, stack),
            )
        ]
    if block_count(ckpts) is not None:
        return []
    counts = ", ".join(f"{c.whole} of {c.layers}" for c in ckpts if c is not None)
    return [
        Problem(
            f"the stages checkpoint {counts} decoder layers: Megatron's --recompute-num-layers is one count N "
            "for every stage (--recompute-method block checkpoints the first N decoder layers of each)",
            lambda x: _block_or_none(x, stack),
            "--no-recompute",
        )
    ]


def _block_or_none(d: Decisions, stack: DecoderStack) -> list[tuple[str, Decisions]]:
    """Every stage checkpoints as many of its first decoder layers as the plan's largest count
    (all of them where it has fewer), or no stage recomputes."""
    ckpts = decoder_checkpoints(d, stack)
    n = max((c.whole for c in ckpts if c is not None), default=0)
    block = checkpoint_decoders(d, stack, [min(n, c.layers) if c else 0 for c in ckpts])
    return [
        (f"every stage checkpoints its first {n} decoder layers", block),
        ("recompute on no stage", d.with_recompute([False] * len(d.stages))),
    ]


def block_count(ckpts: Sequence[DecoderCheckpoints | None]) -> int | None:
    """The ``--recompute-num-layers`` N of ``--recompute-method block`` that checkpoints what the
    stages do (0: none of them recomputes; every layer of every stage: their largest count), or
    ``None`` when no N does."""
    present = [c for c in ckpts if c is not None]
    n = max((c.whole for c in present), default=0)
    return n if all(c.whole == c.touched == min(n, c.layers) for c in present) else None


def _whole_decoders(d: Decisions, stack: DecoderStack) -> list[tuple[str, Decisions]]:
    """Each stage's checkpoints rounded to whole decoder layers: down, or up."""
    ckpts = decoder_checkpoints(d, stack)
    down = [c.whole if c else 0 for c in ckpts]
    up = [c.touched if c else 0 for c in ckpts]
    return [
        ("checkpoints rounded down to whole decoder layers", checkpoint_decoders(d, stack, down)),
        ("checkpoints rounded up to whole decoder layers", checkpoint_decoders(d, stack, up)),
    ]


def stage_layout(d: Decisions, stack: DecoderStack) -> list[str]:
    """Each stage as Megatron layer characters, e.g. ``["Ettt", "ttt", "tttL"]``."""
    return ["".join(LAYER_CHARS[u.kind] for u in stack.stage_units(a, b)) for a, b in d.stages]


def encode_layout(stages: Sequence[str]) -> str:
    """The ``--pipeline-model-parallel-layout`` string: ``x*n`` for runs of 3 or more layers in a
    stage, ``(stage|)*n`` for runs of equal stages, ``|`` between stages."""
    short = [re.sub(r"(t{3,})", lambda m: f"t*{len(m.group(1))}", s) for s in stages]
    pieces: list[str] = []
    i = 0
    while i < len(short):
        j = i
        while j + 1 < len(short) and short[j + 1] == short[i]:
            j += 1
        run, last = j - i + 1, j == len(short) - 1
        s = short[i]
        if run >= 2:
            plain = "|".join([s] * run) + ("" if last else "|")
            repeat = f"({s}|)*{run - 1}{s}" if last else f"({s}|)*{run}"
            pieces.append(repeat if len(repeat) <= len(plain) else plain)
        else:
            pieces.append(s if last else f"{s}|")
        i = j + 1
    return "".join(pieces)


def expand_layout(text: str) -> list[str]:
    """Read a layout string back into one string of layer characters per stage (Megatron's
    syntax: ``,`` is cosmetic, ``(...)*n`` and ``x*n`` repeat, ``|`` separates stages)."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def is_even_split(stages: Sequence[str], num_decoder_layers: int) -> bool:
    """Whether ``stages`` is Megatron's split without a layout: the same number of decoder
    layers on every (virtual) stage, the embedding on the first, the loss on the last."""
    n, rem = divmod(num_decoder_layers, len(stages))
    if rem or n == 0:
        return False
    expect = ["t" * n for _ in stages]
    expect[0] = "E" + expect[0]
    expect[-1] += "L"
    return list(stages) == expect


def argv(d: Decisions, names: Sequence[str], *, experts: Sequence[ExpertLayer] | None = None) -> list[str]:
    """The flags, one argv entry each (call only for a plan without :func:`problems`)."""
    stack = decoder_stack(names)
    stages = stage_layout(d, stack)
    args = ["--pipeline-model-parallel-size", str(d.pipeline_degree), "--tensor-model-parallel-size", str(d.tensor_parallel)]
    if d.sequence_parallel and d.tensor_parallel > 1:
        args.append("--sequence-parallel")
    if d.context_parallel > 1:
        args += ["--context-parallel-size", str(d.context_parallel), "--cp-comm-type", CP_COMM_TYPES[d.context_attention]]
    if not is_even_split(stages, stack.num_decoder_layers):
        args += ["--pipeline-model-parallel-layout", encode_layout(stages)]
    elif d.virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(d.virtual_stages)]
    args += ["--micro-batch-size", str(d.microbatch_size), "--global-batch-size", str(d.global_batch_size)]
    args += recompute_args(d, stack)
    if d.zero_stage >= 1:
        args.append("--use-distributed-optimizer")
    return args + expert_args(names, stack, experts or (), expert_parallel=d.expert_parallel)


def expert_args(
    names: Sequence[str], stack: DecoderStack, experts: Sequence[ExpertLayer], *, expert_parallel: int = 1
) -> list[str]:
    """``--num-experts N --moe-router-topk k --expert-model-parallel-size E`` for a model with
    mixture-of-experts layers, ``--moe-layer-freq`` when only some decoder layers have experts,
    and Megatron's capacity with padding for a profile routed with a capacity factor (every
    expert processes its capacity).  Without the profile (``experts`` empty) only E > 1 is
    written: the model flags must then say ``--num-experts``."""
    if not experts:
        return ["--expert-model-parallel-size", str(expert_parallel)] if expert_parallel > 1 else []
    e = experts[0]
    args = ["--num-experts", str(e.experts), "--moe-router-topk", str(e.top_k),
            "--expert-model-parallel-size", str(expert_parallel)]
    pattern = [int(x) for x in expert_decoders(names, stack, experts)]
    if not all(pattern):
        args += ["--moe-layer-freq", encode_layer_freq(pattern)]
    if e.capacity_factor is not None:
        args += ["--moe-expert-capacity-factor", f"{e.capacity_factor:g}", "--moe-pad-expert-input-to-capacity"]
    return args


def encode_layer_freq(pattern: Sequence[int]) -> str:
    """``--moe-layer-freq`` as Megatron-LM evaluates it: runs of 0 (dense) and 1 (experts),
    e.g. ``([0]*3+[1]*58)`` for DeepSeek-V3."""
    runs: list[list[int]] = []
    for x in pattern:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "(" + "+".join(f"[{x}]*{n}" for x, n in runs) + ")"


def recompute_args(d: Decisions, stack: DecoderStack) -> list[str]:
    """Selective recompute, full recompute of every decoder layer (uniform, 1), of the first N of
    each stage (block, N), or nothing."""
    if d.selective_recompute:
        return ["--recompute-granularity", "selective"]
    ckpts = decoder_checkpoints(d, stack)
    n = block_count(ckpts)
    if not n:
        return []
    if all(c is None or c.whole == c.layers for c in ckpts):
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(n)]


def render(d: Decisions, info: PlanInfo, *, output: str = DEFAULT_FILE) -> Export:
    stack = decoder_stack(info.layer_names)
    args = argv(d, info.layer_names, experts=info.experts)
    cp = f" x CP {d.context_parallel}" if d.context_parallel > 1 else ""
    lines = [f"# {line}" for line in info.header(TARGET, d)] + _expert_comment(info.experts)
    lines += _mesh_comment(d, info.experts)
    lines += [
        f"# Megatron-LM flags. Launch {d.world_size} ranks (TP {d.tensor_parallel}{cp} x PP {d.pipeline_degree} x DP "
        f"{d.data_parallel}); your model flags must say --num-layers {stack.num_decoder_layers}.",
        f"# Layout stage i runs on pipeline rank i % {d.pipeline_degree}. Use:",
        f'#   source {output} && torchrun ... pretrain_gpt.py "${{{ARRAY}[@]}}" <model, data and optimizer flags>',
        f"{ARRAY}=(",
    ]
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            lines.append(f"  {args[i]} {shlex.quote(args[i + 1])}")
            i += 2
        else:
            lines.append(f"  {args[i]}")
            i += 1
    lines.append(")")
    return Export(TARGET, (ExportFile("\n".join(lines) + "\n"),))



def _mesh_comment(d: Decisions, experts: Sequence[ExpertLayer] | None) -> list[str]:
    """What the context- and expert-parallel flags need from the rest of the command line."""
    lines: list[str] = []
    c, e = d.context_parallel, d.expert_parallel
    if c > 1:
        lines.append(
            f"# Context parallelism: each sequence split over {c} ranks, {2 * c} chunks (--seq-length a multiple of "
            f"{2 * c}); --cp-comm-type {CP_COMM_TYPES[d.context_attention]} needs Transformer Engine "
            "(--transformer-impl transformer_engine)."
        )
        if d.zero_stage >= 1:
            lines.append(
                "# Megatron's distributed optimizer shards over DP x CP ranks, pipeplan's ZeRO over DP only: "
                "Megatron keeps less optimizer state than predicted."
            )
    if e > 1:
        lines.append(
            f"# Expert parallelism: each MoE layer's experts sharded over {e} of the DP x CP ranks (Megatron's rank "
            "order tp-cp-ep-dp-pp: context-parallel ranks first), each expert split over the TP ranks."
        )
        if not experts:
            lines.append("# Your model flags must set --num-experts and --moe-router-topk (export with --profile to write them).")
    return lines


def _expert_comment(experts: Sequence[ExpertLayer] | None) -> list[str]:
    if not experts:
        return []
    e = experts[0]
    lines = [f"# The model's {len(experts)} mixture-of-experts layers route each token to {e.top_k} of {e.experts} experts."]
    if e.shared_experts:
        lines.append(
            f"# They have {e.shared_experts} shared expert(s): add --moe-shared-expert-intermediate-size "
            "(shared experts x their FFN size) to your model flags."
        )
    return lines
