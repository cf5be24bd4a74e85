"""Split any ``nn.Module`` into a chain of executable units at legal cut points.

The profiler measures these units and the runtime executes them, so a profile layer *is*
a unit and both sides rebuild the exact same split from the same code.

How it works:

1. **Granularity.**  The default layers are the model's blocks: the children of every
   ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` container, and every other child
   of the root (the embedding, the head) as a layer of its own.  A child that holds
   containers deeper down is opened up, and so is a container inside a container (a
   ``Sequential`` of stages, each a ``Sequential`` of blocks, gives the blocks).
   ``split_points`` (module names) override it: the model is cut right *before* each named
   module and nowhere else (a name inside a block opens that block up).
2. **Capture** (:mod:`profiler.capture`): ``torch.export`` (non-strict, dynamic batch
   dimension), or ``torch.fx`` with the layers as leaf modules when export cannot take the
   model.  Inputs may be positional or keyword arguments; the output may be any nested
   structure (tuples, dicts, ``ModelOutput``).
3. **Placement.**  Every call of a layer starts a segment; glue code between layers
   (residual adds, masks, shape arithmetic) runs as early as its inputs allow, code that only
   reads parameters or constants runs where it is first needed, and random or in-place
   operations stay where the program puts them.
4. **Cuts.**  The dataflow graph (``networkx``) gives, for each candidate cut, the values
   crossing it: produced before it and consumed after it, skip connections that span
   several layers included.  The graph runs (without gradients) at the example batch size
   B (at least 2), at 2B and at 3B to tell what each crossing value is:

   * tensors, and tuples, lists, dicts (``torch.Size``, ``ModelOutput``...) of them, are
     flattened, sent, and rebuilt on the other side;
   * values that do not change with the batch size (a dtype, a device, ``None``, a head
     count) are specialized: the unit after the cut holds them as constants;
   * integers that change with it as ``k * B + c`` (``x.size(0)``, ``output_shape``) are
     recomputed after the cut from the batch dimension of a tensor that crosses it.

   Anything else (an object such as a cache, an integer not of that form) makes the cut
   illegal: the two segments become one layer and a :class:`CutWarning` names both layers
   and the line of the user's code that made the value.  With ``split_points`` such a cut
   is an error.
5. **Units.**  Unit ``i`` is an ``fx.GraphModule`` sharing the model's real parameters,
   buffers and submodules.  It takes the flat tensors crossing cut ``i-1`` (unit 0 takes
   the model inputs) and returns the flat tensors crossing cut ``i``; the last unit returns
   the output's tensors (:meth:`SplitModel.rebuild_output` makes the model's output type of
   them).  A unit that writes in place into one of its inputs (``relu(inplace=True)`` as a
   layer's first operation) clones that input first, so a fresh input that requires grad
   can be fed to it.  Running the units in order computes the model exactly.
"""

from __future__ import annotations

import hashlib
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import Tensor, nn

from planner.errors import InputError
from planner.schema import structure_sha256
from profiler._torch_fake import is_fake, storage_key
from profiler._torch_private import (
    is_leaf_spec,
    op_is_mutating,
    op_is_random,
    tree_flatten,
    tree_unflatten,
    version_counter,
)
from profiler.capture import Capture, capture, user_frame

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class CutWarning(UserWarning):
    """A block boundary that cannot be cut: the two blocks run as one layer."""


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


# --------------------------------------------------------------------------- state


@contextmanager
def frozen_state(model: nn.Module, *, train: bool = False) -> Iterator[None]:
    """No grad, a forked RNG, eval mode (or train mode); flags and state restored on exit."""
    flags = {m: m.training for m in model.modules()}
    state = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    devices = sorted({t.device.index or 0 for t in state.values() if t.device.type == "cuda"})
    try:
        model.train(train)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            yield
    finally:
        for m, f in flags.items():
            m.training = f
        with torch.no_grad():
            current = model.state_dict(keep_vars=True)
            for k, v in state.items():
                if is_fake(v) or not torch.equal(current[k], v):  # fake tensors hold no values to compare
                    current[k].copy_(v)


# --------------------------------------------------------------------------- random streams


