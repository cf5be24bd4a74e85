"""Load a model from a ``MODULE:FUNC`` or ``path/to/file.py:FUNC`` entry point.

``FUNC`` takes no arguments and returns ``(model, example_inputs)``,
``(model, example_inputs, loss_fn)`` or ``(model, example_inputs, loss_fn, data)``:

* ``model`` is a ``torch.nn.Module``;
* ``example_inputs`` is a tensor, a tuple/list of tensors (positional arguments), or a dict
  of tensors (keyword arguments, e.g. ``{"input_ids": ids}`` for a Hugging Face model), each
  with a leading batch dimension (the profiler re-slices or repeats them to each micro-batch
  size).  Tensors beyond ``forward``'s positional parameters go to its keyword-only
  parameters in order (``forward(x, *, mask)`` takes ``(x, mask)``);
* ``loss_fn`` is optional: ``loss_fn(output) -> scalar`` sees only the model output;
  ``loss_fn(output, target) -> scalar`` (two required parameters, e.g. ``F.cross_entropy``)
  also gets the targets of its micro-batch from the data.  Without it the loss is
  :func:`default_loss`: ``output.float().mean()`` (for a tuple/list/dict output, the sum of
  that over every floating-point tensor in it).  ``None`` also means the default;
* ``data`` is optional, one of

  - ``data_fn(step, batch_size)``: a function returning the *global* batch of training step
    ``step`` (0, 1, ...).  It must be deterministic in ``(step, batch_size)``: every rank of
    ``pipeplan run`` that needs data calls it for the same step and keeps its own
    data-parallel shard and micro-batches, and the ``--check`` reference calls it again;
  - an iterable of global batches, e.g. a ``torch.utils.data.DataLoader`` whose batch size is
    the plan's global batch size: every rank that needs data iterates its own copy, so it
    must yield the same batches every time (a seeded shuffle);
  - :class:`Loader` ``(make)``: ``make(batch_size)`` returns such an iterable for the batch
    size the plan asks for; ``Loader(make, per_replica=True)``: ``make(batch_size, replica,
    replicas)`` returns the batches of one data-parallel replica (``batch_size`` = global
    batch / replicas), e.g. a ``DataLoader`` with a ``DistributedSampler(dataset, replicas,
    replica)``.

  A *batch* is the model's inputs in the form of ``example_inputs`` (a tensor, a tuple, or a
  dict with the same keys; leading dimension the batch size, otherwise the shapes and dtypes
  of ``example_inputs``) when the loss takes no target, and a pair ``(inputs, targets)``
  (``targets`` one tensor with the same leading dimension) when it does.  Without ``data``
  the runtime trains on synthetic batches shaped like ``example_inputs`` (a loss that takes
  targets needs ``data``).

FUNC must build its data source afresh on every call (the ``--check`` reference calls it
again).  The CLI (``pipeplan profile --model``), the profiler and the runtime all use this
loader.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from planner.errors import InputError

_FORM = "write MODULE:FUNC (e.g. examples.gpt:tiny) or path/to/file.py:FUNC"
_RESULT_FORMS = "(model, example_inputs), (model, example_inputs, loss_fn) or (model, example_inputs, loss_fn, data)"
_DATA_FORMS = (
    "a function data_fn(step, batch_size) returning that step's global batch, an iterable of global "
    "batches (e.g. a torch DataLoader), or Loader(make) / Loader(make, per_replica=True) from runtime.data"
)


def default_loss(output: Any) -> Tensor:
    """The loss used when an entry point gives none: ``output.float().mean()``.

    Tuples, lists and dicts are walked; the means of their floating-point tensors are summed.
    """
    tensors = [t for t in _flatten(output) if isinstance(t, Tensor) and t.is_floating_point()]
    if not tensors:
        raise InputError(
            f"the model output ({type(output).__name__}) holds no floating-point tensor to "
            "build the default loss from: return a loss function as the third element of FUNC's "
            "result, e.g. `return model, inputs, lambda out: out['logits'].mean()`"
        )
    total = tensors[0].float().mean()
    for t in tensors[1:]:
        total = total + t.float().mean()
    return total


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    return [value]


@dataclass(frozen=True)
class Loader:
    """A data source told the batch size the plan asks for (FUNC's fourth element).

    ``make(batch_size)`` returns an iterable of global batches; with ``per_replica=True``,
    ``make(batch_size, replica, replicas)`` returns the batches of data-parallel replica
    ``replica`` of ``replicas`` (``batch_size`` = global batch / replicas).  Import it as
    ``from runtime.data import Loader``.
    """

    make: Callable[..., Iterable[Any]]
    per_replica: bool = False

    def open(self, batch_size: int, replica: int = 0, replicas: int = 1) -> Iterable[Any]:
        """The iterable ``make`` returns for this batch size (and replica)."""
        return self.make(batch_size, replica, replicas) if self.per_replica else self.make(batch_size)


@dataclass(frozen=True)
class Batch:
    """One batch checked against the model: its input tensors, and its targets when the loss takes them."""

    inputs: tuple[Tensor, ...]
    targets: Tensor | None = None

    def tensors(self) -> tuple[Tensor, ...]:
        return self.inputs if self.targets is None else (*self.inputs, self.targets)

    def rows(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` of every tensor."""
        return Batch(
            tuple(t[start:stop] for t in self.inputs), None if self.targets is None else self.targets[start:stop]
        )


@dataclass(frozen=True)
class Entrypoint:
    """What ``FUNC`` returned, checked."""

    model: nn.Module
    #: the model's inputs as one flat tuple, each with a leading batch dimension (a single
    #: tensor is wrapped); the last ``len(keywords)`` of them are keyword arguments
    example_inputs: tuple[Tensor, ...]
    #: ``loss(output) -> scalar`` or, when :attr:`takes_target`, ``loss(output, target)``;
    #: ``None`` means :func:`default_loss`
    loss_fn: Callable[..., Tensor] | None
    spec: str
    #: ``data_fn(step, batch_size)`` -> the global batch of a step (the function form of the data)
    data_fn: Callable[[int, int], Any] | None = None
    #: names of the trailing inputs passed by keyword (``forward(x, *, mask)``, a dict of inputs)
    keywords: tuple[str, ...] = ()
    #: the data when it is not a function: an iterable of global batches, or a :class:`Loader`
    data: Any = None
    #: whether the loss is ``loss(output, target)``: then every batch is ``(inputs, targets)``
    takes_target: bool = False

    @property
    def has_data(self) -> bool:
        """Whether FUNC gives data (else the runtime trains on synthetic batches)."""
        return self.data_fn is not None or self.data is not None

    def loss(self, output: Any, target: Tensor | None = None) -> Tensor:
        """The entry point's loss (with ``target`` when it takes one), or :func:`default_loss`."""
        if self.takes_target:
            if target is None:
                raise InputError(f"the loss of {self.spec!r} takes (output, target) but no target was given")
            assert self.loss_fn is not None
            return self.loss_fn(output, target)
        return (self.loss_fn or default_loss)(output)

    def output_loss(self) -> Callable[[Any], Tensor] | None:
        """A loss of the output alone, for the profiler: the entry point's own, or with targets
        from the data's first batch, re-sliced or repeated to the output's batch size."""
        if not self.takes_target:
            return self.loss_fn
        targets = self.first_batch().targets
        assert targets is not None and self.loss_fn is not None
        loss_fn = self.loss_fn

        def loss(output: Any) -> Tensor:
            n = _leading_size(output, int(targets.shape[0]))
            index = torch.arange(n, device=targets.device) % targets.shape[0]
            target = targets.index_select(0, index)
            device = next((t.device for t in _flatten(output) if isinstance(t, Tensor)), target.device)
            return loss_fn(output, target.to(device))

        return loss

    def first_batch(self) -> Batch:
        """The data's first batch, checked (from a fresh copy: FUNC's own iterable is not touched
        when it can be iterated again; a one-shot iterator loses that batch)."""
        b = int(self.example_inputs[0].shape[0])
        if self.data_fn is not None:
            return call_data(self.data_fn, self.example_inputs, step=0, batch_size=b, spec=self.spec,
                             keywords=self.keywords, takes_target=self.takes_target)  # fmt: skip
        if self.data is None:
            raise InputError(f"{self.spec!r} gives no data: return (model, example_inputs, loss_fn, data)")
        source = self.data.open(b) if isinstance(self.data, Loader) else self.data
        where = f"the first batch of the data of {self.spec!r}"
        try:
            raw = next(iter(source))
        except StopIteration:
            raise InputError(f"the data of {self.spec!r} yields no batch at all") from None
        return check_batch(raw, self.example_inputs, batch_size=None, where=where, keywords=self.keywords,
                           takes_target=self.takes_target)  # fmt: skip

    def call(self, model: nn.Module, inputs: Sequence[Tensor]) -> Any:
        """``model`` on flat ``inputs`` (the form of :attr:`example_inputs`)."""
        return call_model(model, inputs, self.keywords)

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, ...]:
        """The input tensors of ``data_fn(step, batch_size)``, checked against the example inputs.

        Raises :class:`InputError` when there is no data function or it misbehaves.
        """
        if self.data_fn is None:
            raise InputError(f"{self.spec!r} gives no data function: return (model, example_inputs, loss_fn, data_fn)")
        return call_data(
            self.data_fn, self.example_inputs, step=step, batch_size=batch_size, spec=self.spec,
            keywords=self.keywords, takes_target=self.takes_target,
        ).inputs  # fmt: skip


