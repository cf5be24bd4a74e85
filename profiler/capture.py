"""Capture a model's forward as one graph whose nodes know which layer (leaf module) they run in.

Two capturers, tried in this order:

1. **torch.export** (non-strict, the batch dimension of every input dynamic).  It traces
   through Python the way the model really runs: keyword arguments, ``**kwargs`` forwards,
   ``ModelOutput`` returns, dtype and device tests, rotary embeddings, Hugging Face masks.
   Each ATen node records the module call stack it came from (``nn_module_stack``), which
   assigns it to a layer.  Parameters and buffers become reads of the model's own tensors.
2. **torch.fx** with the layers as leaf modules, for models export cannot take (Python
   control flow on shapes is specialized to the example inputs' branch; control flow on
   tensor values is refused).  A layer is one ``call_module`` node.

Both give a :class:`Capture`: an ``fx.Graph`` whose placeholders are the model's flat inputs
in the order of ``example_inputs`` and whose output is the tuple of the output's leaves
(``out_spec`` rebuilds the model's own output type), and the layer of every node that runs
inside one.
"""

from __future__ import annotations

import inspect
import operator
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from planner.errors import InputError
from profiler._torch_private import fx_real_calls, tree_flatten


@dataclass
class Capture:
    """The traced forward (see the module docstring)."""

    graph: fx.Graph
    #: objects behind ``get_attr`` / ``call_module`` targets: the model's own tensors and modules
    root: dict[str, Any]
    #: the placeholders, in the order of the flat example inputs
    inputs: list[fx.Node]
    #: node -> (leaf module name, call key): nodes running inside a layer; one key per call
    block: dict[fx.Node, tuple[str, str]]
    #: rebuilds the model output from the output tuple's leaves (``None``: set from an example run)
    out_spec: Any
    method: str
    #: why torch.export was not used (empty when it was)
    export_error: str = ""
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- helpers


@contextmanager
def training_mode(model: nn.Module) -> Iterator[None]:
    """``model.train()`` inside; every module's ``.training`` flag restored on exit."""
    flags = {m: m.training for m in model.modules()}
    try:
        model.train()
        yield
    finally:
        for m, f in flags.items():
            m.training = f


def _signature(model: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def check_bindable(model: nn.Module, num_positional: int, keywords: Sequence[str]) -> None:
    """A clear error when the inputs do not fit ``forward``'s signature."""
    params = _signature(model)
    if not params:
        return
    name = type(model).__name__
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    if num_positional > len(positional) and not var_pos:
        raise InputError(
            f"{num_positional} positional example inputs but {name}.forward takes {len(positional)} "
            "positional parameters: give one tensor per positional parameter (a dict {name: tensor} for "
            "keyword arguments)"
        )
    names = {p.name for p in params}
    for k in keywords:
        if k not in names and not var_kw:
            raise InputError(
                f"example input {k!r} is not a parameter of {name}.forward ({', '.join(sorted(names))}): "
                "use the parameter's name"
            )
    given = {p.name for p in positional[:num_positional]} | set(keywords)
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in given:
            continue
        if p.default is inspect.Parameter.empty:
            raise InputError(
                f"{name}.forward parameter {p.name!r} has no default and no example input: add a tensor "
                f"for it to example_inputs (or pass a dict {{{p.name!r}: tensor, ...}}), or give it a default"
            )


def user_frame(node: fx.Node) -> str:
    """``file:line: code`` of the innermost frame of the user's code that made ``node``."""
    trace = node.meta.get("stack_trace") or getattr(node, "stack_trace", None) or ""
    lines = trace.strip().splitlines()
    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)
    best = ""
    for i, line in enumerate(lines):
        text = line.strip()
        if not text.startswith('File "'):
            continue
        path = text.split('"')[1]
        if path.startswith(skip) or path.startswith("torch/"):
            continue
        lineno = text.split(", line ")[1].split(",")[0] if ", line " in text else "?"
        code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File ") else ""
        shown = os.path.relpath(path) if os.path.isabs(path) and not os.path.relpath(path).startswith("..") else path
        best = f"{shown}:{lineno}" + (f": {code}" if code else "")
    return best


# --------------------------------------------------------------------------- torch.export


def _dynamic_batch(model: nn.Module, args: tuple[Tensor, ...], kwargs: dict[str, Tensor]) -> Any:
    """``dynamic_shapes`` marking dimension 0 of every input dynamic (``Dim.AUTO``)."""
    from torch.export import Dim

    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    spec: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            spec[name] = {k: {0: Dim.AUTO} for k in value}
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            spec[name] = tuple({0: Dim.AUTO} for _ in value)
        else:
            spec[name] = {0: Dim.AUTO}
    return spec


def _block_key(node: fx.Node, leaves: frozenset[str]) -> tuple[str, str] | None:
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in stack.items():  # outermost module first
        path = value[0] if isinstance(value, tuple) else str(value)
        if path in leaves:
            return path, str(key)
    return None


