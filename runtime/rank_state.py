"""What one rank holds while it trains: the dataclasses the worker's steps pass on.

:class:`Job` is what :func:`runtime.worker._run` hands to the training (flags, plan, model,
where this rank sits).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.fault_injection import Fault
from runtime.faults import RankStatus


@dataclass
class Progress:
    """Last sign of life of the main thread, for the watchdog."""

    beat: float = field(default_factory=time.monotonic)
    done: bool = False
    #: False until the first step: start-up (imports, model building, rendezvous) gets longer
    training: bool = False


@dataclass(frozen=True)
class Coords:
    """Where this rank sits in the plan's mesh, and the tensor-parallel shardings to apply."""

    rank: int
    world: int
    pp_rank: int
    replica: int
    tp_rank: int
    spec: Any  # runtime.mesh.MeshSpec
    shardings: Any  # unit index -> runtime.mesh.UnitSharding


@dataclass
class Job:
    """One rank's job, as the worker read it: flags, plan, model (split), place and devices."""

    args: argparse.Namespace
    plan: Any  # planner.schema.Plan
    entry: Any  # profiler.loading's entry point
    split: Any  # profiler.split's split model
    coords: Coords
    my_stages: list[int]
    device: Any  # torch.device
    backend: str
    opts: Any  # runtime.training.TrainOptions
    fault: Fault | None  # --inject-fault, whichever rank it names
    status: RankStatus
    progress: Progress
    rss_before_model: int | None = None
