"""The plan's context-parallel (C) and expert-parallel (E) axes on one rank: the single place
the worker calls them from (needs torch).

:func:`refuse_new_axes` refuses, before training, what the runtime does not execute, naming the
axis and the layer with the fix (:func:`runtime.experts.expert_problems`,
:func:`runtime.context_parallel.context_problems`); :func:`new_axes` builds what it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.errors import InputError


def axis_problems(split: Any, plan: Any) -> list[str]:
    """Every reason the runtime cannot execute the plan's C or E on ``split``'s units."""
    from runtime.context_parallel import context_problems
    from runtime.experts import expert_problems

    units, names = list(split.units), list(split.names)
    return context_problems(units, names, plan) + expert_problems(units, names, plan)


def local_examples(example_inputs: Any, plan: Any, replica: int) -> tuple[Any, ...]:
    """The example inputs this rank's units are split on and its stages shaped by: under C > 1,
    its tokens of every sequence (the graphs specialise the sequence length), else as given."""
    c = plan.context_parallel_degree
    if c <= 1:
        return tuple(example_inputs)
    from runtime.context_parallel import check_sequence, local_sequence, sequence_length

    seq = sequence_length(example_inputs)
    check_sequence(seq, c)
    return tuple(local_sequence(t, seq, replica % c, c) for t in example_inputs)


def refuse_new_axes(split: Any, plan: Any) -> None:
    """Raise :class:`InputError` listing :func:`axis_problems`, when there are any."""
    problems = axis_problems(split, plan)
    if problems:
        raise InputError("the runtime cannot execute this plan's mesh:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class NewAxes:
    """C and E on this rank (each None when its degree is 1)."""

    experts: Any = None  # runtime.experts.ExpertParallel
    context: Any = None  # runtime.context_parallel.ContextParallel

    def apply(self, stage_module: Any) -> None:
        """Rewrite the stage's units (before tensor parallelism, recompute and FSDP2)."""
        if self.experts is not None:
            self.experts.apply(stage_module)
        if self.context is not None:
            self.context.apply(stage_module)

    def local(self, t: Any) -> Any:
        """This rank's part of a batch tensor: its tokens of every sequence under C > 1."""
        return self.context.local(t) if self.context is not None and t is not None else t

    def data_shard(self, replica: int, replicas: int) -> tuple[int, int]:
        """``(shard, shards)`` of the global batch a rank of the mesh's data axis reads: the
        context-parallel ranks of one data-parallel replica read the same samples."""
        c = self.context.degree if self.context is not None else 1
        return replica // c, replicas // c

    def owns(self, p: Any) -> bool:
        """True for a parameter whose gradient these axes reduce instead of the data-parallel all-reduce."""
        return self.experts is not None and self.experts.owns(p)

    def reduce_gradients(self) -> None:
        """After the data-parallel all-reduce: expert gradients over the replicas holding the
        same experts.  (Context parallelism needs nothing more: its ranks sit on the mesh's data
        axis, whose all-reduce averages every gradient over D x C.)"""
        if self.experts is not None:
            self.experts.reduce_gradients()

    def report(self) -> dict[str, Any]:
        """What this rank's stages did, for the report (:func:`axes_note`)."""
        return {
            "expert_sites": list(self.experts.sites) if self.experts is not None else [],
            "context_layers": list(self.context.layers) if self.context is not None else [],
        }


def axes_note(plan: Any, meshes: list[dict[str, Any]]) -> list[str]:
    """The report's mesh note on C and E, from :meth:`NewAxes.report` of one replica's ranks."""
    parts = []
    e = plan.expert_parallel_degree
    if e > 1:
        sites = [tuple(s) for m in meshes for s in m.get("expert_sites", [])]
        shares = ", ".join(sorted({f"{local} of {total}" for local, total in sites}))
        replicas = plan.data_parallel_degree // e
        parts.append(
            f"expert parallelism E={e}: {len(sites)} layers, {shares} experts per rank (all-to-all dispatch and "
            f"combine; expert gradients summed over the {replicas} replica(s) holding the same experts)"
        )
    c = plan.context_parallel_degree
    if c > 1:
        layers = [n for m in meshes for n in m.get("context_layers", [])]
        parts.append(
            f"context parallelism C={c}: each rank holds 1/{c} of every sequence; {len(layers)} attention(s) "
            f"all-gather K and V ({plan.context_attention} planned)"
        )
    return parts


def new_axes(
    plan: Any, *, replica: int, example_inputs: Any, device_type: str, step_box: list[int], fault: Any = None
) -> NewAxes:
    """The plan's C and E for this rank (``replica``: its index on the mesh's data axis, which
    folds C in); ``fault``: this rank's ``--inject-fault`` (wrong-expert, no-kv-gather) or None.
    Every rank must call it (the meshes are collectives)."""
    axes = NewAxes()
    if plan.expert_parallel_degree > 1:
        from runtime.experts import ExpertParallel

        wrong = (step_box, fault.step) if fault is not None and fault.mode == "wrong-expert" else None
        axes.experts = ExpertParallel(plan, device_type=device_type, fault_from=wrong)
    if plan.context_parallel_degree > 1:
        from runtime.context_parallel import ContextParallel, sequence_length

        drop = (step_box, fault.step) if fault is not None and fault.mode == "no-kv-gather" else None
        axes.context = ContextParallel(plan, replica=replica, seq=sequence_length(example_inputs),
                                       device_type=device_type, fault_from=drop)  # fmt: skip
    return axes
