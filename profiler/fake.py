"""A profile from fake tensors: the layers, bytes and operation census of a real profile, the
times priced by the device model (``pipeplan profile --fake``; needs torch, no accelerator).

The model is built and traced under torch's fake-tensor mode on the CPU device
(:mod:`profiler._torch_fake`): tensors have shapes, dtypes and strides but no data, so a 405B
model allocates nothing and every operator costs only its shape function.  Everything else is
the real profiler's: the same capture and splitter (:func:`profiler.split.split_model`, so the
layers are a real profile's), the same reference pass per micro-batch size
(:func:`profiler.measure.reference_pass`: activation bytes through saved-tensor hooks, each
storage once, and the kept inputs of every stage start), the same output and cut bytes, and the
same operation census (:mod:`profiler.census`).  Per layer exactly what a real profile has of
these; nothing is measured, so:

* **times**: forward, backward and its input- and weight-gradient parts from the census, priced
  by :func:`planner.cost.compute.layer_times` on the device preset (``measured_on.device`` is
  ``fake:<preset>``, ``measured_on.pricing`` names the device model and its constants).  As in a
  real profile the first layer, whose inputs need no gradient, has no input-gradient part;
* **not filled**: the run-to-run spreads, CUDA peaks, FLOPs, selective-recompute fields and the
  bytes held between the backward's two halves (the planner's defaults apply).

Mixture-of-experts layers of Hugging Face models (:mod:`profiler._moe_balanced`) run balanced
routing: each expert gets ``tokens·top_k/experts`` tokens (``capacity_factor`` times that with
capacity routing); the layer's ``moe`` says so and its expert GEMMs are marked ``expert``.

A forward that needs tensor values (``.item()``, ``nonzero``, a branch on a tensor) cannot run on
fake tensors: :func:`fake_profile` then names the module and the line of code, and nothing is
returned.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from planner.cost.compute import DeviceConstants, default_constants, layer_times
from planner.errors import InputError
from planner.presets import DEVICES
from planner.schema import LayerProfile, MeasuredOn, MoELayer, Operation, Profile
from profiler import _hf_attention, _moe_balanced, _torch_fake, repeat
from profiler.census import census
from profiler.loading import Entrypoint, call_model, default_loss
from profiler.measure import (
    add_tensor_parallel_fields,
    dtype_name,
    parse_dtype,
    reference_pass,
    resize_batch,
    state_storages,
)
from profiler.sharding import units_sharded_weights
from profiler.split import SplitModel, split_model, tensor_bytes


def pricing_text(device_type: str, constants: DeviceConstants) -> str:
    """``measured_on.pricing`` of a fake profile."""
    return (
        f"device model {device_type}, gemm efficiency {constants.gemm_efficiency:.2f}, "
        f"memory efficiency {constants.memory_efficiency:.2f} (planner.cost.compute; census of fake tensors)"
    )


def fake_profile(
    make_entry: Callable[[], Entrypoint],
    *,
    device_type: str,
    microbatch_sizes: Sequence[int] = (1, 2, 4, 8),
    dtype: str | torch.dtype = "bfloat16",
    split_points: Sequence[str] | None = None,
    name: str | None = None,
    capacity_factor: float | None = None,
    constants: DeviceConstants | None = None,
    repeated_blocks: bool = True,
) -> Profile:
    """The profile of the model ``make_entry()`` builds, traced on fake tensors (module doc).

    ``make_entry`` is called inside the fake-tensor mode, so the model and its example inputs
    are fake from the start (no parameter is ever allocated); it returns an
    :class:`~profiler.loading.Entrypoint` (``load_entrypoint(spec)``,
    :func:`profiler.hf_config.hf_entrypoint`).  ``device_type``: a device preset of
    :data:`planner.presets.DEVICES` (e.g. ``"h100-80g"``) whose device model prices the census
    (``constants``: its default efficiencies unless given).  ``capacity_factor``: capacity routing
    for mixture-of-experts layers (default: balanced).  ``repeated_blocks``: trace one block of
    each kind of the model's stack and copy its layer to the others (:mod:`profiler.repeat`; the
    same profile, a fraction of the time); False traces every block.
    """
    if device_type not in DEVICES:
        raise InputError(f"unknown device type {device_type!r} for --fake: choose one of {', '.join(sorted(DEVICES))}")
    consts = constants or default_constants(device_type)
    sizes = sorted({int(b) for b in microbatch_sizes})
    if not sizes or sizes[0] < 1:
        raise InputError(f"micro-batch sizes must be positive integers, got {list(microbatch_sizes)}")
    torch_dtype = parse_dtype(dtype)
    with torch.random.fork_rng(devices=[]), _torch_fake.fake_mode():  # a builder's manual_seed is undone
        entry = _build(make_entry)
        model = _cast(entry.model, torch_dtype)
        model.train()
        experts = _moe_balanced.install(model, capacity_factor=capacity_factor)
        inputs = tuple(t.to(dtype=torch_dtype) if t.is_floating_point() else t for t in entry.example_inputs)
        trace = _Trace(entry, model, inputs, sizes, experts, device_type=device_type, constants=consts,
                       torch_dtype=torch_dtype, split_points=split_points, name=name,
                       capacity_factor=capacity_factor)
        cut = repeat.truncate(model) if repeated_blocks and split_points is None else None
        if cut is not None:
            try:
                return repeat.expand(trace.profile(), cut)
            except Exception:  # the model's code needs its whole stack: trace it all
                cut.restore()
        return trace.profile()


@dataclass
class _Trace:
    """One fake trace of a built model (:func:`fake_profile`'s work, inside its fake mode)."""

    entry: Entrypoint
    model: nn.Module
    inputs: tuple[Tensor, ...]
    sizes: list[int]
    experts: list[_moe_balanced.Experts]
    device_type: str
    constants: DeviceConstants
    torch_dtype: torch.dtype
    split_points: Sequence[str] | None
    name: str | None
    capacity_factor: float | None

    def profile(self) -> Profile:
        entry, model, inputs, sizes, experts = self.entry, self.model, self.inputs, self.sizes, self.experts
        device_type, consts, torch_dtype = self.device_type, self.constants, self.torch_dtype
        split_points, name, capacity_factor = self.split_points, self.name, self.capacity_factor
        try:
            loss = entry.output_loss() or default_loss
            split = split_model(model, inputs, split_points=split_points, keywords=entry.keywords)
            layers = _fake_layers(split, inputs, sizes, loss=loss, experts=experts)
        except Exception as err:
            diagnosis = _diagnose(model, inputs, entry.keywords, entry.output_loss() or default_loss)
            if diagnosis is not None:
                raise diagnosis from err
            raise
        input_bytes = [tensor_bytes(resize_batch(inputs, b)) for b in sizes]
        param_bytes = split.param_bytes()
        add_tensor_parallel_fields(split, layers, input_bytes)
        _price(layers, device_type=device_type, constants=consts, first_needs_grad=_needs_grad(inputs))
        _moe_fields(layers, split, experts, capacity_factor=capacity_factor, dtype=torch_dtype)
        profile_dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch_dtype)
        profile = Profile(
            model=name or type(model).__name__,
            measured_on=MeasuredOn(
                device=f"fake:{device_type}",
                device_name=device_type,
                dtype=dtype_name(profile_dtype),
                torch_version=torch.__version__,
                pricing=pricing_text(device_type, consts),
            ),
            microbatch_sizes=sizes,
            input_bytes=input_bytes,
            layers=[
                LayerProfile(name=split.names[i], param_bytes=param_bytes[i], kind=split.kinds[i], **layers[i])
                for i in range(len(split))
            ],
            split_points=list(split.split_points),
            metadata={
                "profiler": {
                    "fake": True,
                    "timing": "device model",
                    "device_type": device_type,
                    "gemm_efficiency": consts.gemm_efficiency,
                    "memory_efficiency": consts.memory_efficiency,
                    "loss": "custom" if entry.loss_fn is not None else "output.float().mean()",
                    "capture": split.method,
                    **_hf_attention.attention_metadata(model),
                    "anchors": split.anchors,
                    "merged": split.warnings,
                    "shared_parameters": [[list(x) for x in g] for g in split.shared_parameters()],
                    **({"moe": _moe_metadata(experts, capacity_factor)} if experts else {}),
                }
            },
        )
        return profile


