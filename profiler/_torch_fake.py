"""The private torch APIs of fake-tensor profiles (``pipeplan profile --fake``), in one place.

``tests/profiler/test_fake_profile.py`` checks each of them, so a torch upgrade that moves one
fails there with its name:

* ``torch._subclasses.fake_tensor.FakeTensorMode`` / ``FakeTensor``: tensors with shapes,
  dtypes and strides but no data; every operator runs its meta function (no memory, no time);
* ``UntypedStorage._cdata``: the identity of a storage (fake storages have no data pointer:
  ``data_ptr()`` is 0 for all of them), so that saved tensors are still counted once each;
* the exceptions fake tensors raise where a forward needs the data
  (``DataDependentOutputException``: ``.item()``, ``torch.equal``, ``.tolist()``;
  ``DynamicOutputShapeException``: ``nonzero``, boolean masks, ``unique``), which the fake
  profile turns into an error naming the user's line.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def fake_mode() -> Any:
    """A fresh fake-tensor mode: inside it, factories and modules make fake tensors (CPU device)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (a parameter holding one included)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or (isinstance(t, Tensor) and isinstance(getattr(t, "data", None), FakeTensor))


def storage_key(t: Tensor) -> int:
    """An identity of ``t``'s storage, shared by its views: its data pointer for a real tensor,
    the storage object's address for a fake one (whose data pointer is 0)."""
    storage = t.untyped_storage()
    if is_fake(t):
        return int(storage._cdata)
    return int(storage.data_ptr())


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What a forward raises on fake tensors where it needs the data (``.item()``, ``nonzero``)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    out: list[type[BaseException]] = [DataDependentOutputException, DynamicOutputShapeException]
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        out.append(GuardOnDataDependentSymNode)
    except ImportError:  # pragma: no cover - older torch
        pass
    return tuple(out)


__all__ = ["data_dependent_errors", "fake_mode", "is_fake", "storage_key"]