def capture_export(model: nn.Module, flat: Sequence[Tensor], keywords: Sequence[str], leaves: Sequence[str]) -> Capture:
    """Capture with ``torch.export`` (non-strict); raises on anything it cannot take."""
    from torch.export.graph_signature import InputKind, OutputKind

    n_pos = len(flat) - len(keywords)
    args, kwargs = tuple(flat[:n_pos]), dict(zip(keywords, flat[n_pos:], strict=True))
    with training_mode(model):
        ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=_dynamic_batch(model, args, kwargs))
    sig = ep.graph_signature
    old = ep.graph
    by_name = {n.name: n for n in old.nodes}
    user_phs = [by_name[s.arg.name] for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    # the user inputs in export's order -> ours: rebuild (args, kwargs) of placeholders
    from profiler._torch_private import tree_unflatten

    ph_args, ph_kwargs = tree_unflatten(list(user_phs), ep.call_spec.in_spec)
    ordered = [*ph_args, *(ph_kwargs[k] for k in keywords)]
    if len(ordered) != len(flat):
        raise RuntimeError(f"export took {len(ordered)} inputs, the model was given {len(flat)}")
    for ph, t in zip(ordered, flat, strict=True):
        val = ph.meta.get("val")
        if val is not None and not isinstance(val.shape[0], torch.SymInt):
            raise RuntimeError(
                f"torch.export specialized the batch dimension of input {ph.name!r} to {t.shape[0]}"
            )
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    root: dict[str, Any] = {}
    names = [*(f"input_{i}" for i in range(n_pos)), *keywords]
    inputs = []
    for name, ph in zip(names, ordered, strict=True):
        new = g.placeholder(name)
        new.meta = dict(ph.meta)
        env[ph] = new
        inputs.append(new)
    for s in sig.input_specs:
        if s.kind == InputKind.USER_INPUT:
            continue
        node = by_name[s.arg.name]
        target = str(s.target)
        if s.kind == InputKind.PARAMETER:
            obj: Any = model.get_parameter(target)
        elif s.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            obj = _model_tensor(model, target)
            if obj is None:
                obj = ep.constants[target]
                target = "_pipeplan_const." + target.replace(".", "_")
        else:
            raise RuntimeError(f"torch.export input of kind {s.kind.name} is not supported")
        root[target] = obj
        env[node] = g.get_attr(target)
    mutations: list[tuple[Any, Any]] = []
    out_node = next(n for n in old.nodes if n.op == "output")
    outs = list(out_node.args[0])
    user_outs = []
    for s, value in zip(sig.output_specs, outs, strict=True):
        if s.kind == OutputKind.USER_OUTPUT:
            user_outs.append(value)
        elif s.kind == OutputKind.BUFFER_MUTATION:
            mutations.append((value, ("buffer", str(s.target))))
        elif s.kind == OutputKind.USER_INPUT_MUTATION:
            mutations.append((value, ("input", str(s.target))))
        else:
            raise RuntimeError(f"torch.export output of kind {s.kind.name} is not supported")
    mutated_after = {m[0]: m[1] for m in mutations if isinstance(m[0], fx.Node)}
    for n in old.nodes:
        if n.op in ("placeholder", "output"):
            continue
        env[n] = g.node_copy(n, lambda x: env[x])
        if n in mutated_after:
            what, target = mutated_after[n]
            dest = env[by_name[target]] if what == "input" else _get_attr(g, root, model, target)
            copy = g.call_function(torch.ops.aten.copy_.default, (dest, env[n]))
            copy.meta = {k: v for k, v in n.meta.items() if k in ("nn_module_stack", "stack_trace")}
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in user_outs))
    leaf_set = frozenset(leaves)
    block: dict[fx.Node, tuple[str, str]] = {}
    for n in g.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            key = _block_key(n, leaf_set)
            if key is not None:
                block[n] = key
    g.lint()
    return Capture(graph=g, root=root, inputs=inputs, block=block, out_spec=ep.call_spec.out_spec, method="torch.export")


def _model_tensor(model: nn.Module, target: str) -> Tensor | None:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, Tensor) else None


def _get_attr(g: fx.Graph, root: dict[str, Any], model: nn.Module, target: str) -> fx.Node:
    if target not in root:
        obj = _model_tensor(model, target)
        if obj is None:
            raise RuntimeError(f"cannot find the mutated buffer {target!r}")
        root[target] = obj
    return g.get_attr(target)


# --------------------------------------------------------------------------- torch.fx


_SHAPE_METHODS = frozenset(
    {"size", "dim", "numel", "ndimension", "nelement", "is_floating_point", "is_complex", "get_device", "element_size"}
)
_SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout", "is_sparse", "is_quantized"})


def _shape_only(node: fx.Node) -> bool:
    """Whether ``node`` is computed from tensor shapes, dtypes, devices and constants only."""
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return True
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return node.args[1] in _SHAPE_ATTRS
    if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator", "builtins"):
        return all(_shape_only(n) for n in node.all_input_nodes)
    return False


