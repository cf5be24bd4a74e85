"""Megatron's selective recompute at run time (Korthikanti et al. 2022, section 4.2): each block
runs its attention core -- the score product, its scale and mask, the softmax, the dropout on
the probabilities and the context product -- under its own checkpoint, so the block keeps
every activation but attention's scores and re-runs the core in its backward.  Megatron-LM
checkpoints its ``core_attention`` the same way (``--recompute-granularity selective``).

What a score is, is the profiler's definition (:class:`profiler.selective.ScoreChain`): the
profile's ``selective_recompute_bytes`` are the bytes of the score tensors a unit saves, and
the plan prices a selective block as keeping ``activation_bytes - selective_recompute_bytes``
and re-running the core (``selective_recompute_ms``).

**How.**  A unit is a ``torch.fx.GraphModule`` (the profiler's splitter made it).  One forward
on the stage's example inputs, node by node under a dispatch mode, finds the nodes that make
scores (:func:`score_nodes`); each connected group of them, with the nodes that read a score
without making one (the context product), becomes a region (:func:`attention_regions`).  The
unit's graph is rewritten with each region moved into a submodule called under
``torch.utils.checkpoint`` (non-reentrant, :class:`CheckpointedRegion`): the region keeps only
its inputs (the queries, keys and values, the mask), its output (the context) is saved by the
next projection as before, and nothing outside it is re-run.  The checkpoint stashes the random
state on entry to the region and restores it for the re-run, so the dropout on the
probabilities draws the same mask; random calls outside the region are not re-run at all.

A unit without scores (fused attention, an MLP, an embedding) is left as it is: the planner
gives it no ``selective_recompute_bytes`` either.  The rewritten unit shares the original's
parameters and submodules (their qualified names do not change); the original is untouched.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from profiler import _torch_private
from profiler.selective import ScoreChain, score_key, sequence_lengths


class CheckpointedRegion(nn.Module):
    """Runs ``inner`` (a region of a unit's graph) under ``torch.utils.checkpoint``: it keeps
    its inputs and re-runs in the backward, with the random state it started with."""

    def __init__(self, inner: fx.GraphModule) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True)


def score_nodes(unit: fx.GraphModule, inputs: Sequence[Any]) -> set[fx.Node]:
    """The nodes of ``unit``'s graph that make attention scores, found by one forward on fresh
    copies of ``inputs`` (with autograd, as in training; the random state is left as it was)."""
    chain = ScoreChain(sequence_lengths(inputs), record=False)
    made: set[fx.Node] = set()

    class Run(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            leaves, _ = _torch_private.tree_flatten(out)
            if any(isinstance(t, torch.Tensor) and score_key(t) in chain.scores for t in leaves):
                made.add(n)
            return out

    class Watch(_torch_private.dispatch_mode()):  # type: ignore[misc]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            chain.see(func, args, kwargs, out)
            return out

    fresh = [t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in inputs]
    devices = sorted({t.device.index or 0 for t in fresh if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), Watch():
        Run(unit).run(*fresh)
    return made


def attention_regions(graph: fx.Graph, scores: set[fx.Node]) -> list[list[fx.Node]]:
    """The regions to checkpoint, each in graph order: a connected group of score nodes with the
    nodes that read one of them without making a score (the context product; not the output)."""
    members = set(scores)
    for n in scores:
        members.update(u for u in n.users if u.op != "output")
    order = {n: i for i, n in enumerate(graph.nodes)}
    parent = {n: n for n in members}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        for u in n.users:
            if u in members:
                parent[find(u)] = find(n)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in members:
        groups.setdefault(find(n), []).append(n)
    return sorted((sorted(g, key=order.__getitem__) for g in groups.values()), key=lambda g: order[g[0]])


def _extract(root: fx.GraphModule, graph: fx.Graph, region: list[fx.Node], name: str) -> None:
    """Move ``region`` (nodes of ``graph``, in order) into a :class:`CheckpointedRegion`
    submodule ``name`` of ``root``, called where the region's last node was."""
    inside = set(region)
    inputs: list[fx.Node] = []
    for n in region:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = region[-1]
    early = [u for n in outputs for u in n.users if u not in inside and order[u] < order[last]]
    if early:
        raise ValueError(
            f"attention's scores are read outside their region before it ends ({early[0].name}): "
            "selective recompute cannot checkpoint this unit's attention on its own"
        )
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(f"in_{i}") for i, a in enumerate(inputs)}
    for n in region:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[n] for n in outputs))
    root.add_submodule(name, CheckpointedRegion(fx.GraphModule(root, sub, class_name="AttentionCore")))
    with graph.inserting_after(last):
        call = graph.call_module(name, tuple(inputs))
    with graph.inserting_after(call):
        for i, n in enumerate(outputs):
            item = graph.call_function(operator.getitem, (call, i))
            n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region):
        graph.erase_node(n)


def recompute_attention(unit: fx.GraphModule, inputs: Sequence[Any]) -> fx.GraphModule | None:
    """A copy of ``unit`` whose attention cores run under their own checkpoints (the module
    doc), or None when it makes no scores.  ``inputs``: the unit's inputs (a micro-batch)."""
    scores = score_nodes(unit, inputs)
    if not scores:
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(unit.graph, env)
    graph.output(out)
    new = fx.GraphModule(unit, graph, class_name=type(unit).__name__)
    # share the original's modules, not only its parameters: GraphModule copies the attributes
    # the graph reads into fresh containers, and tensor parallelism and FSDP2 replace parameters
    # in their modules, which the runtime then reads through the original (by the model's names)
    for name, child in unit.named_children():
        new._modules[name] = child
    for name, p in unit.named_parameters(recurse=False):
        new._parameters[name] = p
    for name, b in unit.named_buffers(recurse=False):
        new._buffers[name] = b
    for k, region in enumerate(attention_regions(graph, {env[n] for n in scores})):
        _extract(new, graph, region, f"selective_{k}")
    graph.lint()
    new.recompile()
    return new


def recompute_selectively(stage_module: nn.Module, inputs: Iterable[Sequence[Any]], *, skip: int = 0) -> list[int]:
    """Megatron's selective recompute on every unit of ``stage_module`` (a profiler
    ``StageModule``) that makes attention scores, in place; ``inputs``: each unit's example
    inputs, in order; ``skip``: the first units, checkpointed whole (nothing to drop there).
    Returns the indices of the units rewritten."""
    units: Any = getattr(stage_module, "units", None)
    if units is None:
        raise TypeError(f"{type(stage_module).__name__} has no units: give a profiler StageModule")
    done = []
    for i, args in enumerate(inputs):
        if i >= len(units):
            break
        if i < skip:
            continue
        unit = units[i]
        if isinstance(unit, fx.GraphModule):
            new = recompute_attention(unit, args)
            if new is not None:
                units[i] = new
                done.append(i)
    return done