def call_model(model: nn.Module, inputs: Sequence[Tensor], keywords: Sequence[str] = ()) -> Any:
    """``model(*positional, **keyword)`` from flat ``inputs`` whose last ``len(keywords)`` are keywords."""
    n = len(inputs) - len(keywords)
    return model(*inputs[:n], **dict(zip(keywords, inputs[n:], strict=True)))


def model_inputs(
    inputs: Any, model: nn.Module | None = None, *, spec: str = "the example inputs"
) -> tuple[tuple[Tensor, ...], tuple[str, ...]]:
    """Flat input tensors and the keyword names of the trailing ones.

    ``inputs`` is a tensor, a tuple/list of tensors or a dict ``{name: tensor}``.  With the
    ``model``, tensors beyond ``forward``'s positional parameters are bound to its
    keyword-only parameters in order (``forward(x, *, mask)`` takes ``(x, mask)``).
    """
    if isinstance(inputs, Mapping):
        bad = [k for k in inputs if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise InputError(f"{spec}: example_inputs keys must be parameter names, got {bad[0]!r}")
        flat = check_example_inputs(tuple(inputs.values()), spec=spec, names=tuple(inputs))
        if model is not None:
            from profiler.capture import check_bindable

            check_bindable(model, 0, tuple(inputs))
        return flat, tuple(inputs)
    flat = check_example_inputs(inputs, spec=spec)
    if model is None:
        return flat, ()
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return flat, ()
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return flat, ()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keyword_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    extra = len(flat) - len(positional)
    if extra <= 0:
        return flat, ()
    if extra > len(keyword_only):
        names = ", ".join(p.name for p in positional) or "none"
        raise InputError(
            f"{spec}: {len(flat)} example inputs but {type(model).__name__}.forward takes {len(positional)} "
            f"positional parameter(s) ({names}) and {len(keyword_only)} keyword-only: give one tensor per "
            "parameter, or a dict {name: tensor} for keyword arguments"
        )
    return flat, tuple(keyword_only[:extra])


def load_entrypoint(spec: str) -> Entrypoint:
    """Import ``spec`` (``package.module:FUNC`` or ``path/to/file.py:FUNC``), call FUNC, check it."""
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise InputError(f"cannot read model entry point {spec!r}: {_FORM}")
    target, _, func_name = spec.rpartition(":")
    if not target or not func_name.isidentifier():
        raise InputError(f"cannot read model entry point {spec!r}: {_FORM}")
    module = _import_target(target, spec)
    func = getattr(module, func_name, None)
    if func is None:
        public = sorted(
            n
            for n, v in vars(module).items()
            if callable(v)
            and not n.startswith("_")
            and not isinstance(v, type)
            and getattr(v, "__module__", None) == module.__name__
        )
        hint = f"; functions there: {', '.join(public[:20])}" if public else ""
        raise InputError(f"{target!r} has no function {func_name!r} (from {spec!r}){hint}")
    if not callable(func):
        raise InputError(f"{spec!r} is a {type(func).__name__}, not a function: point at a function returning (model, example_inputs)")
    try:
        result = func()
    except InputError:
        raise
    except Exception as err:
        raise InputError(
            f"calling {spec!r} raised {type(err).__name__}: {err} -- FUNC must take no arguments "
            f"and return {_RESULT_FORMS}"
        ) from err
    return check_entrypoint_result(result, spec=spec)


def check_entrypoint_result(result: Any, *, spec: str) -> Entrypoint:
    """Validate what FUNC returned and wrap it in an :class:`Entrypoint`."""
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3, 4):
        got = f"a {len(result)}-element {type(result).__name__}" if isinstance(result, (tuple, list)) else _describe(result)
        raise InputError(f"{spec!r} returned {got}: it must return {_RESULT_FORMS}")
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) >= 3 else None
    data = result[3] if len(result) == 4 else None
    if not isinstance(model, nn.Module):
        raise InputError(
            f"{spec!r} returned {_describe(model)} as the model: the first element must be a torch.nn.Module"
        )
    example_inputs, keywords = model_inputs(inputs, model, spec=spec)
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(
            f"{spec!r} returned {_describe(loss_fn)} as the loss: the third element must be a "
            "function loss(output) or loss(output, target) -> scalar tensor, or None (or leave it out) "
            "for output.float().mean()"
        )
    takes_target = loss_fn is not None and loss_takes_target(loss_fn, spec=spec)
    data_fn = None
    if len(result) == 4:
        if isinstance(data, Loader):
            if not callable(data.make):
                raise InputError(f"{spec!r}: Loader({_describe(data.make)}) needs a function make(batch_size, ...)")
        elif callable(data) and not isinstance(data, nn.Module):
            data_fn, data = data, None
        elif data is None or isinstance(data, (Tensor, str, bytes, Mapping)) or not isinstance(data, Iterable):
            raise InputError(
                f"{spec!r} returned {_describe(data)} as the data: the fourth element must be {_DATA_FORMS}, "
                "or return only (model, example_inputs, loss_fn) for synthetic data"
            )
    if takes_target and data_fn is None and data is None:
        raise InputError(
            f"the loss of {spec!r} takes (output, target) but FUNC returns no data to take the targets from: "
            "return (model, example_inputs, loss_fn, data) with data yielding (inputs, targets) batches, "
            "or give a loss of the output alone"
        )
    if data_fn is not None:
        # one call now, so a data function that does not fit the model fails before any rank starts
        call_data(
            data_fn, example_inputs, step=0, batch_size=int(example_inputs[0].shape[0]), spec=spec,
            keywords=keywords, takes_target=takes_target,
        )  # fmt: skip
    return Entrypoint(
        model=model, example_inputs=example_inputs, loss_fn=loss_fn, spec=spec, data_fn=data_fn, keywords=keywords,
        data=data, takes_target=takes_target,
    )  # fmt: skip


