"""What every exporter shares: a plan's decisions, refusals with the nearest plan, the result.

An exporter looks at a plan's *decisions* (:class:`Decisions`: stages, recompute and how many
layers each stage checkpoints, schedule, M, K, D and the mesh axes the schema will carry) and
lists the :class:`Problem` s its target cannot express.  Each problem offers fixes: candidate
decisions the target is closer to expressing.
:func:`nearest` applies fixes until nothing is left to fix, prices every candidate with
:func:`planner.cost.estimate` and keeps the fastest one that fits memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.cost import Layout, estimate, plan_fits
from planner.errors import InputError, PipeplanError
from planner.export.mapping import DecoderStack
from planner.schedules import (
    ScheduleError,
    format_actions,
    placement_of,
    rank_stages,
    schedule_actions,
)
from planner.schema import Plan, Profile, Schedule
from planner.units import format_bytes

#: how many rounds of fixes :func:`nearest` applies before it gives up
MAX_FIX_ROUNDS = 6


def own_actions(plan: Plan) -> tuple[tuple[str, ...], ...] | None:
    """The plan's per-rank action list when it is its own: a ``planned`` schedule's, or one
    that differs from the template of its named schedule (:mod:`planner.schedules`); ``None``
    when the plan carries none or the template itself (which the target's named schedule runs)."""
    lines = getattr(plan, "actions", None)
    if not lines:
        return None
    ranks = tuple(tuple(line.split()) for line in lines)
    if plan.schedule != "planned":
        try:
            template = schedule_actions(plan.schedule, plan.pipeline_degree, plan.num_microbatches, plan.virtual_stages)
        except ScheduleError:
            return ranks
        if tuple(tuple(line.split()) for line in format_actions(template)) == ranks:
            return None
    return ranks


def _all_or_none(stages: Sequence[tuple[int, int]], recompute: Sequence[bool]) -> tuple[int, ...]:
    """Every layer of each recomputing stage checkpointed, none of the others."""
    return tuple(b - a if r else 0 for (a, b), r in zip(stages, recompute, strict=True))


@dataclass(frozen=True)
class Decisions:
    """The decisions of a plan that an exporter writes out (layer ranges are ``[start, stop)``).

    ``tensor_parallel``, ``zero_stage`` and ``sequence_parallel`` are read from the plan when
    its schema carries them (``tensor_parallel_degree``, ``zero_stage``, ``sequence_parallel``)
    and default to 1, 0, False; so are ``context_parallel`` C and ``context_attention``
    (``context_parallel_degree``, ``context_attention``: 1, "all-gather") and
    ``expert_parallel`` E (``expert_parallel_degree``: 1).  ``actions`` is the plan's own
    per-rank action list (``"0F3"``, ``"1B2"``, ...) when it carries one that is not its named
    schedule's template (:func:`own_actions`), else ``None``.

    ``checkpointed_layers[s]``: how many of stage ``s``'s first layers are checkpointed, one by
    one (``StagePlan.checkpointed_layers``: every layer of a recomputing stage unless the plan
    says fewer, Megatron's ``--recompute-method block``); left empty, every layer of each
    recomputing stage.  :meth:`replace` keeps it consistent when the stages or ``recompute``
    change (:meth:`with_recompute` sets both).
    """

    stages: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    schedule: Schedule
    num_microbatches: int
    pipeline_degree: int
    data_parallel: int
    global_batch_size: int
    tensor_parallel: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    actions: tuple[tuple[str, ...], ...] | None = None
    selective_recompute: bool = False
    checkpointed_layers: tuple[int, ...] = ()
    context_parallel: int = 1
    context_attention: str = "all-gather"
    expert_parallel: int = 1
    #: the optimizer step's kernels the plan's memory counts (``TrainingSetup.fused_optimizer``)
    fused_optimizer: bool = False

    def __post_init__(self) -> None:
        if not self.checkpointed_layers:
            object.__setattr__(self, "checkpointed_layers", _all_or_none(self.stages, self.recompute))

    @classmethod
    def from_plan(cls, plan: Plan) -> Decisions:
        return cls(
            stages=tuple((s.start, s.stop) for s in plan.stages),
            recompute=tuple(s.recompute for s in plan.stages),
            schedule=plan.schedule,
            num_microbatches=plan.num_microbatches,
            pipeline_degree=plan.pipeline_degree,
            data_parallel=plan.data_parallel_degree,
            global_batch_size=plan.global_batch_size,
            tensor_parallel=int(getattr(plan, "tensor_parallel_degree", 1) or 1),
            zero_stage=int(getattr(plan, "zero_stage", 0) or 0),
            sequence_parallel=bool(getattr(plan, "sequence_parallel", False)),
            actions=own_actions(plan),
            selective_recompute=bool(getattr(plan, "selective_recompute", False)),
            checkpointed_layers=tuple(s.checkpointed_layers for s in plan.stages),
            context_parallel=int(getattr(plan, "context_parallel_degree", 1) or 1),
            context_attention=str(getattr(plan, "context_attention", "all-gather") or "all-gather"),
            expert_parallel=int(getattr(plan, "expert_parallel_degree", 1) or 1),
            fused_optimizer=plan.training.fused_optimizer,
        )

    def replace(self, **changes: object) -> Decisions:
        """These decisions with ``changes``.  New ``stages`` or ``recompute`` without new
        ``checkpointed_layers``: a stage that checkpointed only its first N layers keeps N
        (at most its size) when the number of stages stays, every other recomputing stage
        checkpoints all its layers."""
        if ("stages" in changes or "recompute" in changes) and "checkpointed_layers" not in changes:
            stages: tuple[tuple[int, int], ...] = changes.get("stages", self.stages)  # type: ignore[assignment]
            recompute: tuple[bool, ...] = changes.get("recompute", self.recompute)  # type: ignore[assignment]
            changes["checkpointed_layers"] = self._carried_checkpoints(stages, recompute)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def with_recompute(self, recompute: Sequence[bool]) -> Decisions:
        """Recompute on the stages ``recompute`` names, every layer of each checkpointed."""
        flags = tuple(bool(r) for r in recompute)
        return self.replace(recompute=flags, checkpointed_layers=_all_or_none(self.stages, flags))

    def with_checkpoints(self, counts: Sequence[int]) -> Decisions:
        """Stage ``s`` checkpoints its first ``counts[s]`` layers (0: it does not recompute)."""
        return self.replace(recompute=tuple(n > 0 for n in counts), checkpointed_layers=tuple(counts))

    def _carried_checkpoints(self, stages: Sequence[tuple[int, int]], recompute: Sequence[bool]) -> tuple[int, ...]:
        same = len(stages) == len(self.stages)
        out = []
        for s, ((a, b), r) in enumerate(zip(stages, recompute, strict=True)):
            old = self.checkpointed_layers[s] if same else 0
            partial = same and 0 < old < self.stages[s][1] - self.stages[s][0]
            out.append(0 if not r else min(old, b - a) if partial else b - a)
        return tuple(out)

    @property
    def partial_stages(self) -> list[int]:
        """Stages that checkpoint some of their layers but not all."""
        return [s for s, ((a, b), n) in enumerate(zip(self.stages, self.checkpointed_layers, strict=True)) if 0 < n < b - a]

    def action_lines(self) -> tuple[tuple[str, ...], ...]:
        """Each rank's actions: the plan's own list, or its named schedule's template
        (:func:`planner.schedules.schedule_actions`, the one definition of every order)."""
        if self.actions is not None:
            return self.actions
        orders = schedule_actions(self.schedule, self.pipeline_degree, self.num_microbatches, self.virtual_stages)
        return tuple(tuple(line.split()) for line in format_actions(orders))

    def stages_of_rank(self) -> dict[int, list[int]]:
        """Pipeline rank -> the stages it holds, by the schedule's placement (loop or V)."""
        ranks = rank_stages(placement_of(self.schedule), self.pipeline_degree, self.virtual_stages)
        return dict(enumerate(ranks))

    @property
    def virtual_stages(self) -> int:
        return len(self.stages) // self.pipeline_degree

    @property
    def microbatch_size(self) -> int:
        return self.global_batch_size // (self.data_parallel * self.num_microbatches)

    @property
    def num_layers(self) -> int:
        return self.stages[-1][1]

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: K x D x T x C (E is drawn from the D x C ranks)."""
        return self.pipeline_degree * self.data_parallel * self.tensor_parallel * self.context_parallel

    def summary(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        mesh = f" x T={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        if self.context_parallel > 1:
            mesh += f" x C={self.context_parallel} ({self.context_attention} attention)"
        if self.expert_parallel > 1:
            mesh += f", E={self.expert_parallel}"
        return (
            f"{self.schedule}, K={self.pipeline_degree}{v} x D={self.data_parallel}{mesh}, "
            f"M={self.num_microbatches} micro-batches of {self.microbatch_size}"
        )


#: a fix: candidate decisions, each with a short description of what changed
Fix = Callable[[Decisions], list[tuple[str, Decisions]]]


@dataclass(frozen=True)
class Problem:
    """Something a target cannot express, and how to get closer (no fix: nothing can)."""

    reason: str
    fix: Fix | None = None
    replan: str = ""  # `pipeplan plan` flags that keep a new plan within the target's rules


@dataclass(frozen=True)
class ExportFile:
    """One file of an export.  ``suffix`` is appended to the output name for side files."""

    text: str
    suffix: str = ""


@dataclass(frozen=True)
class Export:
    target: str
    files: tuple[ExportFile, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertLayer:
    """A mixture-of-experts layer of the profile (``LayerProfile.moe``), as the targets' MoE
    flags say it: routed experts, experts per token, shared experts, capacity factor (``None``:
    balanced routing, no capacity)."""

    name: str
    experts: int
    top_k: int
    shared_experts: int = 0
    capacity_factor: float | None = None

    def describe(self) -> str:
        shared = f" + {self.shared_experts} shared" if self.shared_experts else ""
        cap = f", capacity factor {self.capacity_factor:g}" if self.capacity_factor is not None else ""
        return f"{self.experts} experts{shared}, top-{self.top_k}{cap}"


def expert_layers(profile: Profile) -> tuple[ExpertLayer, ...]:
    """The profile's mixture-of-experts layers, in order (empty for a dense model)."""
    return tuple(
        ExpertLayer(layer.name, layer.moe.experts, layer.moe.top_k, layer.moe.shared_experts, layer.moe.capacity_factor)
        for layer in profile.layers
        if layer.moe is not None
    )


@dataclass(frozen=True)
class PlanInfo:
    """What an export says about the plan it comes from (model, layer names, prediction) and,
    when the profile is given, about its layers: ``experts`` lists its mixture-of-experts layers
    (``None``: no profile was given, so the export cannot tell whether it has any)."""

    model: str
    layer_names: tuple[str, ...]
    profile_sha256: str
    step_time_ms: float | None
    experts: tuple[ExpertLayer, ...] | None = None

    @classmethod
    def from_plan(cls, plan: Plan, *, priced: bool = True, profile: Profile | None = None) -> PlanInfo:
        names = tuple(n for s in plan.stages for n in s.layer_names)
        step = plan.predicted.step_time_ms if priced else None
        experts = expert_layers(profile) if profile is not None else None
        return cls(plan.model, names, plan.profile_sha256, step, experts)

    def header(self, target: str, decisions: Decisions) -> list[str]:
        step = f"predicted step {self.step_time_ms:.2f} ms" if self.step_time_ms is not None else "not priced"
        return [
            f"pipeplan export --to {target}: {self.model}, {decisions.summary()} "
            f"(global batch {decisions.global_batch_size})",
            f"{step} (pipeplan cost model); profile_sha256 {self.profile_sha256[:12]}...",
        ]


# --------------------------------------------------------------------------- fixes shared by targets


def merge_chunks(d: Decisions) -> list[tuple[str, Decisions]]:
    """Interleaved -> one chunk per rank: rank r's stage is chunks r*v .. r*v+v-1 merged."""
    v = d.virtual_stages
    stages = tuple((d.stages[r * v][0], d.stages[r * v + v - 1][1]) for r in range(d.pipeline_degree))
    rc = tuple(any(d.recompute[r * v : (r + 1) * v]) for r in range(d.pipeline_degree))
    merged = d.replace(stages=stages, recompute=rc)  # a merged stage checkpoints all its layers, or none
    return _with_schedule(merged, "1f1b", f"{v} chunks per rank merged into one stage")


def to_1f1b(d: Decisions) -> list[tuple[str, Decisions]]:
    return _with_schedule(d, "1f1b", "")


#: the schedules most pipeline runtimes name (GPipe, 1F1B, interleaved 1F1B)
CLASSIC_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def to_classic(d: Decisions) -> list[tuple[str, Decisions]]:
    """A zero-bubble, V-shaped or planned schedule -> 1F1B on the same stages (one chunk per
    rank), or interleaved 1F1B on them (several; M a multiple of K), or the chunks merged."""
    if d.virtual_stages == 1:
        return _with_schedule(d, "1f1b", "")
    out = merge_chunks(d)
    if d.pipeline_degree > 1 and d.num_microbatches % d.pipeline_degree == 0:
        out += [("schedule interleaved-1f1b", d.replace(schedule="interleaved-1f1b", actions=None))]
    return out


def _with_schedule(d: Decisions, schedule: Schedule, what: str) -> list[tuple[str, Decisions]]:
    """``d`` with ``schedule``; for 1F1B, M raised to the smallest count >= K that splits the batch."""
    k, m = d.pipeline_degree, d.num_microbatches
    change = [what] if what else []
    if schedule != d.schedule:
        change.append(f"schedule {schedule}")
    if schedule == "1f1b" and m < k:
        per_replica = d.global_batch_size // d.data_parallel
        bigger = [x for x in range(k, per_replica + 1) if per_replica % x == 0]
        if not bigger:
            return []
        m = bigger[0]
        change.append(f"M={m} (1F1B needs M >= K={k})")
    return [("; ".join(change), d.replace(schedule=schedule, num_microbatches=m, actions=None))]


def context_off(d: Decisions) -> list[tuple[str, Decisions]]:
    """Context parallelism off (C = 1, all-gather), the same D, T and K: each sequence on one
    device of its tensor-parallel group.  E must still divide D: where it does not, E becomes
    the largest degree that divides both."""
    e = math.gcd(d.expert_parallel, d.data_parallel)
    also = f" and E={e} (E must divide D={d.data_parallel})" if e != d.expert_parallel else ""
    return [(f"context parallelism off (C=1 instead of {d.context_parallel}){also}",
             d.replace(context_parallel=1, context_attention="all-gather", expert_parallel=e))]


def experts_off(d: Decisions) -> list[tuple[str, Decisions]]:
    """Expert parallelism off (E = 1): every rank holds all of a layer's experts."""
    return [(f"expert parallelism off (E=1 instead of {d.expert_parallel})", d.replace(expert_parallel=1))]


def axis_problems(d: Decisions, target: str) -> list[Problem]:
    """Context (C) and expert (E) parallelism for a target that has neither: each refused with
    the plan without it as the fix."""
    out: list[Problem] = []
    if d.context_parallel > 1:
        out.append(
            Problem(
                f"context parallelism C={d.context_parallel} ({d.context_attention} attention): {target} has no "
                "context parallelism (every device of a stage runs whole sequences)",
                context_off,
                "--context-parallel 1",
            )
        )
    if d.expert_parallel > 1:
        out.append(
            Problem(
                f"expert parallelism E={d.expert_parallel}: {target} has no expert parallelism (every rank of a "
                "stage holds all of its mixture-of-experts layers' experts)",
                experts_off,
                "--expert-parallel 1",
            )
        )
    return out


def uniform_recompute(d: Decisions, applies: Sequence[bool]) -> list[tuple[str, Decisions]]:
    """Recompute on every stage where the target's recompute ``applies``, or on none."""
    on = tuple(bool(a) for a in applies)
    off = tuple(False for _ in applies)
    return [("recompute on every stage", d.with_recompute(on)), ("recompute on no stage", d.with_recompute(off))]


def snap_cuts(d: Decisions, legal: Callable[[int], bool], what: str) -> list[tuple[str, Decisions]]:
    """Move each stage start that ``legal`` refuses to the nearest legal layer (earlier on a tie)."""
    n = d.num_layers
    starts = [a for a, _ in d.stages]
    moved = []
    for i in range(1, len(starts)):
        if legal(starts[i]):
            continue
        lo = next((x for x in range(starts[i] - 1, 0, -1) if legal(x)), None)
        hi = next((x for x in range(starts[i] + 1, n) if legal(x)), None)
        options = [x for x in (lo, hi) if x is not None]
        if not options:
            return []
        best = min(options, key=lambda x: (abs(x - starts[i]), x))
        moved.append(f"stage {i} starts at layer {best} instead of {starts[i]}")
        starts[i] = best
    if any(b <= a for a, b in zip(starts, [*starts[1:], n], strict=True)):
        return []  # a stage would be empty: no plan with this many stages keeps units whole
    stages = tuple(zip(starts, [*starts[1:], n], strict=True))
    return [(f"{what}: " + ", ".join(moved), d.replace(stages=stages))]


def cut_problems(d: Decisions, names: Sequence[str], stack: DecoderStack, why: str) -> list[Problem]:
    """Stage boundaries that cut a unit of ``stack`` (a decoder layer cut into parts) in two."""
    bad = [a for a, _ in d.stages[1:] if not stack.starts_unit(a)]
    if not bad:
        return []
    return [
        Problem(
            f"stage boundary at layer {bad[0]} ({names[bad[0]]!r}) cuts {stack.units[bad[0]]} in two: {why}",
            lambda x: snap_cuts(x, stack.starts_unit, "cuts moved to layer boundaries"),
        )
    ]


def empty_stage_problems(d: Decisions, names: Sequence[str], stack: DecoderStack, target: str) -> list[Problem]:
    """Stages of parameterless layers only (e.g. a Hugging Face ``model.rotary_emb`` alone): the
    target has no module to place on them."""
    empty = [s for s, (a, b) in enumerate(d.stages) if not stack.stage_units(a, b)]
    if not empty:
        return []
    s = empty[0]
    a, b = d.stages[s]
    return [
        Problem(
            f"stage {s} holds only parameterless layers ({', '.join(names[a:b])}): {target} places embeddings, "
            "decoder layers and heads, and has nothing to place on it",
            lambda x: absorb_empty_stage(x, stack),
        )
    ]


def absorb_empty_stage(d: Decisions, stack: DecoderStack) -> list[tuple[str, Decisions]]:
    """The first stage without a unit that places something takes the last unit of the stage
    before it, or the first unit of the stage after it."""
    s = next(i for i, (a, b) in enumerate(d.stages) if not stack.stage_units(a, b))
    a, b = d.stages[s]
    starts = [x for x, _ in d.stages]
    n = d.num_layers
    out: list[tuple[str, Decisions]] = []
    placing = [i for i, u in enumerate(stack.units) if u.kind != "parameterless"]
    before = [i for i in placing if i < a]
    if s > 0 and before:
        start = before[-1]
        while start > 0 and not stack.starts_unit(start):
            start -= 1
        if start > starts[s - 1]:
            moved = [*starts[:s], start, *starts[s + 1 :]]
            stages = tuple(zip(moved, [*moved[1:], n], strict=True))
            out.append((f"stage {s} starts at layer {start} instead of {a}", d.replace(stages=stages)))
    after = [i for i in placing if i >= b]
    if s + 1 < len(d.stages) and after:
        stop = after[0] + 1
        while stop < n and not stack.starts_unit(stop):
            stop += 1
        if stop < d.stages[s + 1][1]:
            moved = [*starts[: s + 1], stop, *starts[s + 2 :]]
            stages = tuple(zip(moved, [*moved[1:], n], strict=True))
            out.append((f"stage {s + 1} starts at layer {stop} instead of {b}", d.replace(stages=stages)))
    return out


def expert_problems(
    names: Sequence[str], stack: DecoderStack, experts: Sequence[ExpertLayer] | None, target: str
) -> list[Problem]:
    """Mixture-of-experts layers that one setting of ``target``'s expert flags cannot describe:
    layers with different experts, top-k, shared experts or capacity, or experts outside the
    decoder layers.  A property of the model, not of the plan: no fix."""
    if not experts:
        return []
    first = experts[0]
    other = next((e for e in experts if _expert_setting(e) != _expert_setting(first)), None)
    if other is not None:
        return [
            Problem(
                f"layer {first.name!r} has {first.describe()} but layer {other.name!r} has {other.describe()}: "
                f"{target} sets one number of experts and one top-k for every mixture-of-experts layer"
            )
        ]
    position = {n: i for i, n in enumerate(names)}
    outside = [e.name for e in experts if e.name not in position or stack.units[position[e.name]].kind != "decoder"]
    if outside:
        return [
            Problem(
                f"layer {outside[0]!r} has experts but is not a decoder layer: {target} places experts only in "
                f"decoder layers ({stack.container}N)"
            )
        ]
    return []


def _expert_setting(e: ExpertLayer) -> tuple[int, int, int, float | None]:
    return (e.experts, e.top_k, e.shared_experts, e.capacity_factor)


def expert_decoders(names: Sequence[str], stack: DecoderStack, experts: Sequence[ExpertLayer]) -> list[bool]:
    """Per decoder layer, whether it has experts (any of its parts, for a layer cut into parts)."""
    out = [False] * stack.num_decoder_layers
    moe = {e.name for e in experts}
    for name, unit in zip(names, stack.units, strict=True):
        if unit.kind == "decoder" and name in moe:
            out[unit.index] = True
    return out


def recompute_problems(d: Decisions, stack: DecoderStack, why: str) -> list[Problem]:
    """Recompute that is on for some stages with decoder layers and off for others (a stage
    without decoder layers does not count, nor does a checkpointed embedding before them: these
    targets recompute decoder layers only)."""
    ckpts = decoder_checkpoints(d, stack)
    applies = [c is not None for c in ckpts]
    on = [s for s, c in enumerate(ckpts) if c is not None and c.touched]
    off = [s for s, c in enumerate(ckpts) if c is not None and not c.touched]
    if not on or not off:
        return []
    return [
        Problem(
            f"stage(s) {_short(on)} recompute but stage(s) {_short(off)} do not: {why}",
            lambda x: uniform_recompute(x, applies),
            "--no-recompute",
        )
    ]


@dataclass(frozen=True)
class DecoderCheckpoints:
    """What a stage with decoder layers checkpoints of them (the first ones): ``whole`` layers
    wholly checkpointed, ``touched`` at least in part (a layer cut into parts by split points),
    of ``layers``."""

    whole: int
    touched: int
    layers: int


def decoder_checkpoints(d: Decisions, stack: DecoderStack) -> list[DecoderCheckpoints | None]:
    """Per stage, its :class:`DecoderCheckpoints`; ``None`` for a stage without decoder layers
    (these targets checkpoint decoder layers only, never the embedding or the head)."""
    out: list[DecoderCheckpoints | None] = []
    for (a, b), n in zip(d.stages, d.checkpointed_layers, strict=True):
        decoders = [u for u in stack.stage_units(a, b) if u.kind == "decoder"]
        if not decoders:
            out.append(None)
            continue
        touched = {u for u in stack.units[a : a + n] if u.kind == "decoder"}
        whole = [u for u in touched if u not in stack.units[a + n : b]]
        out.append(DecoderCheckpoints(len(whole), len(touched), len(decoders)))
    return out


def layers_for_decoders(stack: DecoderStack, start: int, stop: int, decoders: int) -> int:
    """How many of stage ``[start, stop)``'s first layers to checkpoint so that its first
    ``decoders`` decoder layers are (all of them: every layer of the stage; 0: none)."""
    if decoders <= 0:
        return 0
    if decoders >= stack.decoder_layers(start, stop):
        return stop - start
    seen = 0
    for i in range(start, stop):
        unit = stack.units[i]
        if unit.kind == "decoder" and (i + 1 == stop or stack.units[i + 1] != unit):
            seen += 1
            if seen == decoders:
                return i + 1 - start
    return stop - start


def checkpoint_decoders(d: Decisions, stack: DecoderStack, per_stage: Sequence[int]) -> Decisions:
    """``d`` with stage ``s`` checkpointing its first ``per_stage[s]`` decoder layers."""
    counts = [layers_for_decoders(stack, a, b, c) for (a, b), c in zip(d.stages, per_stage, strict=True)]
    return d.with_checkpoints(counts)


def _short(stages: Sequence[int]) -> str:
    return ",".join(map(str, stages[:6])) + (",..." if len(stages) > 6 else "")


#: appended to the output name for a plan's action list
SCHEDULE_CSV_SUFFIX = ".schedule.csv"


def actions_csv(actions: Sequence[Sequence[str]]) -> str:
    """torch's ``compute_only`` schedule CSV: one row per rank, one action per column."""
    return "\n".join(",".join(rank) for rank in actions) + "\n"


# --------------------------------------------------------------------------- the nearest plan


@dataclass(frozen=True)
class Nearest:
    """The nearest plan a target can express: its decisions, the changes, and its price."""

    decisions: Decisions
    changes: tuple[str, ...]
    plan: Plan | None  # priced by the cost model, when a profile was given
    note: str = ""  # why it is not priced, or why it does not fit

    def describe(self, original: Plan) -> str:
        lines = [f"  changes: {'; '.join(c for c in self.changes if c) or 'none'}"]
        if self.plan is None:
            lines.append(f"  not priced: {self.note}")
            return "\n".join(lines)
        p, base = self.plan.predicted.step_time_ms, original.predicted.step_time_ms
        delta = (p / base - 1) * 100 if base > 0 else 0.0
        peak = max(self.plan.stages, key=lambda s: s.memory_bytes / max(s.memory_limit_bytes, 1))
        fits = "fits memory" if plan_fits(self.plan) else "does NOT fit memory"
        lines.append(
            f"  predicted step {p:.2f} ms, {self.plan.predicted.throughput_samples_per_s:.1f} samples/s "
            f"(this plan: {base:.2f} ms, {delta:+.1f}%); {fits} (stage {peak.index}: "
            f"{format_bytes(peak.memory_bytes)} of {format_bytes(peak.memory_limit_bytes)})"
        )
        return "\n".join(lines)


def price(plan: Plan, d: Decisions, profile: Profile) -> Plan:
    """The cost model's plan for decisions ``d`` on ``plan``'s cluster and training setup."""
    same_stages = len(d.stages) == len(plan.stages)
    return estimate(
        profile, plan.cluster, plan.training,
        Layout(
            list(d.stages),
            num_microbatches=d.num_microbatches,
            schedule=d.schedule,
            recompute=list(d.recompute),
            recompute_layers=[n if 0 < n < b - a else None for (a, b), n in zip(d.stages, d.checkpointed_layers, strict=True)],
            data_parallel=d.data_parallel,
            pipeline_degree=d.pipeline_degree,
            devices=[s.devices for s in plan.stages] if same_stages else None,
            tensor_parallel=d.tensor_parallel,
            zero_stage=d.zero_stage if d.data_parallel > 1 else 0,
            sequence_parallel=d.sequence_parallel,
            tensor_parallel_across_nodes=d.tensor_parallel > plan.cluster.devices_per_node,
            selective_recompute=d.selective_recompute,
            context_parallel=d.context_parallel,
            expert_parallel=d.expert_parallel,
            context_attention=d.context_attention,
        ),
    )


def nearest(
    plan: Plan,
    problems: Callable[[Decisions], list[Problem]],
    *,
    profile: Profile | None,
) -> Nearest | None:
    """The nearest plan without problems, priced with ``profile`` when given; ``None`` if no fix
    reaches one.  Fixes are applied breadth-first (each problem's candidates), at most
    :data:`MAX_FIX_ROUNDS` rounds."""
    frontier: list[tuple[Decisions, tuple[str, ...]]] = [(Decisions.from_plan(plan), ())]
    done: list[tuple[Decisions, tuple[str, ...]]] = []
    for _ in range(MAX_FIX_ROUNDS):
        nxt: list[tuple[Decisions, tuple[str, ...]]] = []
        for d, changes in frontier:
            found = problems(d)
            if not found:
                done.append((d, changes))
                continue
            fix = found[0].fix
            for what, nd in fix(d) if fix else []:
                if all(nd != x for x, _ in nxt):
                    nxt.append((nd, (*changes, what)))
        frontier = nxt
        if not frontier:
            break
    if not done:
        return None
    if profile is None:
        d, changes = done[0]
        return Nearest(d, changes, None, "give the model's profile (--profile PROFILE) to price it")
    priced: list[Nearest] = []
    errors: list[str] = []
    for d, changes in done:
        try:
            priced.append(Nearest(d, changes, price(plan, d, profile)))
        except PipeplanError as err:
            errors.append(str(err))
    if not priced:
        d, changes = done[0]
        return Nearest(d, changes, None, f"the cost model refuses it: {errors[0]}")
    return min(priced, key=lambda n: (not plan_fits(n.plan), n.plan.predicted.step_time_ms))  # type: ignore[arg-type,union-attr]


class ExportRefused(InputError):
    """A plan its target cannot express.  ``reasons`` lists why; ``nearest`` is the nearest plan
    the target can express (priced when a profile was given), or ``None`` when none is."""

    def __init__(
        self, target: str, found: Sequence[Problem], nearest_plan: Nearest | None, plan: Plan, *, replan_base: str = ""
    ) -> None:
        reasons = [p.reason for p in found]
        lines = [f"{target} cannot express this plan:"]
        lines += [f"  - {r}" for r in reasons]
        if nearest_plan is None:
            lines.append(f"no plan of this model can be exported to {target}; try --to torch or --to deepspeed")
        else:
            lines.append(f"nearest plan {target} can express: {nearest_plan.decisions.summary()}")
            lines.append(nearest_plan.describe(plan))
            lines.append(f"  export it instead with --nearest (pipeplan export PLAN --to {target} --nearest)")
        flags = " ".join(dict.fromkeys([*(p.replan for p in found if p.replan), *([replan_base] if replan_base else [])]))
        if flags and nearest_plan is not None:
            lines.append(f"or make a new plan within {target}'s rules: pipeplan plan PROFILE ... {flags}")
        super().__init__("\n".join(lines))
        self.target = target
        self.reasons = list(reasons)
        self.nearest = nearest_plan
