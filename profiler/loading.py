"""Load a model from a ``MODULE:FUNC`` or ``path/to/file.py:FUNC`` entry point.

``FUNC`` takes no arguments and returns ``(model, example_inputs)`` or
``(model, example_inputs, loss_fn)``:

* ``model`` is a ``torch.nn.Module``;
* ``example_inputs`` is a tensor or a tuple/list of tensors, each with a leading batch
  dimension (the profiler re-slices or repeats them to each micro-batch size);
* ``loss_fn(output) -> scalar tensor`` is optional.  Without it the loss is
  :func:`default_loss`: ``output.float().mean()`` (for a tuple/list/dict output, the sum of
  that over every floating-point tensor in it).

The CLI (``pipeplan profile --model``), the profiler and the runtime all use this loader.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from planner.errors import InputError

_FORM = "write MODULE:FUNC (e.g. examples.gpt:tiny) or path/to/file.py:FUNC"


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
    #: positional model inputs, each with a leading batch dimension (a single tensor is wrapped)
    example_inputs: tuple[Tensor, ...]
    #: ``loss(output) -> scalar``; ``None`` means :func:`default_loss`
    loss_fn: Callable[[Any], Tensor] | None
    spec: str

    def loss(self, output: Any) -> Tensor:
        """The entry point's loss, or :func:`default_loss`."""
        return (self.loss_fn or default_loss)(output)


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
            "and return (model, example_inputs) or (model, example_inputs, loss_fn)"
        ) from err
    return check_entrypoint_result(result, spec=spec)


def check_entrypoint_result(result: Any, *, spec: str) -> Entrypoint:
    """Validate what FUNC returned and wrap it in an :class:`Entrypoint`."""
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise InputError(
            f"{spec!r} returned {_describe(result)}: it must return (model, example_inputs) or "
            "(model, example_inputs, loss_fn)"
        )
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(model, nn.Module):
        raise InputError(
            f"{spec!r} returned {_describe(model)} as the model: the first element must be a torch.nn.Module"
        )
    example_inputs = check_example_inputs(inputs, spec=spec)
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(
            f"{spec!r} returned {_describe(loss_fn)} as the loss: the third element must be a "
            "function loss(output) -> scalar tensor, or leave it out for output.float().mean()"
        )
    return Entrypoint(model=model, example_inputs=example_inputs, loss_fn=loss_fn, spec=spec)


def check_example_inputs(inputs: Any, *, spec: str = "the example inputs") -> tuple[Tensor, ...]:
    """A tensor or a sequence of tensors, each with a leading batch dimension -> a tuple."""
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not inputs:
        raise InputError(
            f"{spec}: example_inputs is {_describe(inputs)}; give a tensor or a tuple of tensors "
            "with a leading batch dimension (keyword arguments: give them defaults in forward)"
        )
    for i, t in enumerate(inputs):
        if not isinstance(t, Tensor):
            raise InputError(
                f"{spec}: example_inputs[{i}] is {_describe(t)}, not a tensor; give only tensors "
                "(put constants in the model or as forward defaults)"
            )
        if t.dim() == 0:
            raise InputError(
                f"{spec}: example_inputs[{i}] is a 0-d tensor ({t.item()!r}); every input needs a "
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


__all__ = ["Entrypoint", "check_entrypoint_result", "check_example_inputs", "default_loss", "load_entrypoint"]