def _cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` for fake tensors (whose ``Module.to`` swaps tensors, which the fake
    mode's weak references refuse): every floating parameter and buffer cast, tied ones kept tied."""
    done: dict[int, Any] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if id(t) not in done:
                    cast = t.detach().to(dtype)
                    done[id(t)] = nn.Parameter(cast, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else cast
                table[key] = done[id(t)]
    return model


def _moe_metadata(experts: Sequence[_moe_balanced.Experts], capacity_factor: float | None) -> dict[str, Any]:
    return {
        "routing": "balanced" if capacity_factor is None else "capacity",
        "capacity_factor": capacity_factor,
        "layers": [x.name for x in experts],
    }


def _needs_grad(inputs: Sequence[Tensor]) -> bool:
    return any(isinstance(t, Tensor) and t.requires_grad for t in inputs)


def _fake_layers(
    split: SplitModel,
    inputs: tuple[Tensor, ...],
    sizes: Sequence[int],
    *,
    loss: Callable[[Any], Tensor],
    experts: Sequence[_moe_balanced.Experts],
) -> list[dict[str, Any]]:
    """Per unit, the byte fields and census of a real profile (:func:`profiler.measure._measure`
    without the timing), at every size."""
    n = len(split)
    fields = ("activation_bytes", "output_bytes", "cut_bytes", "operations")
    out: list[dict[str, Any]] = [{f: [] for f in fields} for _ in range(n)]
    kept: list[list[dict[int, int]]] = [[] for _ in range(n)]
    exclude = state_storages(split)
    unit_experts = _experts_by_unit(split, experts)
    sharded = units_sharded_weights(split)  # the census's tensor-parallel roles (profiler/sharding.py)
    for b in sizes:
        batch = resize_batch(inputs, b)
        ref = reference_pass(split, batch, loss, exclude=exclude, backward=False)
        for i in range(n):
            kept[i].append(ref.kept_inputs[i])
            res = ref.outputs[i]
            if i < n - 1:
                own = [t for t, m in zip(res, split.cut_produced_by_previous[i], strict=True) if m]
                out[i]["output_bytes"].append(tensor_bytes(own))
                out[i]["cut_bytes"].append(tensor_bytes(res))
            else:
                out[i]["output_bytes"].append(tensor_bytes(res[0]))
                out[i]["cut_bytes"].append(tensor_bytes(res[0]))
            out[i]["activation_bytes"].append(ref.activation_bytes[i])
        frozen = [
            tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t for t in ins)
            for ins in ref.inputs
        ]
        del ref
        memo: dict[Any, list[Operation]] = {}  # identical blocks on identical inputs: one census
        for i, unit in enumerate(split.units):
            then = (lambda r: loss(split.rebuild_output(r))) if i == n - 1 else None
            graph = None if then is not None else _census_key(unit, frozen[i])
            # the roles too: a unit the profiler shards and its replicated look-alike differ
            roles = sharded[i]
            key = None if graph is None else (graph, None if roles is None else roles.kind)
            try:
                ops = memo[key] if key is not None and key in memo else census(
                    unit, frozen[i], then=then, sharded=roles
                )
            except Exception as err:
                raise InputError(
                    f"the operation census of layer {split.names[i]!r} failed on fake tensors at micro-batch "
                    f"size {b}: {type(err).__name__}: {_first_line(err)} -- a fake profile prices times from the "
                    "census: profile this model for real (drop --fake)"
                ) from err
            if key is not None:
                memo[key] = ops
            out[i]["operations"].append(_moe_balanced.mark_expert_operations(ops, unit_experts[i]))
        del frozen
    for i, d in enumerate(out):
        offsets = sorted({k for m in kept[i] for k in m})
        d["kept_inputs"] = [{"offset": k, "bytes": [m.get(k, 0) for m in kept[i]]} for k in offsets] or None
    return out


def _census_key(unit: nn.Module, inputs: Sequence[Any]) -> Any:
    """What a unit's census depends on: its graph with the model tensors it reads replaced by
    their layouts (two blocks of a stack differ only in their parameters' names), and its
    inputs' layouts.  ``None``: cannot tell (a graph calling modules, an unknown input), no memo."""
    graph = getattr(unit, "graph", None)
    if graph is None:
        return None

    def layout(t: Tensor) -> tuple[Any, ...]:
        return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.requires_grad)

    index: dict[Any, int] = {}
    nodes: list[Any] = []

    def arg(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(arg(x) for x in v))
        if isinstance(v, dict):
            return ("dict", tuple((k, arg(x)) for k, x in v.items()))
        if _hashable(v) and v in index:
            return ("node", index[v])
        if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return (type(v).__name__, repr(v))
        raise _NoKey

    try:
        for node in graph.nodes:
            index[node] = len(index)
            if node.op == "call_module":
                return None
            if node.op == "get_attr":
                value = _attr(unit, str(node.target))
                target: Any = layout(value) if isinstance(value, Tensor) else None
                if target is None:
                    return None
            elif node.op in ("call_function", "call_method"):
                target = node.target if isinstance(node.target, str) else _qualified(node.target)
            else:
                target = None  # a placeholder's name is the value's name upstream
            nodes.append((node.op, target, arg(node.args), arg(node.kwargs)))
        values = []
        for v in inputs:
            values.append(layout(v) if isinstance(v, Tensor) else arg(v))
    except _NoKey:
        return None
    return tuple(nodes), tuple(values)


def _qualified(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}:{fn}"


class _NoKey(Exception):
    """A value :func:`_census_key` cannot describe."""


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _experts_by_unit(split: SplitModel, experts: Sequence[_moe_balanced.Experts]) -> list[list[_moe_balanced.Experts]]:
    """The experts modules whose weights each unit holds."""
    out: list[list[_moe_balanced.Experts]] = []
    for unit in split.units:
        held = {id(p) for p in unit.parameters()}
        out.append([x for x in experts if any(id(p) in held for p in x.module.parameters())])
    return out


def _price(
    layers: list[dict[str, Any]], *, device_type: str, constants: DeviceConstants, first_needs_grad: bool
) -> None:
    """Times of every unit and size from its census (the device model)."""
    for i, d in enumerate(layers):
        times = [layer_times(ops, device_type=device_type, constants=constants) for ops in d["operations"]]
        d["forward_ms"] = [t.forward for t in times]
        d["backward_ms"] = [t.backward for t in times]
        if i == 0 and not first_needs_grad:  # as measured: nothing to send back, the whole backward is W
            d["backward_input_ms"] = [0.0 for _ in times]
            d["backward_weight_ms"] = [t.backward for t in times]
        else:
            d["backward_input_ms"] = [t.backward_input for t in times]
            d["backward_weight_ms"] = [t.backward_weight for t in times]


def _moe_fields(
    layers: list[dict[str, Any]],
    split: SplitModel,
    experts: Sequence[_moe_balanced.Experts],
    *,
    capacity_factor: float | None,
    dtype: torch.dtype,
) -> None:
    elem = torch.empty((), dtype=dtype).element_size()
    for d, mine in zip(layers, _experts_by_unit(split, experts), strict=True):
        if not mine:
            continue
        dispatch = []
        for ops in d["operations"]:
            total = 0
            for x in mine:
                slots = _moe_balanced.routed_slots(ops, x)
                if slots is None:
                    raise InputError(
                        f"the census of the layer holding experts {x.name!r} has no expert GEMM: the "
                        "balanced-routing stand-in did not run (profiler/_moe_balanced.py); profile it for real"
                    )
                total += slots * x.hidden * elem
            dispatch.append(total)
        d["moe"] = MoELayer(
            experts=mine[0].experts,
            top_k=mine[0].top_k,
            shared_experts=mine[0].shared_experts,
            expert_param_bytes=sum(x.param_bytes() for x in mine),
            routing="balanced" if capacity_factor is None else "capacity",
            capacity_factor=capacity_factor,
            dispatch_bytes=dispatch,
        )


# --------------------------------------------------------------------------- errors


def _build(make_entry: Callable[[], Entrypoint]) -> Entrypoint:
    try:
        return make_entry()
    except InputError as err:
        found = _data_dependent(err)
        if found is None:
            raise
        raise InputError(
            f"building the model on fake tensors failed: it needs tensor values at {_user_line(found)} "
            f"({type(found).__name__}) -- build it without reading values (no .item() or .tolist() at init), "
            "or profile it for real (drop --fake)"
        ) from err


def _data_dependent(err: BaseException | None) -> BaseException | None:
    """The fake-tensor data-dependence error in ``err``'s chain, if any."""
    kinds = _torch_fake.data_dependent_errors()
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, kinds):
            return err
        err = err.__cause__ or err.__context__
    return None


def _diagnose(model: nn.Module, inputs: Sequence[Tensor], keywords: Sequence[str], loss: Callable[[Any], Tensor]) -> InputError | None:
    """Why the model cannot be profiled on fake tensors, when it is that: one plain training
    step of it on fake tensors, and the module and line that needed tensor values."""
    try:
        out = call_model(model, inputs, keywords)
        loss(out).backward()  # type: ignore[no-untyped-call]
    except Exception as err:
        found = _data_dependent(err)
        if found is None:
            return None
        where = _user_line(found)
        module = _module_of(found, model)
        return InputError(
            f"{type(model).__name__} cannot run on fake tensors: {module} needs tensor values at {where} "
            f"({type(found).__name__}: .item(), .tolist(), a branch on a tensor, nonzero or a boolean mask) -- "
            "profile it for real (drop --fake; with --split-points naming coarser modules if that code sits "
            "between layers), or make that code depend on shapes only"
        )
    finally:
        model.zero_grad(set_to_none=True)
    return None


_SKIP = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)


def _is_user(filename: str) -> bool:
    path = os.path.abspath(filename)
    stdlib = os.path.dirname(os.__file__) + os.sep
    return not (path.startswith(_SKIP) or path.startswith(stdlib) or filename.startswith("<"))


def _user_line(err: BaseException) -> str:
    """``file:line: code`` of the innermost frame outside torch, the profiler and the standard library."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_user(f.filename)]
    if not frames:
        return "an unknown line"
    f = frames[-1]
    path = os.path.relpath(f.filename) if not os.path.relpath(f.filename).startswith("..") else f.filename
    return f"{path}:{f.lineno}" + (f": `{f.line.strip()}`" if f.line else "")


def _module_of(err: BaseException, model: nn.Module) -> str:
    """The innermost module of ``model`` whose own code was running when ``err`` was raised."""
    names = {id(m): n for n, m in model.named_modules()}
    tb = err.__traceback__
    found = None
    while tb is not None:
        frame = tb.tb_frame
        me = frame.f_locals.get("self")
        if isinstance(me, nn.Module) and id(me) in names and _is_user(frame.f_code.co_filename):
            found = me
        tb = tb.tb_next
    if found is None:
        return "its forward"
    name = names[id(found)]
    return f"module {name!r} ({type(found).__name__})" if name else f"the model's own forward ({type(found).__name__})"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


__all__ = ["fake_profile", "pricing_text"]