def loss_takes_target(loss_fn: Callable[..., Any], *, spec: str = "the entry point") -> bool:
    """Whether ``loss_fn`` is ``loss(output, target)``: two required positional parameters
    (``loss(output)``: one).  ``F.cross_entropy`` and ``nn.CrossEntropyLoss()`` take a target."""
    try:
        target = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn  # a loss module's call is *args
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        raise InputError(
            f"cannot read the parameters of the loss of {spec!r} ({_describe(loss_fn)}): wrap it in a "
            "def loss(output) or def loss(output, target)"
        ) from None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
    if len(required) > 2:
        names = ", ".join(p.name for p in required)
        raise InputError(
            f"the loss of {spec!r} takes {len(required)} required parameters ({names}): give "
            "loss(output) or loss(output, target), the rest with defaults"
        )
    return len(required) == 2


def call_data_fn(
    data_fn: Callable[[int, int], Any],
    example_inputs: Sequence[Tensor],
    *,
    step: int,
    batch_size: int,
    spec: str = "the entry point",
    keywords: Sequence[str] = (),
) -> tuple[Tensor, ...]:
    """Call ``data_fn(step, batch_size)`` and check its batch (model inputs only) against
    ``example_inputs``; see :func:`call_data`."""
    return call_data(
        data_fn, example_inputs, step=step, batch_size=batch_size, spec=spec, keywords=keywords
    ).inputs