@dataclass
class RngStreams:
    """Where the random numbers of a unit come from: one stream per (seed, step, replica,
    micro-batch, unit).

    The runtime sets ``step``, ``replica`` and ``microbatch`` before each forward; every unit
    then starts from ``torch.manual_seed(unit_seed(...))``, in the pipelined stages and in
    the unsplit reference (:meth:`SplitModel.seed_hooks`), so dropout draws the same masks
    in both wherever the units run.
    """

    seed: int
    step: int = 0
    replica: int = 0
    microbatch: int = 0

    def key(self) -> tuple[int, int, int, int]:
        return (self.seed, self.step, self.replica, self.microbatch)


def unit_seed(key: Sequence[int], unit: int) -> int:
    """A 63-bit seed for ``unit`` under ``key`` (:meth:`RngStreams.key`)."""
    digest = hashlib.blake2b(repr((*key, unit)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# --------------------------------------------------------------------------- values


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False


def _summary(value: Any) -> tuple[list[Any], Any]:
    """Leaves of ``value`` with every tensor replaced by its :class:`TensorMeta`."""
    leaves, spec = tree_flatten(value)
    return [TensorMeta(tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, Tensor) else x for x in leaves], spec


def _run_values(gm: fx.GraphModule, args: Sequence[Any], model: nn.Module) -> tuple[dict[fx.Node, tuple[list[Any], Any]], Any]:
    """Every node's :func:`_summary` on ``args``, and the output's spec (train mode, no grad)."""
    values: dict[fx.Node, tuple[list[Any], Any]] = {}
    out_spec: list[Any] = [None]

    class _Rec(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n] = _summary(out)
            if n.op == "call_module" and n.target == "_pipeplan_leaves":
                args: Any = self.map_nodes_to_values(n.args, n)
                out_spec[0] = tree_flatten(args[0])[1]
            return out

    with frozen_state(model, train=True):
        _Rec(gm).run(*args)
    return values, out_spec[0]


_LITERALS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


@dataclass(frozen=True)
class _LeafPlan:
    """How one leaf of a crossing value gets to the other side of a cut."""

    kind: str  # "tensor" | "const" | "batch"
    value: Any = None  # the constant
    scale: int = 0  # batch: scale * B + offset
    offset: int = 0


@dataclass(frozen=True)
class _ValuePlan:
    leaves: tuple[_LeafPlan, ...]
    spec: Any

    @property
    def num_tensors(self) -> int:
        return sum(1 for leaf in self.leaves if leaf.kind == "tensor")

    @property
    def needs_batch(self) -> bool:
        return any(leaf.kind == "batch" for leaf in self.leaves)


def _describe(v: Any) -> str:
    text = repr(v)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(v).__name__} ({text})"


def _plan_value(runs: Sequence[tuple[list[Any], Any]], sizes: Sequence[int]) -> _ValuePlan | str:
    """How a value crossing a cut is carried, or why it cannot be (a sentence).

    ``runs``: its :func:`_summary` at the batch sizes ``sizes`` (three of them: an integer
    fitted as ``k * B + c`` on the first two must hold on the third).
    """
    (la, sa), (lb, sb), (lc, sc) = runs
    batch_a, batch_b, batch_c = sizes
    if sa != sb or sa != sc or len(la) != len(lb) or len(la) != len(lc):
        return "a value whose structure changes with the batch size"
    plans = []
    for x, y, z in zip(la, lb, lc, strict=True):
        if isinstance(x, TensorMeta) and isinstance(y, TensorMeta):
            plans.append(_LeafPlan("tensor"))
            continue
        if isinstance(x, TensorMeta) or isinstance(y, TensorMeta):
            return "a value that is a tensor at one batch size and not at another"
        same = False
        try:
            same = type(x) is type(y) and bool(x == y)
        except Exception:
            same = False
        try:
            same = same and type(x) is type(z) and bool(x == z)
        except Exception:
            same = False
        if same and isinstance(x, _LITERALS):
            plans.append(_LeafPlan("const", value=x))
            continue
        if type(x) is int and type(y) is int and type(z) is int and not same:
            scale, rem = divmod(y - x, batch_b - batch_a)
            if rem == 0 and z == scale * batch_c + x - scale * batch_a:
                plans.append(_LeafPlan("batch", scale=scale, offset=x - scale * batch_a))
                continue
            return (
                f"an int ({x}, {y}, {z} at batch sizes {batch_a}, {batch_b}, {batch_c}) that is not a "
                "multiple of the batch size plus a constant"
            )
        if same:
            return f"{_describe(x)}, which cannot be written into a graph"
        return f"{_describe(x)} that changes from call to call (an object, not a tensor)"
    return _ValuePlan(tuple(plans), sa)


def _affine(batch: int, scale: int, offset: int) -> int:
    """``scale * batch + offset`` (a shape value recomputed after a cut)."""
    return scale * batch + offset


class _Rebuild(nn.Module):
    """Rebuild a nested value from its leaves (the receiving side of a cut)."""

    def __init__(self, spec: Any) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, *leaves: Any) -> Any:
        return tree_unflatten(list(leaves), self.spec)


