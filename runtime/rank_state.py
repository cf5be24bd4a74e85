"""What one rank holds while it trains: the dataclasses the worker's steps pass on.

:class:`Job` is what :func:`runtime.worker_setup.build_job` builds for the training (flags,
plan, model, where this rank sits); :func:`runtime.stages.join_mesh` turns it into a :class:`RankState`
(the mesh and its groups), :func:`runtime.stages.build_stages` adds the :class:`StageSet`
(this rank's pipeline stages and how their gradients are reduced), :func:`runtime.loop.prepare`
the :class:`Training` (loss, schedule, optimizer, data), and every step appends to the
:class:`StepRecords` that rank 0 gathers (:mod:`runtime.results`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.fault_injection import Fault
from runtime.faults import RankStatus
from runtime.stage_timing import Timings


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


@dataclass
class RankState:
    """The job and this rank's DeviceMesh ``("pp", "dp_replicate", "dp_shard", "tp")``: its
    ``"pp"`` group links the stages of one (replica, tensor-parallel rank), its data axis the
    replicas of one (stage, tensor-parallel rank)."""

    job: Job
    mesh: Any
    pp_group: Any
    dp_group: Any | None  # None for D = 1
    #: the step running now, [step], read by the timing hooks and the test faults
    step_box: list[int]
    streams: Any  # profiler.split.RngStreams: dropout's random streams
    #: the fault this rank injects (None on the others)
    my_fault: Fault | None

    @property
    def plan(self) -> Any:
        return self.job.plan

    @property
    def spec(self) -> Any:
        return self.job.coords.spec


@dataclass
class StageSet:
    """This rank's pipeline stages, as :func:`runtime.stages.build_stages` built them, and how
    their data-parallel gradients are reduced."""

    axes: Any  # runtime.axes.NewAxes: context and expert parallelism
    #: the stage modules as split (before tensor parallelism, FSDP2 and DDP wrapped them)
    modules: list[Any]
    stages: list[Any]  # torch's PipelineStage, one per stage of this rank
    timings: Timings
    #: (process group, parameter) of each tied weight whose copies sit on several pipeline ranks
    tied: list[tuple[Any, Any]]
    #: ids of the tied copies another pipeline rank counts in the gradient norm
    not_mine_in_norm: set[int]
    reduction: Any  # runtime.mesh.GradientReduction
    bucket_mb: float
    clocks: list[Any] = field(default_factory=list)  # one runtime._ddp.BucketClock per DDP stage
    by_ddp: set[int] = field(default_factory=set)  # ids of the parameters DDP reduces
    #: why a parameter of a DDP stage is not DDP's -> their ids
    left_to_us: dict[str, set[int]] = field(default_factory=dict)
    #: a weight by the first layer holding it (a tied embedding: the embedding)
    layer_of: dict[int, str] = field(default_factory=dict)
    #: losses computed vocabulary-parallel (the head's logits sharded, runtime.mesh.vocab_parallel_loss)
    vocab_parallel_losses: int = 0


@dataclass
class Training:
    """What every step uses beyond the stages: built by :func:`runtime.loop.prepare`."""

    schedule: Any
    params: list[Any]  # this rank's parameters, each once
    opt: Any | None  # None when the rank's stages hold no parameter
    #: this rank's parameters by the model's names (a tied weight's copies on this rank: one entry)
    named: list[tuple[str, Any]]
    scaler: Any  # runtime.training.LossScaler
    first_step: int  # > 0 when resumed
    source: Any  # runtime.data.DataSource
    reads: bool  # whether this rank reads data
    data_replica: int
    reader: Any | None
    dummy_target: Any
    log: Any | None  # runtime.steplog.StepLog, rank 0's
    #: DTensor's, FSDP2's and the pipeline's collective clocks (runtime._comm_timing)
    clocks: tuple[Any, Any, Any]
    fsdp: bool  # ZeRO 2/3 over D > 1
    #: the steps whose whole gradients --check keeps (runtime.rank_check.check_grad_steps)
    grad_steps: tuple[int, ...]


@dataclass
class StepRecords:
    """What each step measured on this rank, for the report and the check."""

    step_ms: list[float] = field(default_factory=list)
    #: per step: start on the host's clock, then schedule, data-parallel all-reduce,
    #: tied-weight all-reduce, optimizer (s)
    phases: list[list[float]] = field(default_factory=list)
    comm: list[dict[str, float]] = field(default_factory=list)  # per step: runtime.report.COMM_KEYS
    losses: list[float | None] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: DDP's buckets of the last step that had some, and that step's last backward
    last_buckets: tuple[list[Any], tuple[float, float] | None] = ([], None)
    #: --check: every step's per-tensor gradient norms, and the whole gradients of the first and
    #: last steps (runtime.training.compare), on CPU
    check_norms: dict[int, dict[str, float]] = field(default_factory=dict)
    check_grads: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: the resident set with the model, its stages and the process group built; the peak from then on
    rss_first_step: int | None = None
    #: whether the peak resident set could be reset at the first step (runtime.report.reset_peak_rss)
    peak_in_training: bool = False
