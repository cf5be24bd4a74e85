"""Time DTensor's collectives (the tensor-parallel all-reduces and gathers), for the report.

DTensor places its collectives itself, inside the operators of a tensor-parallel unit, in the
forward and in the backward; every one of them goes through
``torch.distributed.tensor._redistribute.redistribute_local_tensor`` (private), which three
modules of ``torch.distributed.tensor`` call by the name they imported.  :func:`timed_redistributions`
wraps it in those modules for the duration of a ``with`` block and adds each call's time to a
counter, waiting for an asynchronous result inside the timed span (on CPU, gloo does not overlap
it with compute anyway).  This module is the only user of that private name;
``tests/runtime/test_mesh_run.py`` fails clearly when torch moves it.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: the modules that call ``redistribute_local_tensor`` by a name of their own
CALLERS = (
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._dispatch",
    "torch.distributed.tensor._api",
)
NAME = "redistribute_local_tensor"


@dataclass
class CollectiveClock:
    """Seconds spent in DTensor redistributions, and how many there were."""

    seconds: float = 0.0
    calls: int = 0


def check_available() -> None:
    """Raise ``RuntimeError`` naming what moved when torch no longer has the wrapped function
    where this module expects it."""
    for name in CALLERS:
        module = importlib.import_module(name)
        if not callable(getattr(module, NAME, None)):
            raise RuntimeError(f"{name}.{NAME} is gone: runtime/_dtensor_timing.py must follow torch")


@contextmanager
def timed_redistributions(clock: CollectiveClock) -> Iterator[CollectiveClock]:
    """Within the block, every DTensor redistribution adds its time to ``clock``."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    check_available()
    modules = [importlib.import_module(name) for name in CALLERS]
    originals = [getattr(m, NAME) for m in modules]
    inner = originals[0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        if isinstance(out, AsyncCollectiveTensor):
            out = out.wait()
        clock.seconds += time.perf_counter() - t0
        clock.calls += 1
        return out

    for m in modules:
        setattr(m, NAME, timed)
    try:
        yield clock
    finally:
        for m, original in zip(modules, originals, strict=True):
            setattr(m, NAME, original)