class _Flatten(nn.Module):
    """The leaves of a nested value, as a tuple (the sending side of a cut)."""

    def forward(self, value: Any) -> tuple[Any, ...]:
        return tuple(tree_flatten(value)[0])


# --------------------------------------------------------------------------- the split


@dataclass
class SplitModel:
    """A model cut into executable units (see the module docstring)."""

    model: nn.Module
    names: list[str]
    units: list[nn.Module]
    #: names of the flat tensors crossing each cut (``len(units) - 1`` entries)
    cut_values: list[list[str]]
    #: for each crossing tensor, whether the unit right before the cut produced it
    #: (False: a skip connection from further back, or a model input passed along)
    cut_produced_by_previous: list[list[bool]]
    #: layer calls (anchors) each unit holds
    anchors: list[list[str]]
    #: the captured whole-model graph and the dataflow graph over its nodes
    graph: fx.Graph
    dataflow: nx.DiGraph = field(repr=False)
    num_inputs: int = 1
    #: class name of each unit's first leaf module (informational)
    kinds: list[str] = field(default_factory=list)
    #: names of the trailing inputs passed by keyword
    keywords: tuple[str, ...] = ()
    #: "torch.export" or "torch.fx"
    method: str = "torch.export"
    #: block boundaries that could not be cut, one sentence each
    warnings: list[str] = field(default_factory=list)
    #: the split points the split was made with (empty: every block)
    split_points: list[str] = field(default_factory=list)
    #: rebuilds the model output from the last unit's tensors
    out_spec: Any = None
    out_leaves: tuple[_LeafPlan, ...] = ()
    #: (leaf module, index of the call among all calls of that module object) of each unit's
    #: first layer call, for :meth:`seed_hooks` (one module can have several names: T5's shared
    #: embedding is ``encoder.embed_tokens`` and ``decoder.embed_tokens``)
    unit_starts: list[tuple[str, int]] = field(default_factory=list)

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
        ``[[(0, "embed.tok.weight"), (5, "embed.tok.weight")]]``.  A pipeline runtime must
        sum their gradients across the ranks holding them.
        """
        groups: dict[int, list[tuple[int, str]]] = {}
        for i, unit in enumerate(self.units):
            for name, p in unit.named_parameters():
                groups.setdefault(id(p), []).append((i, name))
        return [g for g in groups.values() if len({i for i, _ in g}) > 1]

    def rebuild_output(self, tensors: Sequence[Tensor]) -> Any:
        """The model's output (its own type) from the last unit's tensors."""
        it = iter(tensors)
        leaves = [next(it) if leaf.kind == "tensor" else leaf.value for leaf in self.out_leaves]
        return tree_unflatten(leaves, self.out_spec)

    def stage_module(self, start: int, stop: int, *, pipeline: bool = False) -> StageModule:
        """A module running ``units[start:stop]`` in a chain.

        ``forward(*tensors)`` takes what unit ``start`` takes and returns the tuple of tensors
        crossing cut ``stop - 1``; when ``stop == len(units)`` it returns the model output, or
        with ``pipeline=True`` the output's tensors.  With ``pipeline=True`` every tensor it
        returns is contiguous (a stage boundary sends it).
        """
        if not 0 <= start < stop <= len(self.units):
            raise InputError(
                f"stage [{start}, {stop}) is out of range for a model of {len(self.units)} layers: "
                f"need 0 <= start < stop <= {len(self.units)}"
            )
        last = stop == len(self.units)
        return StageModule(
            self.units[start:stop],
            self.names[start:stop],
            first=start,
            rebuild=self.rebuild_output if last and not pipeline else None,
            contiguous=pipeline,
        )

    def run(self, *inputs: Tensor) -> Any:
        """Run every unit in order on the flat inputs: equals the model's output."""
        return self.stage_module(0, len(self.units))(*inputs)

    def seed_hooks(self, model: nn.Module, streams: RngStreams) -> list[Any]:
        """Hooks on ``model`` (this model or another instance of it) that reseed the RNG where
        each unit starts, as :class:`StageModule` does, so the unsplit model draws the same
        random numbers as the units.  Remove them with ``h.remove()``."""
        calls: dict[int, int] = {}
        starts: dict[tuple[int, int], int] = {}
        modules: dict[int, nn.Module] = {}
        for u, (name, k) in enumerate(self.unit_starts):
            if u > 0:
                mod = model.get_submodule(name)
                modules[id(mod)] = mod
                starts[(id(mod), k)] = u

        def at_root(mod: nn.Module, args: Any) -> None:
            calls.clear()
            torch.manual_seed(unit_seed(streams.key(), 0))

        def at_leaf(mod: nn.Module, args: Any) -> None:
            k = calls.get(id(mod), 0)
            calls[id(mod)] = k + 1
            u = starts.get((id(mod), k))
            if u is not None:
                torch.manual_seed(unit_seed(streams.key(), u))

        handles = [model.register_forward_pre_hook(at_root)]
        handles += [mod.register_forward_pre_hook(at_leaf) for mod in modules.values()]
        return handles


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; its backward makes the gradient contiguous (a pipeline sends it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _contiguous_grad(t: Tensor) -> Tensor:
    out: Tensor = _ContiguousGrad.apply(t)  # type: ignore[no-untyped-call]
    return out


class StageModule(nn.Module):
    """Consecutive units chained; shares their parameters.

    With :attr:`rng` set (:class:`RngStreams`), every unit starts from its own seed.
    """

    def __init__(
        self,
        units: Sequence[nn.Module],
        names: Sequence[str],
        *,
        first: int = 0,
        rebuild: Callable[[Sequence[Tensor]], Any] | None = None,
        contiguous: bool = False,
    ) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)
        self.layer_names = list(names)
        self.first = first
        self.rebuild = rebuild
        self.contiguous = contiguous
        self.rng: RngStreams | None = None

    def forward(self, *args: Any) -> Any:
        return self.run_with(args, self.rng.key() if self.rng is not None else None)

    def run_with(self, args: Sequence[Any], key: Sequence[int] | None) -> Any:
        """The forward pass, with the RNG streams of ``key`` (``None``: the current RNG)."""
        x: Any = tuple(args)
        if self.contiguous and self.first > 0 and torch.is_grad_enabled():
            # the gradients of a received input go back over the wire: make them contiguous too
            x = tuple(_contiguous_grad(t) if isinstance(t, Tensor) and t.requires_grad else t for t in x)
        for i, unit in enumerate(self.units):
            if key is not None:
                torch.manual_seed(unit_seed(key, self.first + i))
            x = unit(*x)
            if not isinstance(x, tuple):
                raise RuntimeError(f"unit {self.layer_names[i]!r} returned {type(x).__name__}, expected a tuple")
        if self.contiguous:
            x = tuple(t.contiguous() if isinstance(t, Tensor) else t for t in x)
        if self.rebuild is not None:
            return self.rebuild(x)
        return x


