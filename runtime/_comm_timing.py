"""Time FSDP2's collectives and the pipeline's transfers apart, for the report.

Both run inside ``schedule.step``, so the step's phases cannot separate them:

* **FSDP2** (ZeRO 2/3) gathers a stage's parameters and reduce-scatters its gradients through
  the ``AllGather``/``ReduceScatter`` objects of ``torch.distributed.fsdp._fully_shard.
  _fsdp_collectives`` (private), whose default kinds call ``torch.distributed.all_gather_single``
  and ``torch.distributed.reduce_scatter_single`` by attribute of ``torch.distributed``.
  :func:`timed_fsdp_collectives` replaces those two attributes for the duration of a ``with``
  block and adds each call's time to a clock, waiting for an asynchronous result inside the timed
  span (on CPU, gloo does not overlap it with compute anyway).  Nothing else the runtime runs
  inside the schedule calls them (DTensor uses functional collectives).
* **Pipeline transfers**: ``torch.distributed.pipelining.schedules`` (private) posts every send
  and receive of activations and gradients with its module function ``_batch_p2p`` (also through
  ``_sorted_batch_p2p``) and waits for them with ``_wait_batch_p2p``.  :func:`timed_transfers`
  wraps both: posting time, and the time spent waiting on sends and on receives apart (a batch
  that holds a receive counts as receiving).  A receive's wait includes waiting for the peer to
  finish the compute that produces what it receives, and a send's (gloo) can include waiting for
  the peer to post its receive: upper bounds of the transfers, not their link time.

This module is the only user of those private names; :func:`check_available` raises naming what
moved, and ``tests/runtime/test_comm_timing.py`` fails clearly when torch changes them.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: FSDP2's module whose default collectives call the ``torch.distributed`` functions below
FSDP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
#: (class in FSDP_MODULE, the ``torch.distributed`` function its ``__call__`` calls)
FSDP_CALLS = (("DefaultAllGather", "all_gather_single"), ("DefaultReduceScatter", "reduce_scatter_single"))
#: the pipelining module and its functions that post and wait for sends and receives
PIPELINE_MODULE = "torch.distributed.pipelining.schedules"
POST, WAIT = "_batch_p2p", "_wait_batch_p2p"


@dataclass
class FsdpClock:
    """Seconds FSDP2 spent in parameter all-gathers and gradient reduce-scatters, and their counts."""

    all_gather_s: float = 0.0
    reduce_scatter_s: float = 0.0
    all_gathers: int = 0
    reduce_scatters: int = 0

    @property
    def seconds(self) -> float:
        return self.all_gather_s + self.reduce_scatter_s


@dataclass
class TransferClock:
    """Seconds in the pipeline's point-to-point transfers: posting them, and waiting for sends
    and for receives (a receive's wait includes the peer's compute before it sends)."""

    post_s: float = 0.0
    send_wait_s: float = 0.0
    recv_wait_s: float = 0.0
    posted: int = 0

    @property
    def seconds(self) -> float:
        return self.post_s + self.send_wait_s + self.recv_wait_s


def check_available() -> None:
    """Raise ``RuntimeError`` naming what moved when torch no longer has the functions this
    module wraps where it expects them."""
    import torch.distributed as dist

    fsdp = importlib.import_module(FSDP_MODULE)
    if getattr(fsdp, "dist", None) is not dist:
        raise RuntimeError(f"{FSDP_MODULE} no longer calls torch.distributed as `dist`: runtime/_comm_timing.py must follow torch")
    for cls_name, fn in FSDP_CALLS:
        cls = getattr(fsdp, cls_name, None)
        code = getattr(vars(cls).get("__call__") if isinstance(cls, type) else None, "__code__", None)
        if code is None or fn not in code.co_names or not callable(getattr(dist, fn, None)):
            raise RuntimeError(
                f"{FSDP_MODULE}.{cls_name} no longer calls torch.distributed.{fn}: runtime/_comm_timing.py must follow torch"
            )
    pipe = importlib.import_module(PIPELINE_MODULE)
    for name in (POST, WAIT):
        if not callable(getattr(pipe, name, None)):
            raise RuntimeError(f"{PIPELINE_MODULE}.{name} is gone: runtime/_comm_timing.py must follow torch")


@contextmanager
def _patched(module: Any, replacements: dict[str, Callable[..., Any]]) -> Iterator[None]:
    originals = {name: getattr(module, name) for name in replacements}
    for name, fn in replacements.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


def _waited(out: Any) -> Any:
    if out is not None and hasattr(out, "wait"):
        out.wait()
    return out


@contextmanager
def timed_fsdp_collectives(clock: FsdpClock) -> Iterator[FsdpClock]:
    """Within the block, every FSDP2 all-gather and reduce-scatter adds its time to ``clock``."""
    import torch.distributed as dist

    check_available()
    gather, scatter = (getattr(dist, fn) for _, fn in FSDP_CALLS)

    def timed_gather(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = _waited(gather(*args, **kwargs))
        clock.all_gather_s += time.perf_counter() - t0
        clock.all_gathers += 1
        return out

    def timed_scatter(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = _waited(scatter(*args, **kwargs))
        clock.reduce_scatter_s += time.perf_counter() - t0
        clock.reduce_scatters += 1
        return out

    with _patched(dist, {FSDP_CALLS[0][1]: timed_gather, FSDP_CALLS[1][1]: timed_scatter}):
        yield clock


@contextmanager
def timed_transfers(clock: TransferClock) -> Iterator[TransferClock]:
    """Within the block, the pipeline schedule's sends and receives add their posting and
    waiting times to ``clock``."""
    import torch.distributed as dist

    check_available()
    pipe = importlib.import_module(PIPELINE_MODULE)
    post, wait = getattr(pipe, POST), getattr(pipe, WAIT)
    receives: set[int] = set()  # ids of the works of posted batches holding a receive

    def timed_post(p2p_ops: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        works = post(p2p_ops, *args, **kwargs)
        clock.post_s += time.perf_counter() - t0
        clock.posted += len(p2p_ops)
        if any(op.op is dist.irecv for op in p2p_ops):
            receives.update(id(w) for w in works)
        return works

    def timed_wait(works: Any, *args: Any, **kwargs: Any) -> Any:
        works = list(works)
        recv = any(id(w) in receives for w in works)
        t0 = time.perf_counter()
        out = wait(works, *args, **kwargs)
        if recv:
            clock.recv_wait_s += time.perf_counter() - t0
            receives.difference_update(id(w) for w in works)
        else:
            clock.send_wait_s += time.perf_counter() - t0
        return out

    with _patched(pipe, {POST: timed_post, WAIT: timed_wait}):
        yield clock