class _LeafTracer(fx.Tracer):
    """fx tracer with the chosen leaves that, given example inputs, specializes Python
    control flow on shapes, dtypes and devices (``assert t <= block_size``,
    ``if x.dtype != torch.float32``) to the branch the example inputs take, as
    ``torch.export`` does."""

    def __init__(self, leaves: Sequence[str], example: dict[str, Any]) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.leaves = frozenset(leaves)
        self.prefixes = frozenset(leaf.rsplit(".", i)[0] for leaf in leaves for i in range(1, leaf.count(".") + 1))
        self.example = example

    def to_bool(self, obj: fx.Proxy) -> bool:
        if not _shape_only(obj.node):
            where = user_frame(obj.node)
            raise fx.proxy.TraceError(
                "Python control flow depends on tensor values"
                + (f" at {where}" if where else "")
                + "; only shapes, dtypes and devices may steer it"
            )
        return bool(self._evaluate(obj.node))

    def _evaluate(self, node: fx.Node) -> Any:
        """The value of ``node`` on the example inputs, from the graph traced so far."""
        from profiler.split import frozen_state

        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in self.graph.nodes:
            env[n] = g.node_copy(n, lambda x: env[x])
            if n is node:
                break
        g.output(env[node])
        args = [self.example[str(n.target)] for n in g.nodes if n.op == "placeholder"]
        with fx_real_calls(), frozen_state(self.root):
            return fx.GraphModule(self.root, g)(*args)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves:
            return True
        if module_qualified_name in self.prefixes:
            return False
        return bool(super().is_leaf_module(m, module_qualified_name))


class _Leaves(nn.Module):
    """The leaves of a nested value, as a tuple (the fx capture's output)."""

    def forward(self, value: Any) -> tuple[Any, ...]:
        return tuple(tree_flatten(value)[0])


def capture_fx(model: nn.Module, flat: Sequence[Tensor], keywords: Sequence[str], leaves: Sequence[str]) -> Capture:
    """Capture with ``torch.fx``, the layers as leaf modules (see the module docstring)."""
    params = _signature(model)
    name = type(model).__name__
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        raise InputError(f"{name}.forward takes *args: give it named parameters so the model can be traced")
    if any(p.kind == p.VAR_KEYWORD for p in params):
        raise InputError(
            f"torch.fx cannot trace {name}.forward(..., **kwargs): torch.export could not either (see above)"
        )
    n_pos = len(flat) - len(keywords)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = {p.name: t for p, t in zip(positional, flat[:n_pos], strict=False)}
    given.update(zip(keywords, flat[n_pos:], strict=True))
    concrete: dict[str, Any] = {p.name: p.default for p in params if p.name not in given}
    tracer = _LeafTracer(leaves, {**concrete, **given})
    with training_mode(model):
        graph = tracer.trace(model, concrete_args=concrete or None)
    placeholders = {str(n.target): n for n in graph.nodes if n.op == "placeholder"}
    # the placeholders of fixed parameters: substitute the constants
    for pname, value in concrete.items():
        node = placeholders.pop(pname, None)
        if node is None:
            continue
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
    inputs = [placeholders[p.name] for p in positional[:n_pos]] + [placeholders[k] for k in keywords]
    # the output as a flat tuple of its leaves
    out = next(n for n in graph.nodes if n.op == "output")
    value = out.args[0]
    root: dict[str, Any] = {"_pipeplan_leaves": _Leaves()}
    with graph.inserting_before(out):
        flat_out = graph.call_module("_pipeplan_leaves", (value,))
    out.args = (flat_out,)
    for n in graph.nodes:
        if n.op in ("call_module", "get_attr") and n.target not in root:
            root[str(n.target)] = _attr(model, str(n.target))
    block = {n: (str(n.target), n.name) for n in graph.nodes if n.op == "call_module" and n.target in tracer.leaves}
    return Capture(graph=graph, root=root, inputs=inputs, block=block, out_spec=None, method="torch.fx")


def _attr(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def capture(model: nn.Module, flat: Sequence[Tensor], keywords: Sequence[str], leaves: Sequence[str]) -> Capture:
    """:func:`capture_export`, falling back to :func:`capture_fx` (see the module docstring)."""
    check_bindable(model, len(flat) - len(keywords), keywords)
    try:
        return capture_export(model, flat, keywords, leaves)
    except InputError:
        raise
    except Exception as err:  # export refuses many things: try fx
        export_error = f"{type(err).__name__}: {_first_line(err)}"
    try:
        result = capture_fx(model, flat, keywords, leaves)
    except InputError as err:
        raise InputError(f"{err} (torch.export also failed: {export_error})") from err
    except Exception as err:
        raise InputError(
            f"cannot capture {type(model).__name__}: torch.export failed ({export_error}) and torch.fx failed "
            f"({type(err).__name__}: {_first_line(err)}). Python control flow on tensor values must sit inside "
            "a layer: pass --split-points naming coarser modules, or move that code into a submodule"
        ) from err
    result.export_error = export_error
    return result


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


__all__ = ["Capture", "capture", "capture_export", "capture_fx", "check_bindable", "training_mode", "user_frame"]