def split_model(
    model: nn.Module,
    example_inputs: Any,
    *,
    split_points: Sequence[str] | None = None,
    keywords: Sequence[str] | None = None,
) -> SplitModel:
    """Cut ``model`` into executable units (see the module docstring).

    ``example_inputs``: a tensor, a sequence of tensors (positional arguments; extra ones go
    to keyword-only parameters) or a dict of tensors (keyword arguments); with ``keywords``,
    flat tensors whose last ``len(keywords)`` are those keyword arguments.  They run twice
    without gradients (at their batch size B, at least 2, and at 2B and 3B) to tell tensors
    from other values.  ``split_points``: module names to cut right before (default: every block).
    Block boundaries that cannot be cut merge their blocks and emit a :class:`CutWarning`.
    """
    from profiler.loading import check_example_inputs, model_inputs

    if keywords is None:
        flat, kw = model_inputs(example_inputs, model)
    else:
        flat, kw = check_example_inputs(example_inputs), tuple(keywords)
    points = list(split_points or [])
    leaves = _leaves_for_split_points(model, points) if points else default_leaves(model)
    batch_a = max(2, int(flat[0].shape[0]))
    sizes = (batch_a, 2 * batch_a, 3 * batch_a)
    inputs_a = _resize(flat, batch_a)
    cap = capture(model, inputs_a, kw, leaves)
    gm = fx.GraphModule(cap.root, cap.graph)
    order = [cap.inputs.index(n) for n in cap.graph.nodes if n.op == "placeholder"]
    runs = []
    for size in sizes:
        batch = _resize(flat, size)
        try:
            runs.append(_run_values(gm, [batch[i] for i in order], model))
        except Exception as err:
            shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in batch)
            text = str(err).strip()
            raise InputError(
                f"running {type(model).__name__} on its example inputs ({shapes}) failed: "
                f"{type(err).__name__}: {text.splitlines()[0] if text else ''} -- check "
                "that example_inputs match the model's forward (they are also run at 2x and 3x their "
                "batch size)"
            ) from err
    spec_a = runs[0][1]
    out_spec = cap.out_spec if cap.out_spec is not None else spec_a
    return _partition(model, cap, [r[0] for r in runs], sizes, inputs_a, kw, points, out_spec)


