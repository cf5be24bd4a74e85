"""Load a model from a ``MODULE:FUNC`` or ``path/to/file.py:FUNC`` entry point.

``FUNC`` takes no arguments and returns ``(model, example_inputs)``,
``(model, example_inputs, loss_fn)`` or ``(model, example_inputs, loss_fn, data_fn)``:

* ``model`` is a ``torch.nn.Module``;
* ``example_inputs`` is a tensor, a tuple/list of tensors (positional arguments), or a dict
  of tensors (keyword arguments, e.g. ``{"input_ids": ids}`` for a Hugging Face model), each
  with a leading batch dimension (the profiler re-slices or repeats them to each micro-batch
  size).  Tensors beyond ``forward``'s positional parameters go to its keyword-only
  parameters in order (``forward(x, *, mask)`` takes ``(x, mask)``);
* ``loss_fn(output) -> scalar tensor`` is optional.  Without it the loss is
  :func:`default_loss`: ``output.float().mean()`` (for a tuple/list/dict output, the sum of
  that over every floating-point tensor in it).  ``None`` also means the default;
* ``data_fn(step, batch_size) -> tensor | tuple of tensors`` is optional: the *global* batch
  of training step ``step`` (0, 1, ...), i.e. the model's inputs in the form of
  ``example_inputs`` (a tensor, a tuple, or a dict with the same keys) with leading
  dimension ``batch_size`` and otherwise the shapes and dtypes of ``example_inputs``.  It
  must be deterministic in ``(step, batch_size)``: every rank of ``pipeplan run`` calls it
  for the same step and keeps its own data-parallel shard and micro-batches, and the
  ``--check`` reference calls it again.  Without it the runtime trains on synthetic batches
  shaped like ``example_inputs``.

  Targets: the loss sees only the model output, so ``data_fn`` returns model inputs only
  (no labels).  A loss that needs labels must get them from the output (e.g. a last layer
  that computes the loss itself); the pipeline carries no side channel for them.

The CLI (``pipeplan profile --model``), the profiler and the runtime all use this loader.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from planner.errors import InputError

_FORM = "write MODULE:FUNC (e.g. examples.gpt:tiny) or path/to/file.py:FUNC"
_RESULT_FORMS = "(model, example_inputs), (model, example_inputs, loss_fn) or (model, example_inputs, loss_fn, data_fn)"


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
class Entrypoint:
    """What ``FUNC`` returned, checked."""

    model: nn.Module
    #: the model's inputs as one flat tuple, each with a leading batch dimension (a single
    #: tensor is wrapped); the last ``len(keywords)`` of them are keyword arguments
    example_inputs: tuple[Tensor, ...]
    #: ``loss(output) -> scalar``; ``None`` means :func:`default_loss`
    loss_fn: Callable[[Any], Tensor] | None
    spec: str
    #: ``data_fn(step, batch_size)`` -> the global batch of a step; ``None``: synthetic data
    data_fn: Callable[[int, int], Any] | None = None
    #: names of the trailing inputs passed by keyword (``forward(x, *, mask)``, a dict of inputs)
    keywords: tuple[str, ...] = ()

    def loss(self, output: Any) -> Tensor:
        """The entry point's loss, or :func:`default_loss`."""
        return (self.loss_fn or default_loss)(output)

    def call(self, model: nn.Module, inputs: Sequence[Tensor]) -> Any:
        """``model`` on flat ``inputs`` (the form of :attr:`example_inputs`)."""
        return call_model(model, inputs, self.keywords)

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, ...]:
        """``data_fn(step, batch_size)``, checked against the example inputs.

        Raises :class:`InputError` when there is no data function or it misbehaves.
        """
        if self.data_fn is None:
            raise InputError(f"{self.spec!r} gives no data function: return (model, example_inputs, loss_fn, data_fn)")
        return call_data_fn(
            self.data_fn, self.example_inputs, step=step, batch_size=batch_size, spec=self.spec, keywords=self.keywords
        )


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
    data_fn = result[3] if len(result) == 4 else None
    if not isinstance(model, nn.Module):
        raise InputError(
            f"{spec!r} returned {_describe(model)} as the model: the first element must be a torch.nn.Module"
        )
    example_inputs, keywords = model_inputs(inputs, model, spec=spec)
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(
            f"{spec!r} returned {_describe(loss_fn)} as the loss: the third element must be a "
            "function loss(output) -> scalar tensor, or None (or leave it out) for output.float().mean()"
        )
    if len(result) == 4:
        if data_fn is None or not callable(data_fn):
            raise InputError(
                f"{spec!r} returned {_describe(data_fn)} as the data function: the fourth element must "
                "be a function data_fn(step, batch_size) -> tensor or tuple of tensors (the global batch "
                "of that step), or return only (model, example_inputs, loss_fn) for synthetic data"
            )
        # one call now, so a data function that does not fit the model fails before any rank starts
        call_data_fn(
            data_fn, example_inputs, step=0, batch_size=int(example_inputs[0].shape[0]), spec=spec, keywords=keywords
        )
    return Entrypoint(
        model=model, example_inputs=example_inputs, loss_fn=loss_fn, spec=spec, data_fn=data_fn, keywords=keywords
    )


