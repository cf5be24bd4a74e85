"""Split any ``nn.Module`` into a chain of executable units at legal cut points.

The profiler measures these units and the runtime executes them, so a profile layer *is*
a unit and both sides rebuild the exact same split from the same code.

How it works:

1. **Granularity.**  The default layers are the model's blocks: the children of every
   ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` container, and every other child
   of the root (the embedding, the head) as a layer of its own.  A child that holds
   containers deeper down is opened up, and so is a container inside a container (a
   ``Sequential`` of stages, each a ``Sequential`` of blocks, gives the blocks).  ``split_points`` (module names) override it: the
   model is cut right *before* each named module and nowhere else (a name inside a block
   opens that block up).
2. **Capture.**  ``torch.fx`` traces the model with those modules as leaves.  Forward
   parameters beyond the example inputs (keyword arguments) are fixed to their defaults,
   and Python control flow on traced values (``assert t <= block_size``) is specialized to
   the branch the example inputs take, as ``torch.export`` does.
3. **Placement.**  Every leaf call is an *anchor* that starts a new segment; glue code
   between leaves (residual adds, flatten, ...) runs as early as its inputs allow, and code
   that only reads parameters or constants runs where it is first needed.
4. **Legal cuts.**  The dataflow graph (``networkx``) gives, for each candidate cut, the
   values crossing it: produced before it and consumed after it, skip connections that
   span several layers included.  A cut is legal only if every crossing value is a tensor
   (a Python int such as ``x.size(1)`` cannot be sent between stages); segments on both
   sides of an illegal cut are merged into one unit.
5. **Units.**  Unit ``i`` is an ``fx.GraphModule`` sharing the model's real submodules and
   parameters.  It takes the tensors crossing cut ``i-1`` (unit 0 takes the model inputs)
   and returns the tensors crossing cut ``i`` as a tuple; the last unit returns the model
   output.  Running the units in order computes ``model(*inputs)`` exactly.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import Tensor, nn

from planner.errors import InputError
from planner.schema import structure_sha256

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


# --------------------------------------------------------------------------- granularity


def _has_container(module: nn.Module) -> bool:
    return any(isinstance(m, CONTAINERS) for m in module.modules())


def default_leaves(model: nn.Module) -> list[str]:
    """Qualified names of the default layers (see the module docstring), in definition order."""
    leaves: list[str] = []

    def visit(mod: nn.Module, prefix: str, in_container: bool) -> None:
        for name, child in mod.named_children():
            q = prefix + name
            if isinstance(child, CONTAINERS):
                visit(child, q + ".", True)
            elif in_container or not _has_container(child):
                leaves.append(q)
            else:
                visit(child, q + ".", False)

    visit(model, "", isinstance(model, CONTAINERS))
    return leaves


def _leaves_for_split_points(model: nn.Module, split_points: Sequence[str]) -> list[str]:
    leaves = default_leaves(model)
    names = {n for n, _ in model.named_modules() if n}
    for point in split_points:
        if point not in names:
            close = sorted(n for n in names if point.split(".")[-1] in n.split("."))[:8] or leaves[:8]
            raise InputError(
                f"split point {point!r} is not a module of {type(model).__name__}: give module names "
                f"as in model.named_modules(), e.g. {', '.join(close)}"
            )
        # open up the leaf that contains the point, down to the point itself
        while True:
            owner = next((leaf for leaf in leaves if point.startswith(leaf + ".")), None)
            if owner is None:
                break
            i = leaves.index(owner)
            children = [f"{owner}.{n}" for n, _ in model.get_submodule(owner).named_children()]
            leaves[i : i + 1] = children
        if point not in leaves and not any(leaf.startswith(point + ".") for leaf in leaves):
            # a module the default granularity traced through: make it a leaf
            leaves.append(point)
    return leaves


class _LeafTracer(fx.Tracer):
    """fx tracer with the chosen leaves that, given example inputs, specializes Python
    control flow on traced values (``assert t <= block_size``, ``if x.dim() == 4``) to
    the branch the example inputs take, as ``torch.export`` does."""

    def __init__(self, leaves: Sequence[str], example_inputs: Sequence[Tensor] = ()) -> None:
        super().__init__()
        self.leaves = frozenset(leaves)
        self.prefixes = frozenset(leaf.rsplit(".", i)[0] for leaf in leaves for i in range(1, leaf.count(".") + 1))
        self.example_inputs = tuple(example_inputs)

    def to_bool(self, obj: fx.Proxy) -> bool:
        if not self.example_inputs:
            return bool(super().to_bool(obj))
        if not _shape_only(obj.node):
            raise fx.proxy.TraceError(
                f"Python control flow depends on tensor values (at {obj.node.format_node()}); only "
                "shapes may steer it"
            )
        return bool(self._evaluate(obj.node))

    def _evaluate(self, node: fx.Node) -> Any:
        """The value of ``node`` on the example inputs, from the graph traced so far."""
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.graph.nodes:
            env[n] = g.node_copy(n, lambda x: env[x])
            if n is node:
                break
        g.output(env[node])
        root = self.root
        # run for real: lift fx's patches of Module.__call__ while evaluating
        import torch.fx._symbolic_trace as symbolic_trace

        unpatched: Any = getattr(symbolic_trace, "_maybe_revert_all_patches", nullcontext)
        with unpatched(), _frozen_state(root):
            return fx.GraphModule(root, g)(*self.example_inputs)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves:
            return True
        if module_qualified_name in self.prefixes:
            return False
        return bool(super().is_leaf_module(m, module_qualified_name))


# --------------------------------------------------------------------------- the split


@dataclass
class SplitModel:
    """A model cut into executable units (see the module docstring)."""

    model: nn.Module
    names: list[str]
    units: list[nn.Module]
    #: names of the fx values crossing each cut (``len(units) - 1`` entries)
    cut_values: list[list[str]]
    #: for each crossing value, whether the unit right before the cut produced it
    #: (False: a skip connection from further back, or a model input passed along)
    cut_produced_by_previous: list[list[bool]]
    #: leaf calls (anchors) each unit holds
    anchors: list[list[str]]
    #: the traced whole-model graph and the dataflow graph over its nodes
    graph: fx.Graph
    dataflow: nx.DiGraph = field(repr=False)
    num_inputs: int = 1
    #: class name of each unit's first leaf module (informational)
    kinds: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.units)

    def param_bytes(self) -> list[int]:
        """Parameter bytes per unit; a tensor used by several units counts on the first."""
        seen: set[int] = set()
        out = []
        for unit in self.units:
            total = 0
            for p in unit.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
            out.append(total)
        return out

    def sha256(self) -> str:
        """The model fingerprint; equals ``Profile.sha256()`` of a profile of this model."""
        return structure_sha256(self.names, self.param_bytes())

    def shared_parameters(self) -> list[list[tuple[int, str]]]:
        """Groups of ``(unit index, parameter name)`` that are one tensor used by several units.

        Example: a GPT's tied embedding and LM head give
        ``[[(0, "embed.tok.weight"), (5, "head.proj.weight")]]``.  A pipeline runtime must
        sum their gradients across the ranks holding them.
        """
        groups: dict[int, list[tuple[int, str]]] = {}
        for i, unit in enumerate(self.units):
            for name, p in unit.named_parameters():
                groups.setdefault(id(p), []).append((i, name))
        return [g for g in groups.values() if len({i for i, _ in g}) > 1]

    def stage_module(self, start: int, stop: int) -> nn.Module:
        """A module running ``units[start:stop]`` in a chain.

        ``forward(*tensors)`` takes what unit ``start`` takes and returns the tuple of tensors
        crossing cut ``stop - 1``, or the model output when ``stop == len(units)``.
        """
        if not 0 <= start < stop <= len(self.units):
            raise InputError(
                f"stage [{start}, {stop}) is out of range for a model of {len(self.units)} layers: "
                f"need 0 <= start < stop <= {len(self.units)}"
            )
        return StageModule(self.units[start:stop], self.names[start:stop])

    def run(self, *inputs: Tensor) -> Any:
        """Run every unit in order: equals ``model(*inputs)``."""
        return self.stage_module(0, len(self.units))(*inputs)


class StageModule(nn.Module):
    """Consecutive units chained; shares their parameters."""

    def __init__(self, units: Sequence[nn.Module], names: Sequence[str]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)
        self.layer_names = list(names)

    def forward(self, *args: Any) -> Any:
        x: Any = args
        last = len(self.units) - 1
        for i, unit in enumerate(self.units):
            x = unit(*x)
            if i < last and not isinstance(x, tuple):
                raise RuntimeError(f"unit {self.layer_names[i]!r} returned {type(x).__name__}, expected a tuple")
        return x


def trace(
    model: nn.Module, num_inputs: int, leaves: Sequence[str], *, example_inputs: Sequence[Tensor] = ()
) -> fx.Graph:
    """fx-trace ``model`` with ``leaves`` as leaf modules; extra forward parameters fixed.

    With ``example_inputs``, control flow on traced values follows the examples' branch.
    """
    import inspect

    tracer = _LeafTracer(leaves, example_inputs)
    concrete: dict[str, Any] = {}
    params = list(inspect.signature(model.forward).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        raise InputError(
            f"{type(model).__name__}.forward takes *args: give it named parameters so the model can be traced"
        )
    if num_inputs > len(positional):
        raise InputError(
            f"{num_inputs} example inputs but {type(model).__name__}.forward takes {len(positional)} "
            "positional parameters: give one tensor per positional parameter"
        )
    for p in params[num_inputs:]:
        if p.kind in (p.VAR_KEYWORD,):
            continue
        if p.default is inspect.Parameter.empty:
            raise InputError(
                f"{type(model).__name__}.forward parameter {p.name!r} has no default and no example "
                "input: add a tensor for it to example_inputs, or give it a default"
            )
        concrete[p.name] = p.default
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as err:
        raise InputError(
            f"cannot trace {type(model).__name__} with torch.fx: {type(err).__name__}: {err}. "
            "Python control flow on tensor values must sit inside a layer: pass --split-points "
            "naming coarser modules, or move that code into a submodule"
        ) from err
    # The placeholders of fixed parameters: substitute the constants.
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders[num_inputs:], concrete.values(), strict=False):
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda n, node=node, value=value: value if n is node else n)  # type: ignore[misc]
            user.kwargs = fx.node.map_arg(user.kwargs, lambda n, node=node, value=value: value if n is node else n)  # type: ignore[misc]
        graph.erase_node(node)
    # drop the now-constant `x == default` checks fx inserted for them
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.all_input_nodes and not node.users:
            if node.target in (torch._assert, operator.eq, operator.is_) or getattr(node.target, "__name__", "") in (
                "_assert_is_none",
            ):
                graph.erase_node(node)
        elif node.op == "call_function" and node.target in (operator.eq, operator.is_) and not node.all_input_nodes:
            if all(u.op == "call_function" and u.target is torch._assert for u in node.users):
                for u in list(node.users):
                    graph.erase_node(u)
                graph.erase_node(node)
    return graph


_SHAPE_METHODS = frozenset({"size", "dim", "numel", "ndimension", "nelement"})


def _shape_only(node: fx.Node) -> bool:
    """Whether ``node`` is computed from tensor shapes and constants only (not tensor values)."""
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return True
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return node.args[1] in ("shape", "ndim")
    if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator", "builtins"):
        return all(_shape_only(n) for n in node.all_input_nodes)
    return False


@contextmanager
def _frozen_state(model: nn.Module) -> Iterator[None]:
    """Eval mode, no grad, a forked RNG; ``.training`` flags and state restored on exit."""
    flags = {m: m.training for m in model.modules()}
    state = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    devices = sorted({t.device.index or 0 for t in state.values() if t.device.type == "cuda"})
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, f in flags.items():
            m.training = f
        with torch.no_grad():
            current = model.state_dict(keep_vars=True)
            for k, v in state.items():
                if not torch.equal(current[k], v):
                    current[k].copy_(v)


def _example_values(model: nn.Module, graph: fx.Graph, inputs: Sequence[Tensor]) -> dict[str, Any]:
    """Run the graph once (no grad, eval mode) on the inputs; the model's state is restored."""
    gm = fx.GraphModule(model, graph)
    values: dict[str, Any] = {}

    class _Rec(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    try:
        with _frozen_state(model):
            _Rec(gm).run(*inputs)
    except Exception as err:
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in inputs)
        raise InputError(
            f"running {type(model).__name__} on its example inputs ({shapes}) failed: "
            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''} -- check "
            "that example_inputs match the model's forward"
        ) from err
    return values


