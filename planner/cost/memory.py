"""Memory: a rank's static bytes and the activations its schedule's walk holds.

Each rank's peak activation bytes come from walking its action list
(:func:`planner.schedules.memory_points`): a forward adds the stage's activations, an input
gradient frees what the weight gradient does not need, the weight gradient (or a full backward)
frees the rest.  Korthikanti et al. 2022 give the bytes a Transformer layer keeps.

Recompute is activation checkpointing layer by layer, as Megatron-LM
(``--recompute-granularity full``), torchtitan (``activation_checkpoint.mode = "full"``) and
DeepSpeed run it: a checkpointed layer keeps only its input
(:meth:`planner.cost.layers.LayerCosts.checkpoint_bytes`), and its backward re-runs that one
layer, whose activations are live only then (:meth:`~planner.cost.layers.LayerCosts.max_activation`:
the largest layer of the chunk, one at a time).  A chunk may checkpoint only its first layers
(Megatron's ``--recompute-method block``): the others keep their activations.

The optimizer step comes after the last backward, when every activation is freed, and its
temporaries live only while it runs (torch's foreach Adam: one float32 copy of the parameters,
``TrainingSetup.optimizer_step_factor``; fused kernels: none).  A rank's peak is therefore its
static bytes plus the larger of its walk's peak and those temporaries
(:func:`rank_memory_from_terms`).

What the allocator cannot hand to tensors (:func:`usable_bytes`, :func:`outside_allocator`): each
process holds its CUDA context and communication buffers outside the allocator
(``Device.context_bytes``), and the caching allocator reserves more than the tensors it holds
(``Device.fragmentation`` of what it reserves is free but unusable).  A device of ``M`` bytes
therefore holds an allocator peak ``A`` when ``A / (1 - f) + context <= M``; the plan's limit is
the stricter of that and the user's ``memory_margin``.  Defaults and sources:
:mod:`planner.presets` (``CUDA_CONTEXT_BYTES``, ``ALLOCATOR_FRAGMENTATION``); a CPU device has
neither.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from planner.cost.layers import LayerCosts
from planner.schedules import MemoryPoint, peak_bytes
from planner.schema import Device, TrainingSetup


def usable_bytes(device: Device, training: TrainingSetup) -> int:
    """The allocator peak ``device`` may reach: its memory less ``training.memory_margin``, and
    at most ``(memory - context_bytes) x (1 - fragmentation)`` (the reserved memory around that
    peak and the context must fit the device)."""
    margin = int(device.memory_bytes * (1 - training.memory_margin))
    reserved = int((device.memory_bytes - device.context_bytes) * (1 - device.fragmentation))
    return max(0, min(margin, reserved))


def outside_allocator(peak_bytes: float, device: Device) -> tuple[int, int]:
    """What ``device`` holds beside an allocator peak of ``peak_bytes``: (its context bytes, the
    fragmentation: ``peak x f / (1 - f)``, the reserved memory no tensor uses)."""
    f = device.fragmentation
    return device.context_bytes, math.ceil(max(0.0, peak_bytes) * f / (1 - f))


def static_bytes(param_bytes: float, training: TrainingSetup) -> float:
    """Parameters + gradients + optimizer state."""
    return param_bytes * (1.0 + training.gradient_bytes_per_param_byte + training.optimizer_state_factor)


def step_temporary_bytes(param_bytes: float, training: TrainingSetup) -> float:
    """What the optimizer step allocates while it runs, for ``param_bytes`` of parameters (its
    shard): ``param_bytes x training.optimizer_step_factor``, less the bytes it reuses
    (``training.optimizer_step_reuses_bytes``: ZeRO-3's gathered parameters, freed by then)."""
    return max(0.0, param_bytes * training.optimizer_step_factor - training.optimizer_step_reuses_bytes)


@dataclass(frozen=True)
class RankTerms:
    """What a rank's memory reads of its stages (chunks in increasing stage order): its static
    bytes, and per chunk the activations it keeps without recompute, what it keeps when it
    recomputes (its checkpointed layers' inputs and the other layers' activations), the bytes
    live during a recomputing chunk's backward (its largest checkpointed layer) and the bytes
    held for the weight gradient; and the optimizer step's temporaries (``step``), held when no
    activation is."""

    static: float
    acts: tuple[float, ...]
    checkpoints: tuple[float, ...]
    lives: tuple[float, ...]
    weight_grads: tuple[float, ...]
    step: float = 0.0


def rank_memory_terms(
    costs: LayerCosts,
    ranges: Sequence[tuple[int, int]],
    training: TrainingSetup,
    *,
    checkpointed: Sequence[int | None] | None = None,
) -> RankTerms:
    """:class:`RankTerms` of a rank holding the stages ``ranges`` (for searches that try many
    recompute choices).  ``checkpointed[j]``: how many of chunk j's first layers a recompute
    checkpoints (default, or None: all of them)."""
    params = sum(costs.prefix_param[b] - costs.prefix_param[a] for a, b in ranges)
    counts = [None] * len(ranges) if checkpointed is None else list(checkpointed)
    return RankTerms(
        static_bytes(params, training),
        tuple(costs.stage_activation_bytes(a, b) for a, b in ranges),
        tuple(costs.checkpoint_bytes(a, b, n) for (a, b), n in zip(ranges, counts, strict=True)),
        tuple(costs.rematerialised_bytes(a, b, n) for (a, b), n in zip(ranges, counts, strict=True)),
        tuple(costs.prefix_weight_grad[b] - costs.prefix_weight_grad[a] for a, b in ranges),
        step_temporary_bytes(params, training),
    )


def held_bytes(terms: RankTerms, recompute: Sequence[bool]) -> tuple[list[float], list[float], list[float]]:
    """Per chunk: bytes a forward holds (its activations, or its checkpoints when it
    recomputes), bytes its input gradient leaves for the weight gradient, and bytes live during
    its backward (the one re-materialised layer of a recomputing chunk)."""
    rc = list(recompute)
    hf = [ck if r else act for act, ck, r in zip(terms.acts, terms.checkpoints, rc, strict=True)]
    live = [lv if r else 0.0 for lv, r in zip(terms.lives, rc, strict=True)]
    return hf, list(terms.weight_grads), live


def rank_memory_from_terms(terms: RankTerms, recompute: Sequence[bool], points: Iterable[MemoryPoint]) -> float:
    """Peak bytes of a rank: its static bytes plus the peak of its walk
    (:func:`planner.schedules.peak_bytes` of its memory points) or, when larger, the optimizer
    step's temporaries."""
    hf, hw, live = held_bytes(terms, recompute)
    return terms.static + max(peak_bytes(points, hf, hw, live), terms.step)


def rank_memory_bytes(
    costs: LayerCosts,
    ranges: Sequence[tuple[int, int]],
    recompute: Sequence[bool],
    training: TrainingSetup,
    *,
    points: Iterable[MemoryPoint],
) -> float:
    """Peak bytes of one rank holding the stages ``ranges`` (its chunks, in stage order),
    from its action list's memory ``points`` (:func:`planner.schedules.memory_points`)."""
    return rank_memory_from_terms(rank_memory_terms(costs, ranges, training), recompute, points)


def memory_lower_bound(terms: RankTerms, recompute: Sequence[bool], counts: Sequence[int]) -> float:
    """A lower bound of the rank's peak from the closed-form ``counts`` of
    :func:`planner.schedules.first_backward_counts` (a moment of its walk, when it starts its
    first backward): static + counts x held bytes, plus the live bytes of the chunk that
    backward runs on (a recomputing one-chunk rank), or the optimizer step's temporaries when
    larger - what the solver's bounds use."""
    hf, _, live = held_bytes(terms, recompute)
    held = sum(c * h for c, h in zip(counts, hf, strict=True))
    if len(counts) == 1:
        held += live[0]
    return terms.static + max(held, terms.step)
