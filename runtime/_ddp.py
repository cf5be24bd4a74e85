"""The one place that wraps a pipeline stage in torch's ``DistributedDataParallel`` (needs torch).

``pipeplan run`` reduces the data-parallel gradients of a stage (ZeRO 0/1, T = 1, a schedule
without split backward: :func:`runtime.mesh.gradient_reduction`) with DDP's bucketed all-reduce:
``PipelineStage`` runs every micro-batch but the last under ``no_sync`` and prepares DDP's
reducer for the last one (``backward_maybe_with_nosync``), so each bucket is all-reduced as soon
as its gradients are ready in the last micro-batch's backward, overlapped with the rest of it,
as the planner prices it (``TrainingSetup.gradient_overlap``).

:class:`BucketClock` is a DDP communication hook (public API: ``register_comm_hook``) doing what
DDP's default ``allreduce_hook`` does (divide by the group's size, all-reduce) and recording, per
bucket, when it was launched and when its all-reduce completed (``time.perf_counter``), with the
parameters it holds: the report's exposed and hidden reduction times come from it.

Private name used here: ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
(the parameters DDP leaves to the runtime's own all-reduce: expert-parallel weights, reduced over
another group, and weights shared by two stages of one rank).  :func:`check_private_api` fails
naming it when torch changes it; ``tests/runtime/test_dp_overlap.py`` calls it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: the private attributes this module relies on, checked by :func:`check_private_api`
PRIVATE_API = ("torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",)


def check_private_api() -> None:
    """Raise ``RuntimeError`` naming the private torch API that is missing."""
    from torch.nn.parallel import DistributedDataParallel

    if not callable(getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)):
        import torch

        raise RuntimeError(
            f"torch {torch.__version__} has no {PRIVATE_API[0]}: pipeplan run leaves expert-parallel and "
            "shared weights out of DDP with it (runtime/_ddp.py); use the torch version in constraints/ or "
            "adapt that module"
        )


@dataclass
class BucketEvent:
    """One bucket's all-reduce: ``index`` (DDP's bucket number; 0 holds the gradients ready
    first), the qualified names of its parameters, its bytes, and when it was launched and
    completed on ``time.perf_counter``'s clock."""

    index: int
    names: tuple[str, ...]
    nbytes: int
    launched: float
    done: float | None = None


@dataclass
class BucketClock:
    """The buckets one DDP module reduced, in launch order (:meth:`take` empties it)."""

    names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> its name in the stage
    events: list[BucketEvent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> list[BucketEvent]:
        with self.lock:
            out, self.events = self.events, []
        return out


def _timed_allreduce_hook(state: tuple[Any, BucketClock], bucket: Any) -> Any:
    """DDP's default hook (average over the group: divide, then all-reduce), timed."""
    import torch.distributed as dist

    group, clock = state
    buf = bucket.buffer()
    event = BucketEvent(
        index=bucket.index(),
        names=tuple(clock.names.get(id(p), "?") for p in bucket.parameters()),
        nbytes=buf.numel() * buf.element_size(),
        launched=time.perf_counter(),
    )
    with clock.lock:
        clock.events.append(event)
    buf.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

    def finished(f: Any) -> Any:
        event.done = time.perf_counter()
        return f.value()[0]

    return fut.then(finished)


# DDP checks a hook's annotations against dist.GradBucket and Future; under ``from __future__
# import annotations`` they are strings, which it refuses: it accepts none
_timed_allreduce_hook.__annotations__ = {}


def wrap_ddp(
    module: Any,
    group: Any,
    *,
    bucket_mb: float,
    ignore: Iterable[Any] = (),
    labels: Mapping[int, str] | None = None,
) -> tuple[Any, BucketClock]:
    """``module`` wrapped in ``DistributedDataParallel`` over ``group`` with buckets of
    ``bucket_mb`` MiB, its parameters in ``ignore`` left out (their gradients stay local), and
    the :class:`BucketClock` its hook fills, naming each parameter by ``labels`` (``id`` ->
    label, e.g. its layer; default: its name in ``module``).  Buffers are not synchronised before
    each forward (the runtime never did: replicas start from the same seed)."""
    from torch.nn.parallel import DistributedDataParallel

    check_private_api()
    ignored = {id(p) for p in ignore}
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ignored]
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)  # type: ignore[no-untyped-call]
    clock = BucketClock(names={id(p): (labels or {}).get(id(p), n) for n, p in module.named_parameters()})
    ddp = DistributedDataParallel(module, process_group=group, bucket_cap_mb=bucket_mb, forward_sync_buffers=False)
    ddp.register_comm_hook((group, clock), _timed_allreduce_hook)
    return ddp, clock


@dataclass(frozen=True)
class StepReduction:
    """One step's DDP reductions on one rank (ms): ``busy`` the time some bucket's all-reduce was
    in flight (the union of launch..done), ``exposed`` how long the last completion came after
    the last launch (the last launch is when the backward's last gradient was ready: what the
    step waited for once the backward's compute was done), ``hidden`` = busy - exposed."""

    busy_ms: float
    exposed_ms: float
    buckets: int

    @property
    def hidden_ms(self) -> float:
        return max(0.0, self.busy_ms - self.exposed_ms)


def step_reduction(events: Iterable[BucketEvent]) -> StepReduction:
    """:class:`StepReduction` of one step's bucket events (every DDP module of the rank)."""
    spans = sorted((e.launched, e.done if e.done is not None else e.launched) for e in events)
    if not spans:
        return StepReduction(0.0, 0.0, 0)
    busy, start, end = 0.0, spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > end:
            busy += end - start
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    exposed = max(0.0, max(b for _, b in spans) - max(a for a, _ in spans))
    return StepReduction(busy * 1e3, exposed * 1e3, len(spans))