def split_model(
    model: nn.Module,
    example_inputs: Sequence[Tensor] | Tensor,
    *,
    split_points: Sequence[str] | None = None,
) -> SplitModel:
    """Cut ``model`` into executable units (see the module docstring).

    ``example_inputs``: the model's positional inputs (a tensor or a sequence of tensors);
    they are run once (without gradients) to tell tensors from other values.  ``split_points``:
    module names to cut right before (default: every block).
    """
    from profiler.loading import check_example_inputs

    inputs = check_example_inputs(example_inputs)
    split_points = list(split_points or [])
    leaves = _leaves_for_split_points(model, split_points) if split_points else default_leaves(model)
    graph = trace(model, len(inputs), leaves, example_inputs=inputs)
    values = _example_values(model, graph, inputs)
    nodes = list(graph.nodes)
    leaf_set = set(leaves)
    anchors = [n for n in nodes if n.op == "call_module" and n.target in leaf_set]
    num_segments = max(1, len(anchors))
    output = next(n for n in nodes if n.op == "output")

    # --- place every node in a segment
    seg: dict[fx.Node, int] = {}
    anchor_index = {n: i for i, n in enumerate(anchors)}
    deferred: list[fx.Node] = []
    for n in nodes:
        if n.op == "placeholder":
            seg[n] = 0
        elif n.op == "get_attr":
            continue  # copied into every unit that reads it
        elif n in anchor_index:
            seg[n] = anchor_index[n]
        elif n.op == "output":
            seg[n] = num_segments - 1
        else:
            placed = [seg[i] for i in n.all_input_nodes if i in seg]
            if placed:
                seg[n] = max(placed)
            else:
                deferred.append(n)
    for n in reversed(deferred):  # constant-only code: where it is first needed
        users = [seg[u] for u in n.users if u in seg]
        seg[n] = min(users) if users else 0

    # --- the dataflow graph and the values crossing each cut
    dataflow = nx.DiGraph()
    for n in nodes:
        if n in seg:
            dataflow.add_node(n.name, segment=seg[n], op=n.op)
    for n in nodes:
        if n not in seg:
            continue
        for i in n.all_input_nodes:
            if i in seg:
                dataflow.add_edge(i.name, n.name)
                if seg[i] > seg[n]:
                    raise AssertionError(f"value {i.name} flows backwards from segment {seg[i]} to {seg[n]}")
    order = {n.name: k for k, n in enumerate(nodes)}

    def crossing(cut: int) -> list[str]:
        names = {u for u, v in dataflow.edges if dataflow.nodes[u]["segment"] <= cut < dataflow.nodes[v]["segment"]}
        return sorted(names, key=order.__getitem__)

    def illegal(cut: int) -> list[str]:
        return [v for v in crossing(cut) if not isinstance(values.get(v), Tensor)]

    # --- choose the cuts
    if split_points:
        starts = set()
        for point in split_points:
            first = next(
                (i for i, a in enumerate(anchors) if a.target == point or str(a.target).startswith(point + ".")),
                None,
            )
            if first is None:
                raise InputError(f"split point {point!r} is never called by the model's forward: name a module it runs")
            if first > 0:
                bad = illegal(first - 1)
                if bad:
                    raise InputError(
                        f"cannot cut before {point!r}: non-tensor values {bad} cross that point; pick "
                        "another split point (or compute those values inside a layer)"
                    )
                starts.add(first)
        boundaries = sorted(starts)
    else:
        boundaries = [c + 1 for c in range(num_segments - 1) if not illegal(c)]
    groups = list(zip([0, *boundaries], [*boundaries, num_segments], strict=True))

    # --- names
    counts: dict[str, int] = {}
    anchor_names = []
    for a in anchors:
        k = counts.get(str(a.target), 0)
        counts[str(a.target)] = k + 1
        anchor_names.append(str(a.target) if k == 0 else f"{a.target}#{k}")
    unit_names = [anchor_names[lo] if anchors else "model" for lo, _ in groups]
    kinds = [type(model.get_submodule(str(anchors[lo].target))).__name__ if anchors else type(model).__name__ for lo, _ in groups]

    # --- build the units
    by_name = {n.name: n for n in nodes}
    units: list[nn.Module] = []
    cut_values: list[list[str]] = []
    produced: list[list[bool]] = []
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for u, (lo, hi) in enumerate(groups):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}

        def lookup(n: fx.Node, g: fx.Graph = g, env: dict[fx.Node, fx.Node] = env) -> fx.Node:
            if n not in env:
                if n.op != "get_attr":
                    raise AssertionError(f"value {n.name} is not available in this unit")
                env[n] = g.node_copy(n)
            return env[n]

        if u == 0:
            for p in placeholders:
                env[p] = g.node_copy(p)
        else:
            for name in cut_values[u - 1]:
                env[by_name[name]] = g.placeholder(name)
        for n in nodes:
            if n.op in ("placeholder", "output", "get_attr") or not lo <= seg[n] < hi:
                continue
            env[n] = g.node_copy(n, lookup)
        if u == len(groups) - 1:
            g.output(fx.node.map_arg(output.args[0], lookup))
        else:
            cut = crossing(hi - 1)
            cut_values.append(cut)
            produced.append([by_name[v].op != "placeholder" and lo <= seg[by_name[v]] < hi for v in cut])
            g.output(tuple(env[by_name[v]] for v in cut))
        g.lint()
        units.append(fx.GraphModule(model, g, class_name=f"Unit{u}"))
    return SplitModel(
        model=model,
        names=unit_names,
        units=units,
        cut_values=cut_values,
        cut_produced_by_previous=produced,
        anchors=[anchor_names[lo:hi] for lo, hi in groups] if anchors else [[]],
        graph=graph,
        dataflow=dataflow,
        num_inputs=len(inputs),
        kinds=kinds,
    )


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (tuples, lists and dicts walked), by storage once."""
    seen: set[tuple[int, Any]] = set()
    total = 0

    def walk(v: Any) -> None:
        nonlocal total
        if isinstance(v, Tensor):
            key = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else (id(v), 0)
            if key not in seen:
                seen.add(key)
                total += v.numel() * v.element_size()
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(value)
    return total


def split_for_profile(model: nn.Module, example_inputs: Sequence[Tensor] | Tensor, profile: Any) -> SplitModel:
    """Rebuild the split a profile was made with (its recorded split points) and check it.

    Raises :class:`planner.errors.PlanMismatchError` when the model's layer names or
    parameter bytes differ from the profile's (another model, size or dtype).
    """
    from planner.errors import PlanMismatchError

    points = (profile.metadata or {}).get("profiler", {}).get("split_points") or None
    split = split_model(model, example_inputs, split_points=points)
    if split.sha256() != profile.sha256():
        names, want = split.names, profile.layer_names()
        if names != want:
            detail = f"its layers are {names[:6]}{'...' if len(names) > 6 else ''}, the profile's {want[:6]}"
        else:
            got_b, want_b = split.param_bytes(), [layer.param_bytes for layer in profile.layers]
            i = next(k for k in range(len(names)) if got_b[k] != want_b[k])
            detail = f"layer {names[i]!r} holds {got_b[i]} parameter bytes, the profile says {want_b[i]} (another size or dtype?)"
        raise PlanMismatchError(
            f"the model does not match profile {profile.model!r}: {detail}; profile this model "
            "again with `pipeplan profile`"
        )
    return split