def call_data(
    data_fn: Callable[[int, int], Any],
    example_inputs: Sequence[Tensor],
    *,
    step: int,
    batch_size: int,
    spec: str = "the entry point",
    keywords: Sequence[str] = (),
    takes_target: bool = False,
) -> Batch:
    """Call ``data_fn(step, batch_size)`` and check its batch (:func:`check_batch`).

    An exception inside the data function becomes an :class:`InputError` too.
    """
    call = f"data_fn(step={step}, batch_size={batch_size}) of {spec!r}"
    try:
        raw = data_fn(step, batch_size)
    except InputError:
        raise
    except Exception as err:
        raise InputError(
            f"{call} raised {type(err).__name__}: {err} -- the data function must take (step, batch_size) "
            "and return that step's global batch"
        ) from err
    return check_batch(
        raw, example_inputs, batch_size=batch_size, where=f"{call} returned", keywords=keywords, takes_target=takes_target
    )


def check_batch(
    raw: Any,
    example_inputs: Sequence[Tensor],
    *,
    batch_size: int | None,
    where: str,
    keywords: Sequence[str] = (),
    takes_target: bool = False,
    target_like: Tensor | None = None,
) -> Batch:
    """Check one batch against the model and return its tensors.

    Without ``takes_target`` the batch is the model inputs: a tensor or a tuple/list of
    tensors, one per example input (or, when every input is a keyword argument, a dict with
    the same keys), each of shape ``(batch_size, *example.shape[1:])`` and the example's
    dtype.  With it the batch is a pair ``(inputs, targets)``, ``targets`` one tensor with
    leading dimension ``batch_size`` (and, given ``target_like``, its other dimensions and
    dtype).  ``batch_size`` ``None``: any leading size, the same for every tensor.  Anything
    else is an :class:`InputError` saying what was expected and what came back; ``where``
    names the batch (e.g. ``"data_fn(step=2, batch_size=8) of 'm.py:f' returned"``).
    """
    inputs_raw, targets = raw, None
    if takes_target:
        if not (isinstance(raw, (tuple, list)) and len(raw) == 2 and isinstance(raw[1], Tensor)):
            raise InputError(
                f"{where} {_describe(raw)}; expected a pair (inputs, targets), targets one tensor: the loss "
                "takes (output, target)"
            )
        inputs_raw, targets = raw
    if batch_size is None:
        first = next((t for t in _flatten(inputs_raw) if isinstance(t, Tensor) and t.dim() > 0), None)
        batch_size = int(first.shape[0]) if first is not None else 0
    want = ", ".join(_layout(batch_size, t) for t in example_inputs)
    batch = inputs_raw
    if isinstance(batch, Tensor):
        batch = (batch,)
    if isinstance(batch, Mapping):
        if len(keywords) != len(example_inputs) or set(batch) != set(keywords):
            raise InputError(
                f"{where} a dict with keys {sorted(map(str, batch))}; expected "
                + (f"a dict with keys {sorted(keywords)}" if len(keywords) == len(example_inputs) else "a tuple")
                + f" like the example inputs: {want}"
            )
        batch = tuple(batch[k] for k in keywords)
    labels_hint = (
        "the inputs of the pair (inputs, targets)"
        if takes_target
        else "model inputs only, no labels: a loss(output, target) gets targets from (inputs, targets) batches"
    )
    if not isinstance(batch, (tuple, list)) or not all(isinstance(t, Tensor) for t in batch):
        raise InputError(
            f"{where} {_describe(batch)}; expected a tensor or a tuple of tensors like the "
            f"example inputs: {want} ({labels_hint})"
        )
    if len(batch) != len(example_inputs):
        raise InputError(
            f"{where} {len(batch)} tensor(s) but the model takes {len(example_inputs)} input(s): "
            f"expected {want} ({labels_hint})"
        )
    for i, (got, example) in enumerate(zip(batch, example_inputs, strict=True)):
        expected_shape = (batch_size, *example.shape[1:])
        if tuple(got.shape) != expected_shape or got.dtype != example.dtype:
            raise InputError(
                f"{where} input {i} as {_layout(None, got)}; expected {_layout(batch_size, example)} "
                f"(leading dimension = batch_size, the rest and the dtype as example_inputs[{i}])"
            )
    if targets is not None:
        if targets.dim() == 0 or targets.shape[0] != batch_size:
            raise InputError(
                f"{where} targets of {_layout(None, targets)}; expected a leading dimension of {batch_size} "
                "(one target row per sample, like the inputs)"
            )
        if target_like is not None and (
            targets.shape[1:] != target_like.shape[1:] or targets.dtype != target_like.dtype
        ):
            raise InputError(
                f"{where} targets of {_layout(None, targets)}; expected {_layout(batch_size, target_like)} "
                "like the first batch's targets"
            )
    return Batch(tuple(batch), targets)