def _resize(inputs: Sequence[Tensor], size: int) -> tuple[Tensor, ...]:
    out = []
    for t in inputs:
        index = torch.arange(size, device=t.device) % t.shape[0]
        out.append(t.index_select(0, index))
    return tuple(out)


_RNG_NAMES = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                        "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
                        "multinomial", "normal", "randperm", "poisson"})  # fmt: skip


def _keeps_program_order(n: fx.Node) -> bool:
    """Random or in-place operations: they run where the program puts them."""
    target = n.target
    random, mutating = op_is_random(target), op_is_mutating(target)
    if random is not None:
        return random or bool(mutating)
    name = getattr(target, "__name__", str(target))
    if n.op == "call_method":
        return (str(target).endswith("_") and not str(target).endswith("__")) or str(target) in _RNG_NAMES
    if n.op == "call_function":
        return name in _RNG_NAMES or (name.endswith("_") and not name.endswith("__"))
    return False


def _partition(
    model: nn.Module,
    cap: Capture,
    runs: list[dict[fx.Node, tuple[list[Any], Any]]],
    sizes: tuple[int, int, int],
    inputs_a: tuple[Tensor, ...],
    keywords: tuple[str, ...],
    split_points: list[str],
    out_spec: Any,
) -> SplitModel:
    graph = cap.graph
    output = next(n for n in graph.nodes if n.op == "output")
    _flatten_output(graph, output, runs)
    values_a, values_b = runs[0], runs[1]
    batch_a, batch_b = sizes[0], sizes[1]
    nodes = list(graph.nodes)

    # --- layer calls (anchors), in program order, and the segment of every node
    occurrences: list[tuple[str, str]] = []
    seg: dict[fx.Node, int] = {}
    program: dict[fx.Node, int] = {}
    for n in nodes:
        b = cap.block.get(n)
        if b is not None:
            if not occurrences or occurrences[-1] != b:
                occurrences.append(b)
            seg[n] = len(occurrences) - 1
        program[n] = max(0, len(occurrences) - 1)
    num_segments = max(1, len(occurrences))
    deferred: list[fx.Node] = []
    for n in nodes:
        if n in seg or n.op == "get_attr":
            continue
        if n.op == "placeholder":
            seg[n] = 0
        elif n.op == "output":
            seg[n] = num_segments - 1
        else:
            placed = [seg[i] for i in n.all_input_nodes if i in seg]
            if _keeps_program_order(n):
                seg[n] = max([program[n], *placed])
            elif placed:
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
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        if n not in seg:
            continue
        for i in n.all_input_nodes:
            if i in seg:
                dataflow.add_edge(i.name, n.name)
                if seg[i] > seg[n]:
                    raise AssertionError(f"value {i.name} flows backwards from segment {seg[i]} to {seg[n]}")
                last_use[i] = max(last_use.get(i, -1), seg[n])

    def crossing(cut: int) -> list[fx.Node]:
        return [n for n in nodes if n in last_use and seg[n] <= cut < last_use[n]]

    plans: dict[fx.Node, _ValuePlan | str] = {}

    def plan_of(n: fx.Node) -> _ValuePlan | str:
        if n not in plans:
            if any(n not in r for r in runs):
                plans[n] = "a value the example run did not compute"
            else:
                plans[n] = _plan_value([r[n] for r in runs], sizes)
        return plans[n]

    def batch_source(cut: int) -> tuple[int, int] | None:
        """(flat tensor index, dim) of a tensor crossing ``cut`` whose dim is the batch size."""
        k = 0
        found: tuple[int, int] | None = None
        for n in crossing(cut):
            p = plan_of(n)
            if isinstance(p, str):
                return None
            metas_a, metas_b = values_a[n][0], values_b[n][0]
            for leaf, ma, mb in zip(p.leaves, metas_a, metas_b, strict=True):
                if leaf.kind != "tensor":
                    continue
                for d, (sa, sb) in enumerate(zip(ma.shape, mb.shape, strict=True)):
                    if sa == batch_a and sb == batch_b and (found is None or (d == 0 and found[1] != 0)):
                        found = (k, d)
                k += 1
        return found

    def problem(cut: int) -> str | None:
        """Why ``cut`` cannot be made (a sentence naming the user's code), or ``None``."""
        needs_batch = False
        for n in crossing(cut):
            p = plan_of(n)
            if isinstance(p, str):
                where = user_frame(n)
                return p + (f", made at {where}" if where else "")
            needs_batch = needs_batch or p.needs_batch
        if needs_batch and batch_source(cut) is None:
            n = next(n for n in crossing(cut) if isinstance(plan_of(n), _ValuePlan) and plan_of(n).needs_batch)  # type: ignore[union-attr]
            where = user_frame(n)
            return (
                "a shape value that changes with the batch size"
                + (f", made at {where}," if where else "")
                + " and no tensor with a batch dimension crosses with it to recompute it from"
            )
        return None

    # --- names of the layer calls
    counts: dict[str, int] = {}
    anchor_names: list[str] = []
    call_index: list[int] = []  # the call's index among the calls of the same module object
    object_calls: dict[int, int] = {}
    for leaf, _key in occurrences:
        k = counts.get(leaf, 0)
        counts[leaf] = k + 1
        anchor_names.append(leaf if k == 0 else f"{leaf}#{k}")
        obj = id(model.get_submodule(leaf))
        call_index.append(object_calls.get(obj, 0))
        object_calls[obj] = object_calls.get(obj, 0) + 1

    # --- choose the cuts
    notes: list[str] = []
    if split_points:
        starts = set()
        for point in split_points:
            first = next(
                (i for i, (leaf, _) in enumerate(occurrences) if leaf == point or leaf.startswith(point + ".")),
                None,
            )
            if first is None:
                raise InputError(f"split point {point!r} is never called by the model's forward: name a module it runs")
            if first > 0:
                why = problem(first - 1)
                if why:
                    raise InputError(
                        f"cannot cut before {point!r}: {why} crosses that point; pick another split "
                        "point (or compute that value inside a layer)"
                    )
                starts.add(first)
        boundaries = sorted(starts)
    else:
        boundaries = []
        for c in range(num_segments - 1):
            why = problem(c)
            if why is None:
                boundaries.append(c + 1)
            else:
                notes.append(
                    f"cannot cut between {anchor_names[c]!r} and {anchor_names[c + 1]!r}: {why} crosses that "
                    "point and can be neither sent (not a tensor) nor recomputed from the batch size, so they "
                    "run as one layer; compute it inside a block, or make it a tensor"
                )
    groups = list(zip([0, *boundaries], [*boundaries, num_segments], strict=True))
    for text in notes:
        warnings.warn(text, CutWarning, stacklevel=3)

    # --- the output's leaves
    out_args = list(output.args[0])
    out_leaves: list[_LeafPlan] = []
    out_nodes: list[Any] = []
    out_a = [values_a[o][0][0] if isinstance(o, fx.Node) else o for o in out_args]
    out_b = [runs[2][o][0][0] if isinstance(o, fx.Node) else o for o in out_args]
    for o, va, vb in zip(out_args, out_a, out_b, strict=True):
        if isinstance(va, TensorMeta):
            out_leaves.append(_LeafPlan("tensor"))
            out_nodes.append(o)
            continue
        try:
            same = type(va) is type(vb) and bool(va == vb)
        except Exception:
            same = False
        if not same:
            raise InputError(
                f"the output of {type(model).__name__} holds {_describe(va)} that changes with the batch size: "
                "return tensors (or constants) only"
            )
        out_leaves.append(_LeafPlan("const", value=va))

    # --- build the units
    units: list[nn.Module] = []
    cut_values: list[list[str]] = []
    produced: list[list[bool]] = []
    cut_plans: list[list[tuple[fx.Node, _ValuePlan]]] = []
    for lo, hi in groups[:-1]:
        cut = [(n, plan_of(n)) for n in crossing(hi - 1)]
        cut_plans.append(cut)  # type: ignore[arg-type]
        names_here: list[str] = []
        flags: list[bool] = []
        for n, p in cut:
            assert isinstance(p, _ValuePlan)
            tensors = [j for j, leaf in enumerate(p.leaves) if leaf.kind == "tensor"]
            for j in tensors:
                names_here.append(n.name if is_leaf_spec(p.spec) else f"{n.name}[{j}]")
                flags.append(n.op != "placeholder" and lo <= seg[n] < hi)
        cut_values.append(names_here)
        produced.append(flags)
    sources = [batch_source(hi - 1) for _, hi in groups[:-1]]

    def build(u: int, clone: frozenset[int]) -> fx.GraphModule:
        lo, hi = groups[u]
        g = fx.Graph()
        root: dict[str, Any] = {}
        env: dict[fx.Node, Any] = {}
        tensor_leaves: dict[fx.Node, list[fx.Node]] = {}

        def lookup(n: fx.Node) -> Any:
            if n not in env:
                if n.op != "get_attr":
                    raise AssertionError(f"value {n.name} is not available in unit {u}")
                env[n] = g.node_copy(n)
                root[str(n.target)] = cap.root[str(n.target)]
            return env[n]

        if u == 0:
            phs = [g.placeholder(p.name) for p in cap.inputs]
        else:
            cut = cut_plans[u - 1]
            phs = []
            for n, p in cut:
                for j, leaf in enumerate(p.leaves):
                    if leaf.kind == "tensor":
                        phs.append(g.placeholder(n.name if is_leaf_spec(p.spec) else f"{n.name}_{j}"))
        # clone the inputs this unit writes into (a fresh input that requires grad cannot be)
        if clone:
            fresh = []
            for i, ph in enumerate(phs):
                fresh.append(g.call_method("clone", (ph,)) if i in clone else ph)
        else:
            fresh = list(phs)
        if u == 0:
            for ph, new in zip(cap.inputs, fresh, strict=True):
                env[ph] = new
                tensor_leaves[ph] = [new]
        else:
            cut = cut_plans[u - 1]
            source = sources[u - 1]
            batch: fx.Node | None = None
            if any(p.needs_batch for _, p in cut):
                assert source is not None
                batch = g.call_method("size", (fresh[source[0]], source[1]))
            k = 0
            for idx, (n, p) in enumerate(cut):
                leaves_here: list[Any] = []
                tensors_here: list[fx.Node] = []
                for leaf in p.leaves:
                    if leaf.kind == "tensor":
                        leaves_here.append(fresh[k])
                        tensors_here.append(fresh[k])
                        k += 1
                    elif leaf.kind == "const":
                        leaves_here.append(leaf.value)
                    else:
                        leaves_here.append(g.call_function(_affine, (batch, leaf.scale, leaf.offset)))
                tensor_leaves[n] = tensors_here
                if is_leaf_spec(p.spec):
                    env[n] = leaves_here[0]
                else:
                    name = f"_pipeplan_rebuild_{idx}"
                    root[name] = _Rebuild(p.spec)
                    env[n] = g.call_module(name, tuple(leaves_here))
        for n in nodes:
            if n.op in ("placeholder", "output", "get_attr") or not lo <= seg[n] < hi:
                continue
            env[n] = g.node_copy(n, lookup)
            if n.op == "call_module":
                root[str(n.target)] = cap.root[str(n.target)]
        if u == len(groups) - 1:
            g.output(tuple(lookup(o) for o in out_nodes))
        else:
            outs: list[Any] = []
            for idx, (n, p) in enumerate(cut_plans[u]):
                if n in tensor_leaves:  # passes through: send what came in
                    outs.extend(tensor_leaves[n])
                    continue
                value = lookup(n)
                if is_leaf_spec(p.spec):
                    if p.leaves[0].kind == "tensor":
                        outs.append(value)
                    continue
                name = f"_pipeplan_flatten_{idx}"
                root[name] = _Flatten()
                flat = g.call_module(name, (value,))
                outs.extend(
                    g.call_function(operator.getitem, (flat, j)) for j, leaf in enumerate(p.leaves) if leaf.kind == "tensor"
                )
            g.output(tuple(outs))
        g.lint()
        return fx.GraphModule(root, g, class_name=f"Unit{u}")

    units = [build(u, frozenset()) for u in range(len(groups))]
    # units that write into an input: clone it at entry
    written = _inputs_written(model, units, inputs_a, len(groups))
    for u, which in written.items():
        units[u] = build(u, frozenset(which))

    unit_names = [anchor_names[lo] if occurrences else "model" for lo, _ in groups]
    kinds = [type(model.get_submodule(occurrences[lo][0])).__name__ if occurrences else type(model).__name__ for lo, _ in groups]
    return SplitModel(
        model=model,
        names=unit_names,
        units=units,
        cut_values=cut_values,
        cut_produced_by_previous=produced,
        anchors=[anchor_names[lo:hi] for lo, hi in groups] if occurrences else [[]],
        graph=graph,
        dataflow=dataflow,
        num_inputs=len(cap.inputs),
        kinds=kinds,
        keywords=keywords,
        method=cap.method,
        warnings=notes,
        split_points=list(split_points),
        out_spec=out_spec,
        out_leaves=tuple(out_leaves),
        unit_starts=[(occurrences[lo][0], call_index[lo]) if occurrences else ("", 0) for lo, _ in groups],
    )