def call_data_fn(
    data_fn: Callable[[int, int], Any],
    example_inputs: Sequence[Tensor],
    *,
    step: int,
    batch_size: int,
    spec: str = "the entry point",
    keywords: Sequence[str] = (),
) -> tuple[Tensor, ...]:
    """Call ``data_fn(step, batch_size)`` and check its batch against ``example_inputs``.

    The batch must be a tensor or a tuple/list of tensors, one per example input (or, when
    every input is a keyword argument, a dict with the same keys), each of
    shape ``(batch_size, *example.shape[1:])`` and the example's dtype.  Anything else (or
    an exception inside the data function) is an :class:`InputError` saying what was
    expected and what came back.
    """
    call = f"data_fn(step={step}, batch_size={batch_size}) of {spec!r}"
    try:
        batch = data_fn(step, batch_size)
    except InputError:
        raise
    except Exception as err:
        raise InputError(
            f"{call} raised {type(err).__name__}: {err} -- the data function must take (step, batch_size) "
            "and return that step's global batch"
        ) from err
    want = ", ".join(_layout(batch_size, t) for t in example_inputs)
    if isinstance(batch, Tensor):
        batch = (batch,)
    if isinstance(batch, Mapping):
        if len(keywords) != len(example_inputs) or set(batch) != set(keywords):
            raise InputError(
                f"{call} returned a dict with keys {sorted(map(str, batch))}; expected "
                + (f"a dict with keys {sorted(keywords)}" if len(keywords) == len(example_inputs) else "a tuple")
                + f" like the example inputs: {want}"
            )
        batch = tuple(batch[k] for k in keywords)
    if not isinstance(batch, (tuple, list)) or not all(isinstance(t, Tensor) for t in batch):
        raise InputError(
            f"{call} returned {_describe(batch)}; expected a tensor or a tuple of tensors like the "
            f"example inputs: {want} (model inputs only; the loss takes no labels)"
        )
    if len(batch) != len(example_inputs):
        raise InputError(
            f"{call} returned {len(batch)} tensor(s) but the model takes {len(example_inputs)} input(s): "
            f"expected {want} (model inputs only; the loss takes no labels)"
        )
    for i, (got, example) in enumerate(zip(batch, example_inputs, strict=True)):
        expected_shape = (batch_size, *example.shape[1:])
        if tuple(got.shape) != expected_shape or got.dtype != example.dtype:
            raise InputError(
                f"{call} returned input {i} as {_layout(None, got)}; expected {_layout(batch_size, example)} "
                f"(leading dimension = batch_size, the rest and the dtype as example_inputs[{i}])"
            )
    return tuple(batch)


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


__all__ = ["Entrypoint", "call_data_fn", "call_model", "check_entrypoint_result", "check_example_inputs", "default_loss", "load_entrypoint", "model_inputs"]