def _leading_size(value: Any, default: int) -> int:
    """The leading (batch) dimension of the first tensor in ``value``."""
    first = next((t for t in _flatten(value) if isinstance(t, Tensor) and t.dim() > 0), None)
    return int(first.shape[0]) if first is not None else default


def _layout(batch_size: int | None, t: Tensor) -> str:
    shape = tuple(t.shape) if batch_size is None else (batch_size, *t.shape[1:])
    return f"shape {shape} {str(t.dtype).removeprefix('torch.')}"


def check_example_inputs(
    inputs: Any, *, spec: str = "the example inputs", names: Sequence[str] | None = None
) -> tuple[Tensor, ...]:
    """A tensor or a sequence of tensors, each with a leading batch dimension -> a tuple."""
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not inputs:
        raise InputError(
            f"{spec}: example_inputs is {_describe(inputs)}; give a tensor or a tuple of tensors "
            "with a leading batch dimension, or a dict {name: tensor} of keyword arguments"
        )
    for i, t in enumerate(inputs):
        where = f"example_inputs[{names[i]!r}]" if names else f"example_inputs[{i}]"
        if not isinstance(t, Tensor):
            raise InputError(
                f"{spec}: {where} is {_describe(t)}, not a tensor; give only tensors "
                "(put constants in the model or as forward defaults)"
            )
        if t.dim() == 0:
            raise InputError(
                f"{spec}: {where} is a 0-d tensor ({t.item()!r}); every input needs a "
                "leading batch dimension, e.g. x.unsqueeze(0)"
            )
    batch = {int(t.shape[0]) for t in inputs}
    if len(batch) != 1:
        raise InputError(
            f"{spec}: example inputs have different leading (batch) sizes {sorted(batch)}; give "
            "them all the same batch size"
        )
    return tuple(inputs)


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"a {type(value).__name__} ({text})"