def _flatten_output(graph: fx.Graph, output: fx.Node, runs: Sequence[dict[fx.Node, tuple[list[Any], Any]]]) -> None:
    """Make the output a flat tuple of leaves (getitem nodes for an output node holding a tuple)."""
    args = output.args[0]
    items = list(args) if isinstance(args, (tuple, list)) else [args]
    leaf_spec = tree_flatten(0)[1]
    flat: list[Any] = []
    for o in items:
        if not isinstance(o, fx.Node) or is_leaf_spec(runs[0][o][1]):
            flat.append(o)
            continue
        with graph.inserting_before(output):
            for j in range(len(runs[0][o][0])):
                item = graph.call_function(operator.getitem, (o, j))
                for r in runs:
                    r[item] = ([r[o][0][j]], leaf_spec)
                flat.append(item)
    output.args = (tuple(flat),)


def _inputs_written(model: nn.Module, units: Sequence[nn.Module], inputs: Sequence[Tensor], n: int) -> dict[int, list[int]]:
    """For each unit, the indices of the inputs it writes into in place (one run, no grad)."""
    found: dict[int, list[int]] = {}
    with frozen_state(model, train=True):
        x: Any = tuple(inputs)
        for u, unit in enumerate(units):
            ins = [t.clone() if isinstance(t, Tensor) else t for t in x]
            before = [version_counter(t) if isinstance(t, Tensor) else 0 for t in ins]
            out = unit(*ins)
            after = [version_counter(t) if isinstance(t, Tensor) else 0 for t in ins]
            which = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
            if which:
                found[u] = which
            x = out if u < n - 1 else ()
    return found


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (tuples, lists and dicts walked), by storage once."""
    seen: set[tuple[int, Any]] = set()
    total = 0

    def walk(v: Any) -> None:
        nonlocal total
        if isinstance(v, Tensor):
            key = (storage_key(v), v.storage_offset()) if v.numel() else (id(v), 0)
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


def split_for_profile(model: nn.Module, example_inputs: Any, profile: Any, *, keywords: Sequence[str] | None = None) -> SplitModel:
    """Rebuild the split a profile was made with (its recorded split points) and check it.

    Raises :class:`planner.errors.PlanMismatchError` when the model's layer names or
    parameter bytes differ from the profile's (another model, size or dtype).
    """
    from planner.errors import PlanMismatchError

    split = split_model(model, example_inputs, split_points=profile.split_points or None, keywords=keywords)
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


__all__ = [
    "CONTAINERS",
    "CutWarning",
    "RngStreams",
    "SplitModel",
    "StageModule",
    "default_leaves",
    "frozen_state",
    "split_for_profile",
    "split_model",
    "tensor_bytes",
    "unit_seed",
]
