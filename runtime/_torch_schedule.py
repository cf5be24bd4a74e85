"""The one place that touches torch.distributed.pipelining's private schedule API.

``pipeplan run`` executes a plan's per-rank action list (``Plan.actions``, or the schedule's
template from :mod:`planner.schedules`) with torch's own schedule runtime:

* ``gpipe``, ``1f1b`` and ``interleaved-1f1b`` run torch's public classes
  (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) when the plan's list is
  the template those classes compute (``tests/test_schedules_torch.py`` checks they agree);
* every other list (the zero-bubble schedules, ``planned``, a hand-edited list) is loaded into
  ``_PipelineScheduleRuntime`` the way ``_load_csv(path, format="compute_only")`` loads a CSV,
  in memory: ``_Action.from_str`` per cell, then ``_prepare_schedule_with_comms``, which
  validates the lists, takes the stage-to-rank mapping from them (loop or V) and adds the
  sends and receives.

Private names used here: ``_PipelineScheduleRuntime``, ``_PipelineScheduleRuntime.
_prepare_schedule_with_comms``, ``_Action.from_str``, ``pipeline_order`` and
``pipeline_order_with_comms``.  ``tests/runtime/test_torch_schedule.py`` fails naming the one
that moved if torch changes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: the private attributes this module relies on, checked by :func:`check_private_api`
PRIVATE_API = (
    "torch.distributed.pipelining.schedules._PipelineScheduleRuntime",
    "torch.distributed.pipelining.schedules._PipelineScheduleRuntime._prepare_schedule_with_comms",
    "torch.distributed.pipelining.schedules._PipelineScheduleRuntime._load_csv",
    "torch.distributed.pipelining.schedules._Action.from_str",
)

#: schedules run by a public torch class when the plan's list is that class's order
PUBLIC_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}


def check_private_api() -> None:
    """Raise ``RuntimeError`` naming the private torch API that is missing."""
    import importlib

    for path in PRIVATE_API:
        module_name, _, rest = path.partition(".schedules.")
        obj: Any = importlib.import_module(module_name + ".schedules")
        for part in rest.split("."):
            if not hasattr(obj, part):
                raise RuntimeError(
                    f"torch {_torch_version()} has no {path}: pipeplan run executes action lists with it "
                    "(runtime/_torch_schedule.py); use the torch version in constraints/ or adapt that module"
                )
            obj = getattr(obj, part)


def build_schedule(
    schedule: str,
    stages: Sequence[Any],
    actions: Sequence[Sequence[str]],
    template: Sequence[Sequence[str]] | None,
    num_microbatches: int,
    *,
    loss_fn: Callable[..., Any],
) -> tuple[Any, str]:
    """The torch schedule object that runs ``actions`` (one list of action strings per rank,
    e.g. ``["0F0", "0I0", "0W0"]``) over this rank's ``stages``; returns it and the name of
    what runs it.  ``template``: the named schedule's own order (``None`` for ``planned``):
    equal lists of a schedule with a public class run that class.

    Gradients are not scaled (``scale_grads=False``): the caller divides by M once per
    parameter (a weight shared by two stages of one rank would otherwise be divided twice).
    """
    from torch.distributed.pipelining import schedules as ts

    check_private_api()
    same = template is not None and [list(a) for a in actions] == [list(t) for t in template]
    name = PUBLIC_CLASSES.get(schedule)
    if name is not None and same:
        cls = getattr(ts, name)
        if name == "ScheduleInterleaved1F1B":
            return cls(list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=False), name
        return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False), name
    runtime = ts._PipelineScheduleRuntime(  # type: ignore[no-untyped-call]
        list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=False
    )
    order = {rank: [ts._Action.from_str(a) for a in acts] for rank, acts in enumerate(actions)}
    runtime.pipeline_order = order  # what _load_csv(path, format="compute_only") sets from the CSV
    runtime._prepare_schedule_with_comms(order)  # validates, maps stages to ranks, adds send/recv
    return runtime, "_PipelineScheduleRuntime"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