def _import_target(target: str, spec: str) -> ModuleType:
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise InputError(f"model file {target!r} (from {spec!r}) does not exist: check the path")
        name = "_pipeplan_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == path:
            return sys.modules[name]
        file_spec = importlib.util.spec_from_file_location(name, path)
        if file_spec is None or file_spec.loader is None:
            raise InputError(f"cannot import {target!r} (from {spec!r}): is it a Python file?")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[name] = module
        folder = os.path.dirname(path)
        added = folder not in sys.path
        if added:  # as `python path/to/file.py` would: its siblings are importable
            sys.path.insert(0, folder)
        try:
            file_spec.loader.exec_module(module)
        except Exception as err:
            sys.modules.pop(name, None)
            raise InputError(f"importing {target!r} (from {spec!r}) raised {type(err).__name__}: {err}") from err
        finally:
            if added and folder in sys.path:
                sys.path.remove(folder)
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name and (target == err.name or target.startswith(err.name + ".")):
            raise InputError(
                f"no module named {target!r} (from {spec!r}): check the spelling, run from the "
                "directory holding it, or give a file path such as path/to/model.py:FUNC"
            ) from None
        raise InputError(f"importing {target!r} (from {spec!r}) failed: {err}") from err
    except Exception as err:
        raise InputError(f"importing {target!r} (from {spec!r}) raised {type(err).__name__}: {err}") from err


__all__ = ["Batch", "Entrypoint", "Loader", "call_data", "call_data_fn", "call_model", "check_batch", "check_entrypoint_result", "check_example_inputs", "default_loss", "load_entrypoint", "loss_takes_target", "model_inputs"]
