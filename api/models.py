"""Request and response bodies.  They compose the contracts of :mod:`planner.schema`."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.limits import MAX_DEVICES, MAX_LAYERS, MAX_MICROBATCHES
from planner.schema import (
    Cluster,
    Plan,
    PlanOptions,
    Profile,
    Schedule,
    StageRange,
    SweepSpec,
    TrainingSetup,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlanRequest(_Body):
    """What to plan: a profile, the cluster, the training setup, and decisions you fix."""

    profile: Profile
    cluster: Cluster
    training: TrainingSetup = Field(default_factory=TrainingSetup)
    options: PlanOptions | None = None


class SweepRequest(_Body):
    """What-if planning: one profile and training setup on each point of ``sweep`` (device
    counts times device types or memories).  ``options`` fix decisions at every point; their
    time limit is replaced by ``sweep.time_limit_s`` per point."""

    profile: Profile
    training: TrainingSetup = Field(default_factory=TrainingSetup)
    sweep: SweepSpec
    options: PlanOptions | None = None


class PlanResponse(_Body):
    id: str = Field(description="fetch the plan again at /v1/plans/{id}")
    cached: bool = Field(description="true when an identical request was solved before")
    request_sha256: str = Field(description="content hash of the canonical request (the cache key)")
    created_at: dt.datetime
    time_limit_s: float = Field(description="solver time limit used, after the server's cap")
    plan: Plan


class EstimateRequest(_Body):
    """A fully specified split for the cost model (arguments of ``planner.cost.estimate``)."""

    profile: Profile
    cluster: Cluster
    training: TrainingSetup = Field(default_factory=TrainingSetup)
    stages: list[StageRange] = Field(
        min_length=1, max_length=MAX_LAYERS, description="[start, stop) layer ranges, in order"
    )
    num_microbatches: int = Field(ge=1, le=MAX_MICROBATCHES)
    schedule: Schedule = "1f1b"
    recompute: bool | Annotated[list[bool], Field(max_length=MAX_LAYERS)] = False
    recompute_layers: Annotated[list[Annotated[int, Field(ge=0, le=MAX_LAYERS)] | None], Field(max_length=MAX_LAYERS)] | None = Field(
        default=None,
        description="per stage, how many of its first layers are checkpointed (null: all of a recomputing stage's)",
    )
    data_parallel: int = Field(default=1, ge=1, le=MAX_DEVICES)
    pipeline_degree: int | None = Field(default=None, ge=1, le=MAX_DEVICES)
    devices: (
        Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0, lt=MAX_DEVICES)]], Field(max_length=MAX_DEVICES)]],
            Field(max_length=MAX_LAYERS),
        ]
        | None
    ) = Field(default=None, description="device index of each data-parallel replica, per stage")
    tensor_parallel: int = Field(default=1, ge=1, le=MAX_DEVICES, description="tensor-parallel degree T")
    zero_stage: Literal[0, 1, 2, 3] = 0
    sequence_parallel: bool = False
    selective_recompute: bool = False
    context_parallel: int = Field(default=1, ge=1, le=MAX_DEVICES, description="context-parallel degree C")
    context_attention: Literal["all-gather", "ring"] = "all-gather"
    expert_parallel: int = Field(default=1, ge=1, le=MAX_DEVICES, description="expert-parallel degree E")


class ErrorEntry(BaseModel):
    loc: str
    msg: str
    input: Any = None


class ErrorBody(BaseModel):
    error: Literal[
        "invalid_request", "infeasible", "unauthorized", "not_found", "too_large", "busy", "timeout", "internal"
    ]
    message: str
    errors: list[ErrorEntry] | None = None
    details: dict[str, Any] | None = None


class DevicePresetOut(BaseModel):
    memory_bytes: int
    peak_flops: dict[str, float]
    memory_bandwidth_bytes_per_s: float
    devices_per_node: int
    intra_node: str
    inter_node: str
    source: str


class InterconnectPresetOut(BaseModel):
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str


class Presets(BaseModel):
    devices: dict[str, DevicePresetOut]
    interconnects: dict[str, InterconnectPresetOut]
    optimizers: dict[str, float] = Field(description="optimizer state bytes per parameter byte")


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    solves_running: int
