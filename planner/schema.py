"""The data contracts: profile, cluster, training setup, plan options and plan.

One definition each.  The CLI, the API (request and response bodies, OpenAPI) and
``pipeplan schema`` all use these classes.  Documents are versioned with
``schema_version``; a reader migrates older versions it knows (profile and plan versions
1 and 2: see :func:`_migrate_v1` and :func:`_migrate_v2`) and refuses the others.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    model_serializer,
    model_validator,
)

from planner.errors import InputError
from planner.limits import (
    MAX_DEVICES,
    MAX_FILE_BYTES,
    MAX_GLOBAL_BATCH,
    MAX_LAYER_MS,
    MAX_LAYERS,
    MAX_MEMORY_BYTES,
    MAX_MICROBATCHES,
    MAX_TIME_LIMIT_S,
    check_cluster_data,
    check_plan_data,
    check_profile_data,
    check_report_data,
    check_sweep_data,
    loads_strict,
    too_large,
)
from planner.presets import (
    DEVICES,
    INTERCONNECTS,
    OPTIMIZER_STEP_TEMPORARIES,
    OPTIMIZERS,
    unknown_preset,
)
from planner.units import parse_bytes

SCHEMA_VERSION: Literal[5] = 5
#: versions a reader accepts (older ones are migrated when read)
READABLE_VERSIONS = (1, 2, 3, 4, 5)

Schedule = Literal[
    "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev", "interleaved-zb", "planned"
]
#: every schedule, in the order the CLI lists them (``planner/schedules.py`` defines their orders)
SCHEDULES: tuple[Schedule, ...] = (
    "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev", "interleaved-zb", "planned"
)
#: chunks (stages) per device each schedule runs: exactly 1, exactly 2, or any number ("n")
SCHEDULE_CHUNKS: Mapping[Schedule, Literal["1", "2", "n"]] = MappingProxyType({
    "gpipe": "1", "1f1b": "1", "interleaved-1f1b": "n", "zb-h1": "1", "zb-h2": "1", "zbv": "2",
    "dualpipev": "2", "interleaved-zb": "n", "planned": "1",
})
#: where a pipeline's stages live: ``loop`` (stage s on rank s mod K), ``v`` (rank r holds
#: stages r and 2K-1-r) or ``contiguous`` (rank r holds stages r·v .. r·v+v-1)
Placement = Literal["loop", "v", "contiguous"]
PLACEMENTS: tuple[Placement, ...] = ("loop", "v", "contiguous")
#: each schedule's placement
SCHEDULE_PLACEMENT: Mapping[Schedule, Placement] = MappingProxyType({
    s: ("v" if s in ("zbv", "dualpipev") else "loop") for s in SCHEDULES
})




NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]
Bytes = Annotated[
    int,
    BeforeValidator(parse_bytes),
    Field(ge=0, description="bytes: an integer or a string such as '80GiB' or '141GB'"),
    PlainSerializer(int),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- profile


class MeasuredOn(_Model):
    """Where and how a profile was measured."""

    device: str = Field(
        description="device kind: 'cpu', 'cuda', 'synthetic:<preset>' (formulas: pipeplan synth) or "
        "'fake:<preset>' (traced on fake tensors: pipeplan profile --fake)"
    )
    device_name: str = ""
    dtype: str = "float32"
    num_threads: PosInt | None = Field(default=None, description="torch intra-op threads, CPU")
    torch_version: str | None = None
    pricing: str | None = Field(
        default=None,
        description="what priced the times when nothing was measured: the device model, its device "
        "preset and constants (synth and fake-tensor profiles); absent: measured",
    )


#: how a layer shards over a tensor-parallel group (``LayerProfile.tensor_parallel``)
TensorParallelKind = Literal["replicated", "block", "vocab-embedding", "column-head", "column", "row"]


class KeptInput(_Model):
    """Bytes of a stage's input tensors that the stage keeps for backward (see ``LayerProfile``)."""

    offset: NonNegInt = Field(description="counts when the stage holds layer index + offset")
    bytes: list[int] = Field(
        description="per micro-batch size (parallel to microbatch_sizes); negative when the input "
        "arrives smaller than the tensor activation_bytes counted (a slice of a larger one)"
    )


#: what an operation of the census is (``Operation.kind``)
OperationKind = Literal["gemm", "attention", "memory"]
#: which of an operation's dimensions a tensor-parallel group of T divides (``Operation.tp_shard``)
OperationShard = Literal["n", "k", "heads", "bytes"]


class Operation(_Model):
    """One kind of operation a layer's forward runs at one micro-batch size (the operation census).

    ``gemm``: ``count`` x ``batch`` matrix products C[m, n] = A[m, k] B[k, n]; by convention ``m``
    is the token dimension (it grows with the micro-batch).  ``attention``: scaled dot-product
    attention over ``batch`` sequences of ``heads`` heads, ``query_len`` x ``key_len`` scores of
    ``head_dim``; ``fused`` when the scores never reach memory (flash attention).  ``memory``: a
    memory-bound operation (norm, activation function, dropout, residual add, softmax) moving
    ``bytes`` (read + written).  The backward is derived from the forward
    (:mod:`planner.cost.compute`).  ``tp_shard``: the dimension a tensor-parallel group divides
    (column-parallel: n, row-parallel: k, attention: heads; ``heads`` on a batched GEMM divides
    its batch of sequences x heads, materialised attention's products); absent: replicated
    (``bytes``: divided only under sequence parallelism)."""

    kind: OperationKind
    count: PosInt = 1
    dtype: str = "bfloat16"
    m: PosInt | None = None
    n: PosInt | None = None
    k: PosInt | None = None
    batch: PosInt = 1
    heads: PosInt | None = None
    query_len: PosInt | None = None
    key_len: PosInt | None = None
    head_dim: PosInt | None = None
    kv_heads: PosInt | None = Field(
        default=None, description="attention's key/value heads (grouped-query attention; absent: heads)"
    )
    causal: bool = False
    fused: bool = True
    bytes: NonNegInt | None = None
    tp_shard: OperationShard | None = None
    expert: bool | None = Field(
        default=None,
        description="a routed expert's operation (a mixture-of-experts layer): ``count`` experts' "
        "GEMMs of the tokens routed to each; expert parallelism divides ``count``",
    )

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: Callable[[Any], Any]) -> Any:
        """Written without the fields the kind does not use (a census has hundreds of entries)."""
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _fields_of_kind(self) -> Operation:
        need = {
            "gemm": ("m", "n", "k"),
            "attention": ("heads", "query_len", "key_len", "head_dim"),
            "memory": ("bytes",),
        }[self.kind]
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.kind} operation needs {', '.join(missing)}")
        return self


#: how tokens are assumed to reach a mixture-of-experts layer's experts (``MoELayer.routing``)
MoERouting = Literal["balanced", "capacity"]


class MoELayer(_Model):
    """A mixture-of-experts layer's experts (``LayerProfile.moe``).

    The layer's ``param_bytes`` include every routed expert's weights; ``expert_param_bytes`` is
    their part (expert parallelism shards it, the rest of the layer keeps its data- and
    tensor-parallel sharding).  FLOPs, times and activations are those of the routed tokens at
    ``top_k``: with ``routing`` "balanced" every expert receives tokens·top_k/experts of them;
    with "capacity" every expert processes ``capacity_factor`` times that (Switch Transformer's
    capacity, dropped tokens and padding included)."""

    experts: PosInt = Field(description="routed experts")
    top_k: PosInt = Field(description="experts each token is routed to")
    shared_experts: NonNegInt = Field(default=0, description="experts every token passes through (not routed)")
    expert_param_bytes: NonNegInt = Field(description="the routed experts' parameter bytes (all of them)")
    routing: MoERouting = "balanced"
    capacity_factor: PosFloat | None = Field(
        default=None, description="with routing 'capacity': tokens per expert over the balanced share"
    )
    dispatch_bytes: list[NonNegInt] = Field(
        description="per micro-batch size: the bytes of routed tokens one forward sends to the experts "
        "(tokens x top_k x hidden x dtype bytes); the combine returns as many"
    )

    @model_validator(mode="after")
    def _routing(self) -> MoELayer:
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} is more than the {self.experts} experts")
        if (self.routing == "capacity") != (self.capacity_factor is not None):
            raise ValueError(
                "routing 'capacity' needs a capacity_factor and 'balanced' takes none "
                f"(got routing {self.routing!r}, capacity_factor {self.capacity_factor})"
            )
        return self


class LayerProfile(_Model):
    """One executable unit of the model.  Lists are parallel to ``Profile.microbatch_sizes``."""

    name: str = Field(min_length=1)
    param_bytes: NonNegInt = Field(description="shared weights are counted once, on the owner")
    forward_ms: list[NonNegFloat]
    backward_ms: list[NonNegFloat]
    activation_bytes: list[NonNegInt] = Field(description="kept for backward by this layer")
    output_bytes: list[NonNegInt] = Field(
        description="sent to the next stage by a cut right after this layer (gradients of the "
        "same size come back)"
    )
    cut_bytes: list[NonNegInt] | None = Field(
        default=None,
        description="all bytes crossing a cut right after this layer, skip connections "
        "included; defaults to output_bytes",
    )
    forward_ms_spread: list[NonNegFloat] | None = Field(
        default=None, description="run-to-run spread (interquartile range) of forward_ms"
    )
    backward_ms_spread: list[NonNegFloat] | None = None
    backward_input_ms: list[NonNegFloat] | None = Field(
        default=None,
        description="the part of backward_ms that computes the input gradient (I); zero-bubble "
        "schedules run it apart from the weight gradient.  Default: backward_ms - "
        "backward_weight_ms when that is given, else half of backward_ms",
    )
    backward_weight_ms: list[NonNegFloat] | None = Field(
        default=None,
        description="the part of backward_ms that computes the weight gradient (W).  Default: "
        "backward_ms - backward_input_ms when that is given, else half of backward_ms",
    )
    weight_grad_bytes: list[NonNegInt] | None = Field(
        default=None,
        description="bytes still held between the input-gradient and the weight-gradient pass "
        "(what W needs: inputs of the weight layers and their output gradients).  Default: "
        "activation_bytes (the input-gradient pass frees nothing)",
    )
    peak_memory_bytes: list[NonNegInt] | None = Field(
        default=None, description="CUDA max_memory_allocated during this layer, for cross-checks"
    )
    flops: list[NonNegFloat] | None = None
    kind: str | None = Field(default=None, description="module type, informational")
    kept_inputs: list[KeptInput] | None = Field(
        default=None,
        description="what a stage starting at this layer keeps of its own inputs for backward, beyond "
        "activation_bytes (which counts each saved tensor once, on the first layer that saves it); "
        "each entry counts once the stage reaches layer index + offset",
    )

    tensor_parallel: TensorParallelKind = Field(
        default="replicated",
        description="how the layer shards over a tensor-parallel group of T devices (Megatron style): "
        "'block' (a transformer block: column-parallel QKV and first MLP linear, row-parallel "
        "output and second MLP linear), 'vocab-embedding' (vocabulary-parallel embedding), "
        "'column-head' (column-parallel LM head), 'column' / 'row' (one linear); 'replicated': T "
        "divides nothing, every device of the group runs all of it",
    )
    tp_param_bytes: NonNegInt | None = Field(
        default=None,
        description="the part of param_bytes that shards over T (default: all of it when the layer "
        "shards); the rest (norms, a row-parallel bias) stays replicated",
    )
    tp_compute_fraction: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = Field(
        default=None,
        description="the share of forward and backward time that divides by T (matrix products, "
        "attention); the rest (norms, dropout, residual) divides by T only under sequence "
        "parallelism.  Default: 1 when the layer shards",
    )
    tp_forward_bytes: list[NonNegInt] | None = Field(
        default=None,
        description="bytes the tensor-parallel collectives of one forward move per micro-batch, "
        "summed over the collectives (a block: 2 all-reduces of b x s x h elements; with sequence "
        "parallelism the same bytes go as reduce-scatter + all-gather)",
    )
    tp_backward_bytes: list[NonNegInt] | None = Field(
        default=None, description="the same for one backward (default: tp_forward_bytes)"
    )
    tp_forward_collectives: NonNegInt = Field(
        default=2, description="collectives per forward (their latency), when the layer shards"
    )
    tp_backward_collectives: NonNegInt = Field(default=2, description="collectives per backward")
    tp_replicated_activation_bytes: list[NonNegInt] | None = Field(
        default=None,
        description="the part of activation_bytes every device of the group keeps whole without "
        "sequence parallelism (norm inputs, dropout masks: Korthikanti et al.'s 10·s·b·h per "
        "block); the rest divides by T.  Default: 0",
    )
    sp_replicated_activation_bytes: list[NonNegInt] | None = Field(
        default=None,
        description="the part of activation_bytes that stays replicated even with sequence "
        "parallelism (default: 0: a Megatron block shards all of it)",
    )
    forward_not_recomputed_ms: list[NonNegFloat] | None = Field(
        default=None,
        description="the part of forward_ms that a recompute in the backward does not repeat, per "
        "micro-batch size (default: none).  The planner writes it for ZeRO-3, whose forward waits on "
        "each layer's parameter all-gather: FSDP2's pre-backward hook gathers the parameters before "
        "a checkpointed layer re-runs its forward, so the recompute finds them gathered",
    )
    selective_recompute_bytes: list[NonNegInt] | None = Field(
        default=None,
        description="activation bytes Megatron's selective recompute does not keep (attention's "
        "softmax, its dropout mask and output: 5·a·s²·b per block), recomputed in the backward",
    )
    selective_recompute_ms: list[NonNegFloat] | None = Field(
        default=None,
        description="time to recompute them (attention's score, softmax and dropout forward)",
    )
    operations: list[list[Operation]] | None = Field(
        default=None,
        description="the operation census: per micro-batch size, the operations of one forward "
        "(GEMMs with m, n, k; attention; memory-bound bytes), recorded by the profiler or written by "
        "synth; the device model (planner.cost.compute) prices them for shapes and devices that were "
        "not measured.  Absent in profiles made before schema version 4",
    )
    moe: MoELayer | None = Field(
        default=None, description="the layer's routed experts, when it is a mixture-of-experts layer"
    )

    @property
    def shards(self) -> bool:
        """True when tensor parallelism divides this layer."""
        return self.tensor_parallel != "replicated"

    def transfer_bytes(self) -> list[int]:
        """Bytes a cut right after this layer moves (skip connections included)."""
        return self.cut_bytes if self.cut_bytes is not None else self.output_bytes

    @model_validator(mode="after")
    def _experts_within_params(self) -> LayerProfile:
        if self.moe is not None and self.moe.expert_param_bytes > self.param_bytes:
            raise ValueError(
                f"layer {self.name!r}: moe.expert_param_bytes {self.moe.expert_param_bytes} is more than "
                f"the layer's param_bytes {self.param_bytes} (they include the experts)"
            )
        return self


_PARALLEL_FIELDS = (
    "forward_ms",
    "backward_ms",
    "activation_bytes",
    "output_bytes",
    "cut_bytes",
    "forward_ms_spread",
    "backward_ms_spread",
    "backward_input_ms",
    "backward_weight_ms",
    "weight_grad_bytes",
    "peak_memory_bytes",
    "flops",
    "tp_forward_bytes",
    "tp_backward_bytes",
    "tp_replicated_activation_bytes",
    "sp_replicated_activation_bytes",
    "selective_recompute_bytes",
    "selective_recompute_ms",
    "forward_not_recomputed_ms",
    "operations",
)


# --------------------------------------------------------------------------- calibration


class LayerCalibration(_Model):
    """How ``pipeplan calibrate`` scaled one layer's times (``Calibration.layers``)."""

    forward_scale: PosFloat = Field(description="calibrated / profiled forward time (1: the profiled figure)")
    backward_scale: PosFloat = Field(description="calibrated / profiled backward time")
    stages_seen: NonNegInt = Field(
        default=0,
        description="timed stages of the runs that held this layer (0: no run timed it, the profiled figure is kept)",
    )


class LinkCalibration(_Model):
    """A link fitted to measured transfers and collectives: time = bytes / bandwidth + latency."""

    bandwidth_bytes_per_s: PosFloat
    latency_s: NonNegFloat
    transfers: NonNegInt = Field(default=0, description="point-to-point transfers the fit used")
    collectives: NonNegInt = Field(default=0, description="all-reduces the fit used")
    source: str = Field(default="", description="what was fitted and what was kept from the cluster")


class CalibrationRun(_Model):
    """One run report a calibration learned from, predicted before and after."""

    report: str = Field(description="the report file")
    plan: str = Field(description="schedule, K, D, M and stages of the run")
    measured_step_ms: NonNegFloat
    predicted_before_ms: NonNegFloat = Field(description="the profile's prediction, before calibrating")
    predicted_after_ms: NonNegFloat = Field(description="the calibrated profile's prediction")


#: a fraction of peak in (0, 1] (the device model's constants)
PeakFraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
#: the device model's constants that calibration may fit (``planner.cost.compute.DeviceConstants``)
DeviceConstantName = Literal["gemm_efficiency", "memory_efficiency"]


class DeviceConstantsCalibration(_Model):
    """The device model's constants ``pipeplan calibrate`` fitted for a profile whose times the
    device model priced from the census (synth and fake-tensor profiles;
    ``Calibration.device_constants``).  The layer times are re-priced with them; the profiled
    constants are kept so that the re-pricing can be undone."""

    device_type: str = Field(description="the device preset the constants describe")
    gemm_efficiency: PeakFraction = Field(description="fitted (or kept: see fitted) GEMM efficiency")
    memory_efficiency: PeakFraction = Field(description="fitted (or kept: see fitted) memory efficiency")
    fitted: list[DeviceConstantName] = Field(
        default_factory=list, description="the constants the runs determined; the others are the profile's"
    )
    profiled_gemm_efficiency: PeakFraction = Field(description="the constant the profile was priced with")
    profiled_memory_efficiency: PeakFraction = Field(description="the constant the profile was priced with")
    profiled_pricing: str | None = Field(default=None, description="the profile's measured_on.pricing before")
    stages: NonNegInt = Field(default=0, description="timed stage observations the fit used")
    derived: list[str] = Field(
        default_factory=list,
        description="layer figures ('layer.field') that were not their census's price at the profiled constants "
        "(derived from the forward, like synth's embedding backward): re-priced with their layer's forward",
    )


class Calibration(_Model):
    """What ``pipeplan calibrate`` learned from run reports, and where each figure came from.

    The profile's layer times are already scaled (``layers[i]`` says by how much: the profiled
    figure is ``forward_ms / forward_scale``; when ``device_constants`` is set, the layers were
    first re-priced from the census with those constants, and the factors apply on top).  The
    cost model adds ``step_overhead_ms`` to
    every step; a cluster built from command-line flags for ``device_type`` devices uses the
    fitted ``intra_node`` / ``inter_node`` links unless a link is given.
    """

    device_type: str | None = Field(default=None, description="the device kind of the runs' clusters")
    step_overhead_ms: NonNegFloat = Field(default=0.0, description="fixed cost of every step (optimizer, launch)")
    step_overhead_source: str = ""
    intra_node: LinkCalibration | None = None
    inter_node: LinkCalibration | None = None
    layers: list[LayerCalibration] = Field(description="one per profile layer, in order")
    runs: list[CalibrationRun] = Field(min_length=1)
    method: str = Field(default="", description="how the factors were fitted")
    device_constants: DeviceConstantsCalibration | None = Field(
        default=None,
        description="the device model's constants fitted to the runs, when the device model priced the "
        "profile (absent: a measured profile, or nothing was fitted)",
    )
    device_constants_source: str = Field(
        default="", description="what was fitted of the device model's constants, and why the rest was kept"
    )


class Profile(_Model):
    """A traced model: per-layer costs at several micro-batch sizes."""

    schema_version: Literal[5] = SCHEMA_VERSION
    model: str = Field(min_length=1)
    measured_on: MeasuredOn
    microbatch_sizes: list[PosInt] = Field(min_length=1)
    input_bytes: list[NonNegInt] | None = Field(
        default=None, description="bytes of the model input per micro-batch, parallel list"
    )
    layers: list[LayerProfile] = Field(min_length=1)
    split_points: list[str] = Field(
        default_factory=list,
        description="module names the model was cut before (pipeplan profile --split-points); empty: every block",
    )
    metadata: dict[str, Any] = Field(default_factory=dict)
    calibration: Calibration | None = Field(
        default=None, description="what pipeplan calibrate learned from runs (absent: as profiled)"
    )

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        return _migrate_v4(_migrate_v3(_migrate_v2(_migrate_v1("profile", data))))

    @model_validator(mode="after")
    def _check_shapes(self) -> Profile:
        sizes = self.microbatch_sizes
        if any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"microbatch_sizes must be strictly increasing, got {sizes}")
        n = len(sizes)
        if self.input_bytes is not None and len(self.input_bytes) != n:
            raise ValueError(
                f"input_bytes has {len(self.input_bytes)} entries but microbatch_sizes has {n}"
            )
        names: set[str] = set()
        for i, layer in enumerate(self.layers):
            if layer.name in names:
                raise ValueError(f"layers[{i}].name {layer.name!r} is used twice: names must be unique")
            names.add(layer.name)
            for field in _PARALLEL_FIELDS:
                values = getattr(layer, field)
                if values is not None and len(values) != n:
                    raise ValueError(
                        f"layers[{i}].{field} has {len(values)} entries but microbatch_sizes "
                        f"{sizes} has {n}: give one value per measured micro-batch size"
                    )
            if layer.moe is not None and len(layer.moe.dispatch_bytes) != n:
                raise ValueError(
                    f"layers[{i}].moe.dispatch_bytes has {len(layer.moe.dispatch_bytes)} entries but "
                    f"microbatch_sizes {sizes} has {n}: give one value per measured micro-batch size"
                )
            for j, kept in enumerate(layer.kept_inputs or ()):
                if len(kept.bytes) != n:
                    raise ValueError(
                        f"layers[{i}].kept_inputs[{j}].bytes has {len(kept.bytes)} entries but "
                        f"microbatch_sizes {sizes} has {n}: give one value per measured micro-batch size"
                    )
                if i + kept.offset >= len(self.layers):
                    raise ValueError(
                        f"layers[{i}].kept_inputs[{j}].offset {kept.offset} points past the last layer"
                    )
        if self.calibration is not None and len(self.calibration.layers) != len(self.layers):
            raise ValueError(
                f"calibration.layers has {len(self.calibration.layers)} entries but the profile has "
                f"{len(self.layers)} layers: give one per layer"
            )
        return self

    @property
    def step_overhead_ms(self) -> float:
        """The fixed cost of every step that calibration found (0 for a profile as measured)."""
        return self.calibration.step_overhead_ms if self.calibration is not None else 0.0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def sha256(self) -> str:
        """Fingerprint of the model's structure (see :func:`structure_sha256`)."""
        return structure_sha256(self.layer_names(), [layer.param_bytes for layer in self.layers])


def structure_sha256(layer_names: Sequence[str], param_bytes: Sequence[int]) -> str:
    """SHA-256 of a model's layer names and parameter bytes, in order.

    It identifies the model, not the measurement: re-profiling the same model gives the
    same value, and the runtime recomputes it from the model itself to refuse a plan
    made for another one.
    """
    body = json.dumps(
        {"layers": [[n, int(p)] for n, p in zip(layer_names, param_bytes, strict=True)]},
        separators=(",", ":"),
    )
    return hashlib.sha256(body.encode()).hexdigest()


# --------------------------------------------------------------------------- cluster


class Interconnect(_Model):
    bandwidth_bytes_per_s: PosFloat
    latency_s: NonNegFloat = 0.0


class Device(_Model):
    name: str = ""
    memory_bytes: Annotated[Bytes, Field(le=MAX_MEMORY_BYTES)]
    speed: PosFloat = Field(default=1.0, description="throughput relative to the profiling device")
    context_bytes: Annotated[Bytes, Field(le=MAX_MEMORY_BYTES)] = Field(
        default=0,
        description="bytes each process holds outside the framework's allocator: the CUDA context and "
        "the communication libraries' buffers (the device_type preset's cuda_context_bytes; 0: none)",
    )
    fragmentation: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = Field(
        default=0.0,
        description="the allocator's fragmentation: the share of its reserved memory no tensor uses "
        "(the device_type preset's allocator_fragmentation; 0: none)",
    )


def _interconnect(value: Any, where: str) -> Any:
    if isinstance(value, str):
        if value not in INTERCONNECTS:
            raise unknown_preset(f"interconnect for {where}", value, INTERCONNECTS)
        p = INTERCONNECTS[value]
        return {"bandwidth_bytes_per_s": p.bandwidth_bytes_per_s, "latency_s": p.latency_s}
    return value


class Cluster(_Model):
    """Devices and links.

    Accepts the full form (a list of devices) or the shorthand
    ``{"devices": 8, "memory": "80GiB"}`` / ``{"devices": 8, "device_type": "h100-80g"}``,
    with optional ``speed``, ``devices_per_node``, and ``intra_node`` / ``inter_node`` as a
    preset name (``nvlink4``) or ``{"bandwidth_bytes_per_s": ..., "latency_s": ...}``.
    """

    devices: list[Device] = Field(min_length=1, max_length=MAX_DEVICES)
    devices_per_node: Annotated[int, Field(ge=1, le=MAX_DEVICES)]
    intra_node: Interconnect = Field(description="each device's own link inside a node (NVLink: per GPU, per direction)")
    inter_node: Interconnect = Field(description="one network interface (NIC) between nodes, per direction")
    nics_per_node: Annotated[int, Field(ge=1, le=MAX_DEVICES)] | None = Field(
        default=None,
        description="network interfaces per node: a node's devices share nics_per_node x inter_node's "
        "bandwidth across nodes.  Default: one per device (each device has inter_node to itself)",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        preset = None
        device_type = data.pop("device_type", None)
        if device_type is not None:
            if device_type not in DEVICES:
                raise unknown_preset("device_type", device_type, DEVICES)
            preset = DEVICES[device_type]
        memory = data.pop("memory", None)
        speed = data.pop("speed", 1.0)
        devices = data.get("devices")
        if isinstance(devices, int) and not isinstance(devices, bool):
            if devices < 1:
                raise ValueError(f"devices must be >= 1, got {devices}")
            if devices > MAX_DEVICES:  # before anything proportional to it exists
                raise ValueError(too_large("devices", devices, MAX_DEVICES, suggest=True))
            if memory is None and preset is None:
                raise ValueError(
                    f"devices={devices} needs a memory size per device: add \"memory\": \"80GiB\" "
                    f"or a \"device_type\" ({', '.join(sorted(DEVICES))})"
                )
            mem = parse_bytes(memory) if memory is not None else preset.memory_bytes  # type: ignore[union-attr]
            # one validated device, shared: N references, not N objects to build and check
            fields: dict[str, Any] = {"name": device_type or "device", "memory_bytes": mem, "speed": speed}
            if preset is not None:
                fields["context_bytes"] = preset.cuda_context_bytes
                fields["fragmentation"] = preset.allocator_fragmentation
            for key in ("context_bytes", "fragmentation"):  # the shorthand may override the preset's
                if key in data:
                    fields[key] = data.pop(key)
            device = Device.model_validate(fields)
            data["devices"] = [device] * devices
        elif memory is not None or (device_type is not None and not isinstance(devices, list)):
            raise ValueError("give 'devices' as a count or a list of devices")
        n = len(data["devices"]) if isinstance(data.get("devices"), list) else 1
        if preset is not None:
            data.setdefault("devices_per_node", min(preset.devices_per_node, n))
            data.setdefault("intra_node", preset.intra_node)
            data.setdefault("inter_node", preset.inter_node)
            data.setdefault("nics_per_node", preset.nics_per_node)
        else:
            data.setdefault("devices_per_node", n)
            data.setdefault("intra_node", "pcie4")
            data.setdefault("inter_node", "ib-hdr")
        data["intra_node"] = _interconnect(data["intra_node"], "intra_node")
        data["inter_node"] = _interconnect(data["inter_node"], "inter_node")
        return data

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def same_node(self, a: int, b: int) -> bool:
        return a // self.devices_per_node == b // self.devices_per_node

    def link(self, a: int, b: int) -> Interconnect:
        """The link between devices ``a`` and ``b`` (by index)."""
        return self.intra_node if self.same_node(a, b) else self.inter_node

    @property
    def nic_share(self) -> float:
        """How much of one NIC's bandwidth each device has across nodes when every device of a
        node sends at once (``nics_per_node / devices_per_node``, at most 1: a device uses one NIC)."""
        if self.nics_per_node is None:
            return 1.0
        return min(1.0, self.nics_per_node / self.devices_per_node)

    @property
    def homogeneous(self) -> bool:
        first = self.devices[0]
        # one shared object (the shorthand's): list.count's identity test, in C, no comparison
        if self.devices.count(first) == len(self.devices):
            return True
        return all(d.memory_bytes == first.memory_bytes and d.speed == first.speed for d in self.devices)


# --------------------------------------------------------------------------- training


#: compute dtypes a plan can be made for (``TrainingSetup.dtype``), and the short names the
#: command line also accepts
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
DTYPE_ALIASES: Mapping[str, str] = MappingProxyType({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"})


def _dtype_name(value: Any) -> Any:
    return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


class TrainingSetup(_Model):
    """What one training step does: batch, optimizer state, memory margin, compute dtype."""

    global_batch_size: Annotated[int, Field(ge=1, le=MAX_GLOBAL_BATCH)] = 32
    optimizer: str = Field(default="adam", description=f"one of {', '.join(OPTIMIZERS)}")
    optimizer_state_bytes_per_param_byte: NonNegFloat | None = Field(
        default=None, description="overrides the optimizer preset"
    )
    fused_optimizer: bool = Field(
        default=False,
        description="the optimizer step runs fused kernels (torch's fused=True; apex's and Transformer "
        "Engine's FusedAdam, as Megatron-LM and DeepSpeed use): it allocates nothing beyond its state.  "
        "False: torch's foreach kernels, its default on GPUs, whose Adam/AdamW step holds a float32 "
        "temporary the size of the rank's parameters (pipeplan run uses the kernels this says)",
    )
    optimizer_step_bytes_per_param_byte: NonNegFloat | None = Field(
        default=None,
        description="what the optimizer step allocates while it runs (its temporaries), per parameter "
        "byte of the rank's optimizer shard; overrides the optimizer preset and fused_optimizer "
        "(default: the preset's, 0 for an optimizer without one)",
    )
    optimizer_step_reuses_bytes: NonNegInt = Field(
        default=0,
        description="bytes a rank holds through its backward but frees before the optimizer step, which "
        "the step's temporaries reuse (what the mesh search sets for ZeRO-3's gathered parameters, "
        "kept off each device's memory: FSDP2 reshards them after the backward); the step adds "
        "only what exceeds them.  0: nothing is reused",
    )
    gradient_bytes_per_param_byte: NonNegFloat = 1.0
    memory_margin: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = Field(
        default=0.10, description="fraction of each device's memory reserved for workspace"
    )
    dtype: Annotated[Literal["float32", "bfloat16", "float16"] | None, BeforeValidator(_dtype_name)] = Field(
        default=None,
        description="compute dtype the plan is made for: bfloat16/float16 run the stages under autocast "
        "with float32 master weights, gradients and optimizer state (bf16, fp16, fp32 are accepted too); "
        "activation bytes are scaled from the profile's dtype to this one and parameter bytes to float32. "
        "None: the profile's own dtype, unscaled (pipeplan run reads it as float32)",
    )

    tensor_parallel_efficiency: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = Field(
        default=0.9,
        description="efficiency of the smaller matrix products a tensor-parallel device runs: the "
        "sharded part of a layer takes time x fraction / (T x this) for T > 1 (1: perfect scaling)",
    )
    zero_overlap: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = Field(
        default=0.5,
        description="ZeRO-2/3's per-micro-batch collectives (parameter all-gathers, gradient "
        "reduce-scatters) hide behind this fraction of the layer's own compute (prefetch); the "
        "rest adds to its time.  0: never overlapped",
    )
    gradient_overlap: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = Field(
        default=0.0,
        description="share of the gradient collective after a rank's last backward (the data-parallel "
        "all-reduce, or ZeRO's reduce-scatter + all-gather) that overlaps that backward, as DDP's "
        "bucketed all-reduce does; the rest adds to the step.  0 (default): none overlaps",
    )

    @model_validator(mode="after")
    def _check_optimizer(self) -> TrainingSetup:
        if self.optimizer_state_bytes_per_param_byte is None and self.optimizer not in OPTIMIZERS:
            raise unknown_preset("optimizer", self.optimizer, OPTIMIZERS)
        if self.dtype is not None and self.optimizer.endswith("-mixed"):
            raise ValueError(
                f"optimizer {self.optimizer!r} with dtype {self.dtype!r}: with a dtype, parameters, "
                "gradients and optimizer state are already counted in float32 (the master copy), which "
                "is what a -mixed preset adds for a 16-bit profile; use optimizer "
                f"{self.optimizer.removesuffix('-mixed')!r}"
            )
        return self

    @property
    def run_dtype(self) -> str:
        """The dtype ``pipeplan run`` trains this plan in (``dtype``, float32 when unset)."""
        return self.dtype or "float32"

    @property
    def optimizer_state_factor(self) -> float:
        if self.optimizer_state_bytes_per_param_byte is not None:
            return self.optimizer_state_bytes_per_param_byte
        return OPTIMIZERS[self.optimizer]

    @property
    def optimizer_step_factor(self) -> float:
        """Bytes the optimizer step's temporaries take per parameter byte of its shard (the
        activations are freed by then): ``optimizer_step_bytes_per_param_byte``, else 0 for fused
        kernels, else the preset's (:data:`planner.presets.OPTIMIZER_STEP_TEMPORARIES`)."""
        if self.optimizer_step_bytes_per_param_byte is not None:
            return self.optimizer_step_bytes_per_param_byte
        if self.fused_optimizer:
            return 0.0
        return OPTIMIZER_STEP_TEMPORARIES.get(self.optimizer, 0.0)


# --------------------------------------------------------------------------- plan


class StageRange(_Model):
    start: NonNegInt
    stop: PosInt

    @model_validator(mode="after")
    def _order(self) -> StageRange:
        if self.stop <= self.start:
            raise ValueError(f"stop must be greater than start, got start={self.start} stop={self.stop}")
        return self


class PlanOptions(_Model):
    """Decisions the user fixes; the solver chooses the rest (``None`` = free)."""

    stages: Annotated[int, Field(ge=1, le=MAX_DEVICES)] | Annotated[
        list[StageRange], Field(max_length=MAX_LAYERS)
    ] | None = Field(
        default=None,
        description="the pipeline degree K (devices per pipeline; interleaved-1f1b makes K x v stages), "
        "or explicit [start, stop) boundaries, one per stage",
    )
    num_microbatches: Annotated[int, Field(ge=1, le=MAX_MICROBATCHES)] | None = None
    schedule: Schedule | None = None
    schedules: list[Schedule] | None = Field(
        default=None,
        min_length=1,
        description="the schedules the solver may choose among when `schedule` is free (default: all)",
    )
    recompute: bool | Annotated[list[bool], Field(max_length=MAX_LAYERS)] | None = Field(
        default=None, description="False forbids recompute, a list fixes it per stage"
    )
    data_parallel: Annotated[int, Field(ge=1, le=MAX_DEVICES)] | None = None
    virtual_stages: Annotated[int, Field(ge=1, le=MAX_LAYERS)] | None = Field(
        default=None, description="chunks per device (interleaved)"
    )
    tensor_parallel: Annotated[int, Field(ge=1, le=MAX_DEVICES)] | None = Field(
        default=None, description="the tensor-parallel degree T (devices per stage replica, inside a node)"
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        default=None, description="ZeRO sharding over the data-parallel replicas: 0 none .. 3 parameters too"
    )
    sequence_parallel: bool | None = Field(
        default=None, description="Megatron sequence parallelism (only with T > 1)"
    )
    tensor_parallel_across_nodes: bool = Field(
        default=False, description="allow a tensor-parallel group to span nodes (T > devices per node)"
    )
    selective_recompute: bool | None = Field(
        default=None,
        description="Megatron's selective recompute of attention's scores, softmax and dropout on every "
        "block (true: always, with no stage recomputed in full; false: never; default: the solver "
        "chooses, when the profile gives selective_recompute_bytes)",
    )
    context_parallel: Annotated[int, Field(ge=1, le=MAX_DEVICES)] | None = Field(
        default=None, description="context-parallel degree C (devices splitting each sequence); default: the "
        "solver chooses (C > 1 only for sequences of at least 16K tokens unless given)",
    )
    context_attention: Literal["all-gather", "ring"] = Field(
        default="all-gather", description="attention under C > 1: all-gather K/V (Llama 3) or ring (torch)"
    )
    expert_parallel: Annotated[int, Field(ge=1, le=MAX_DEVICES)] | None = Field(
        default=None, description="expert-parallel degree E of the mixture-of-experts layers; default: the solver "
        "chooses among the divisors of the expert count (MoE profiles only)",
    )
    partial_recompute: bool = Field(
        default=True,
        description="after the search, checkpoint only the first N layers of each recomputing stage, the "
        "least N that still fits (Megatron's --recompute-method block); false: whole stages only",
    )
    time_limit_s: Annotated[float, Field(gt=0, le=MAX_TIME_LIMIT_S, allow_inf_nan=False)] = 5.0

    @model_validator(mode="after")
    def _one_recompute_flag_per_stage(self) -> PlanOptions:
        problem = recompute_count_problem(self)
        if problem:
            raise ValueError(problem)
        return self


def recompute_count_problem(options: PlanOptions) -> str | None:
    """Why ``options.recompute``, a list, does not give one flag per stage (``stages`` times
    ``virtual_stages``, or one per explicit range), or None."""
    if not isinstance(options.recompute, list):
        return None
    count = len(options.recompute)
    if isinstance(options.stages, list) and count != len(options.stages):
        return f"recompute lists {count} flags for {len(options.stages)} stages: give one per stage"
    v = options.virtual_stages or 1
    if isinstance(options.stages, int) and count != options.stages * v:
        return (
            f"recompute lists {count} flags but stages={options.stages}"
            + (f" x virtual_stages={v} make {options.stages * v}" if v > 1 else "")
            + ": give one per stage"
        )
    return None


class MemoryParts(_Model):
    """The parts of a device's predicted peak (``StagePlan.memory_parts``), in bytes."""

    parameters: NonNegInt = Field(description="parameters, in their training dtype, after ZeRO-3")
    gradients: NonNegInt = Field(description="gradients (after ZeRO-2)")
    optimizer: NonNegInt = Field(description="optimizer state: master weights and moments (after ZeRO-1)")
    activations: NonNegInt = Field(
        description="activations at the peak of the schedule's walk: kept tensors of the micro-batches "
        "in flight, checkpointed layers' inputs, the re-materialised layer (the last stage's float32 "
        "logits and loss are the head's activations)"
    )
    gathered: NonNegInt = Field(default=0, description="ZeRO-3's gathered parameters (the running and the prefetched layer)")
    optimizer_step: NonNegInt = Field(
        default=0,
        description="the optimizer step's temporaries, when the peak is the step (the activations are freed "
        "by then, so activations is 0): TrainingSetup.optimizer_step_factor of the optimizer shard",
    )
    context: NonNegInt = Field(
        default=0,
        description="the CUDA context and the communication buffers, outside the allocator (Device.context_bytes)",
    )
    fragmentation: NonNegInt = Field(
        default=0,
        description="the allocator's reserved memory no tensor uses at the peak (Device.fragmentation of "
        "what it reserves).  The allocator's peak (StagePlan.memory_bytes) holds the parts above; the "
        "device holds that, this and the context",
    )


class StagePlan(_Model):
    index: NonNegInt
    start: NonNegInt
    stop: PosInt
    layer_names: list[str]
    devices: list[NonNegInt] = Field(
        description="device index of each data-parallel replica (with tensor parallelism T, the "
        "first of its T consecutive devices)"
    )
    recompute: bool = False
    recompute_layers: NonNegInt | None = Field(
        default=None,
        description="how many of the stage's layers are checkpointed (activation checkpointing layer by "
        "layer, the first ones: Megatron's --recompute-method block); each keeps only its input and "
        "re-runs its forward in the backward.  Default: all of them when recompute, else none",
    )
    param_bytes: NonNegInt = 0
    forward_ms: NonNegFloat = Field(description="per micro-batch")
    backward_ms: NonNegFloat = Field(description="per micro-batch, recompute included")
    backward_input_ms: NonNegFloat | None = Field(
        default=None,
        description="input-gradient part of the backward (I), recompute included; default "
        "(plans without it): half of the backward without recompute, plus the recompute",
    )
    backward_weight_ms: NonNegFloat | None = Field(
        default=None, description="weight-gradient part of the backward (W); default: the rest"
    )
    memory_bytes: NonNegInt = Field(
        description="predicted peak of the allocator of the device running this stage (the tensors it holds)"
    )
    memory_limit_bytes: NonNegInt = Field(
        description="the most memory_bytes may be: device memory less the safety margin, and less the "
        "context and the allocator's fragmentation (planner.cost.memory.usable_bytes)"
    )
    send_ms: NonNegFloat = Field(
        default=0.0, description="time to send one micro-batch's output to the next stage (and its gradient back)"
    )
    recompute_ms: NonNegFloat | None = Field(
        default=None,
        description="the recompute in backward_ms (the checkpointed layers' forwards); default: "
        "forward_ms when the stage recomputes, else 0",
    )
    memory_parts: MemoryParts | None = Field(
        default=None, description="what memory_bytes is made of on the device running this stage"
    )

    @property
    def device_bytes(self) -> int:
        """What the device holds at the peak: the allocator's peak (``memory_bytes``), its
        fragmentation and the context (``memory_parts``; 0 for older plans)."""
        p = self.memory_parts
        return self.memory_bytes + (p.context + p.fragmentation if p is not None else 0)

    @property
    def recompute_time_ms(self) -> float:
        """The recompute in the stage's backward (``recompute_ms``, or the whole forward)."""
        if self.recompute_ms is not None:
            return self.recompute_ms
        return self.forward_ms if self.recompute else 0.0

    @model_validator(mode="after")
    def _checkpoints_fit(self) -> StagePlan:
        if self.recompute_layers is not None:
            if self.recompute_layers > self.stop - self.start:
                raise ValueError(
                    f"stage {self.index} has {self.stop - self.start} layers but recompute_layers is "
                    f"{self.recompute_layers}: give at most {self.stop - self.start}"
                )
            if (self.recompute_layers > 0) != self.recompute:
                raise ValueError(
                    f"stage {self.index}: recompute_layers {self.recompute_layers} needs recompute "
                    f"{self.recompute_layers > 0}"
                )
        return self

    @property
    def checkpointed_layers(self) -> int:
        """Layers of the stage that are checkpointed (``recompute_layers``, or all / none)."""
        if self.recompute_layers is not None:
            return self.recompute_layers
        return self.stop - self.start if self.recompute else 0


class Predicted(_Model):
    step_time_ms: NonNegFloat
    throughput_samples_per_s: NonNegFloat
    bubble_fraction: Annotated[float, Field(ge=0, le=1)]
    lower_bound_ms: NonNegFloat
    allreduce_ms: NonNegFloat = 0.0
    step_overhead_ms: NonNegFloat = Field(
        default=0.0, description="fixed cost of every step a calibrated profile adds (in step_time_ms)"
    )
    # per-axis communication per step (planner.cost.mesh_collectives_ms); None: a plan made
    # before these were predicted
    tensor_parallel_ms: NonNegFloat | None = Field(
        default=None,
        description="tensor-parallel collectives per step on the busiest pipeline rank: every layer's "
        "forward and backward all-reduces (reduce-scatter + all-gather under sequence parallelism) for "
        "every micro-batch, a recomputed forward's again; in the stage times (0 when T = 1)",
    )
    zero_ms: NonNegFloat | None = Field(
        default=None,
        description="ZeRO-2/3 collectives per step on the busiest pipeline rank, before any overlap: "
        "each layer's gradient reduce-scatter every micro-batch and (ZeRO 3) its parameter all-gather "
        "before every forward, recomputed forward and backward; the collective after the step is "
        "allreduce_ms (0 for ZeRO 0/1 or D = 1)",
    )
    context_parallel_ms: NonNegFloat = Field(
        default=0.0, description="context parallelism's K/V all-gathers and reduce-scatters per step (busiest "
        "rank; inside the layer times, ring passes before their overlap)",
    )
    expert_parallel_ms: NonNegFloat = Field(
        default=0.0, description="the MoE layers' dispatch and combine all-to-alls per step (busiest rank; inside "
        "the layer times)",
    )
    pipeline_transfer_ms: NonNegFloat | None = Field(
        default=None,
        description="pipeline transfers per step on the busiest pipeline rank: every micro-batch's "
        "activations and gradients it sends and receives across its stage boundaries, each at the "
        "boundary's send_ms (0 when K = 1)",
    )


class SolverInfo(_Model):
    status: Literal["optimal", "feasible", "given"]
    gap: NonNegFloat = Field(description="proven relative gap to the optimum (0 when optimal)")
    wall_time_s: NonNegFloat = 0.0
    message: str = ""


class Plan(_Model):
    """A pipeline-parallel execution plan for one model on one cluster."""

    schema_version: Literal[5] = SCHEMA_VERSION
    model: str
    profile_sha256: str = Field(min_length=64, max_length=64)
    num_layers: PosInt
    schedule: Schedule
    placement: Placement = Field(
        default="loop",
        description="stage to rank: loop (stage s on rank s mod K) or v (rank r holds stages r and 2K-1-r)",
    )
    pipeline_degree: PosInt
    data_parallel_degree: PosInt = 1
    tensor_parallel_degree: PosInt = Field(
        default=1, description="devices each stage's tensor-parallel layers are sharded over (T, inside a node)"
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=0,
        description="ZeRO sharding over the data-parallel replicas of each stage: 0 none, 1 optimizer "
        "state, 2 also gradients, 3 also parameters",
    )
    sequence_parallel: bool = Field(
        default=False, description="Megatron sequence parallelism inside the tensor-parallel group"
    )
    selective_recompute: bool = Field(
        default=False,
        description="Megatron's selective recompute (--recompute-granularity selective): every block "
        "drops attention's scores, softmax and dropout mask and recomputes them in the backward; "
        "no stage then recomputes in full",
    )
    context_parallel_degree: PosInt = Field(
        default=1, description="context-parallel degree C: devices that split each sequence (planner/context.py)"
    )
    context_attention: Literal["all-gather", "ring"] = Field(
        default="all-gather",
        description="how attention sees the whole sequence under C > 1: all-gather K/V (Llama 3) or a ring pass "
        "overlapped with attention (torch's context_parallel)",
    )
    expert_parallel_degree: PosInt = Field(
        default=1, description="expert-parallel degree E: ranks a mixture-of-experts layer's experts are sharded "
        "over, drawn from the D x C ranks of a stage (planner/experts.py)",
    )
    virtual_stages: PosInt = Field(default=1, description="chunks (stages) per device")
    num_microbatches: PosInt
    microbatch_size: PosInt
    global_batch_size: PosInt
    stages: list[StagePlan] = Field(min_length=1)
    predicted: Predicted
    solver: SolverInfo
    cluster: Cluster
    training: TrainingSetup
    notes: list[str] = Field(
        default_factory=list,
        description="caveats of the prediction, e.g. a micro-batch size beyond the profiled ones",
    )
    split_points: list[str] = Field(
        default_factory=list,
        description="the profile's split points: the runtime cuts the model there (empty: every block)",
    )
    actions: list[str] | None = Field(
        default=None,
        description="what each pipeline rank computes, in order: one string per rank of "
        "space-separated actions in torch.distributed.pipelining's text form (stage, kind, "
        "micro-batch: '0F3' forward, '0B3' full backward, '0I3' input gradient, '0W3' weight "
        "gradient).  The prediction simulated exactly this; the runtime executes it.  Plans "
        "without it run the schedule's template (planner/schedules.py); 'planned' needs it",
    )

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        return _migrate_v4(_migrate_v3(_migrate_v2(_migrate_v1("plan", data))))

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        k, v = self.pipeline_degree, self.virtual_stages
        if len(self.stages) != k * v:
            raise ValueError(
                f"stages has {len(self.stages)} entries but pipeline_degree x virtual_stages = "
                f"{k} x {v} = {k * v}"
            )
        check_coverage([(s.start, s.stop) for s in self.stages], self.num_layers)
        chunks = SCHEDULE_CHUNKS[self.schedule]
        if (chunks == "1" and v != 1) or (chunks == "2" and v != 2):
            need = "1 chunk" if chunks == "1" else "2 chunks"
            raise ValueError(
                f"virtual_stages={v} does not suit schedule {self.schedule!r}, which runs {need} per device"
            )
        if self.placement != SCHEDULE_PLACEMENT[self.schedule]:
            raise ValueError(
                f"placement {self.placement!r} does not suit schedule {self.schedule!r}, which places "
                f"its stages {SCHEDULE_PLACEMENT[self.schedule]!r}"
            )
        if self.actions is not None and len(self.actions) != k:
            raise ValueError(f"actions lists {len(self.actions)} ranks but pipeline_degree is {k}: give one string per rank")
        if self.actions is None and self.schedule == "planned":
            raise ValueError("schedule 'planned' needs its actions: the plan must list what each rank runs")
        if self.sequence_parallel and self.tensor_parallel_degree == 1:
            raise ValueError("sequence_parallel needs tensor_parallel_degree > 1 (it shards inside the tensor-parallel group)")
        ep, dc = self.expert_parallel_degree, self.data_parallel_degree * self.context_parallel_degree
        if dc % ep:
            raise ValueError(
                f"expert_parallel_degree {ep} does not divide data_parallel_degree x context_parallel_degree = {dc} "
                "(the experts are sharded over those ranks)"
            )
        if self.selective_recompute and any(st.recompute for st in self.stages):
            full = [st.index for st in self.stages if st.recompute]
            raise ValueError(
                f"selective_recompute and full recompute of stages {full} exclude each other (one "
                "recompute granularity per plan, as in Megatron): set one of them false"
            )
        expected = self.microbatch_size * self.num_microbatches * self.data_parallel_degree
        if expected != self.global_batch_size:
            raise ValueError(
                f"microbatch_size x num_microbatches x data_parallel_degree = {self.microbatch_size} "
                f"x {self.num_microbatches} x {self.data_parallel_degree} = {expected}, but "
                f"global_batch_size is {self.global_batch_size}"
            )
        return self

    @property
    def world_size(self) -> int:
        """Devices the plan uses: D x T x C x K."""
        return (self.pipeline_degree * self.data_parallel_degree * self.tensor_parallel_degree
                * self.context_parallel_degree)

    @property
    def idle_devices(self) -> int:
        return self.cluster.num_devices - self.world_size


def check_coverage(ranges: Sequence[tuple[int, int]], num_layers: int) -> None:
    """Raise ``ValueError`` unless ``ranges`` cover ``0..num_layers`` contiguously, each once."""
    expect = 0
    for i, (start, stop) in enumerate(ranges):
        if stop <= start:
            raise ValueError(f"stage {i}: stop must be greater than start, got {start}:{stop}")
        if start != expect:
            what = "overlaps the previous stage" if start < expect else f"leaves layers {expect}:{start} in no stage"
            raise ValueError(f"stage {i} starts at layer {start} but the previous one stopped at {expect}: it {what}")
        expect = stop
    if expect != num_layers:
        raise ValueError(
            f"the stages stop at layer {expect} but the model has {num_layers} layers: "
            f"the last stage must stop at {num_layers}"
        )


# --------------------------------------------------------------------------- run report

#: version of the run report (``pipeplan run --report``); 1 was written before it had a schema
REPORT_VERSION: Literal[2] = 2
#: the report versions a reader accepts
READABLE_REPORT_VERSIONS = (2,)

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
#: a measured time, ms (at most MAX_LAYER_MS, about 30 years: every sum of them stays finite)
Ms = Annotated[float, Field(ge=0, le=MAX_LAYER_MS, allow_inf_nan=False)]
#: a time offset, ms
OffsetMs = Annotated[float, Field(ge=-MAX_LAYER_MS, le=MAX_LAYER_MS, allow_inf_nan=False)]


class StepReport(_Model):
    """One training step: measured (max over ranks) against predicted."""

    step: NonNegInt
    measured_ms: Ms
    predicted_ms: Ms
    ratio: NonNegFloat | None = None
    loss: FiniteFloat | None = None
    warmup: bool = False


class StageReport(_Model):
    """One stage: measured forward and backward per micro-batch (median after the warm-up)."""

    index: NonNegInt
    pipeline_rank: NonNegInt
    start: NonNegInt
    stop: PosInt
    layers: str = Field(description="'start:stop first..last', for people")
    recompute: bool
    forward_ms: Ms | None
    backward_ms: Ms | None = Field(description="recompute included")
    predicted_forward_ms: Ms
    predicted_backward_ms: Ms
    forward_ratio: NonNegFloat | None = None
    backward_ratio: NonNegFloat | None = None
    microbatches_timed: NonNegInt = 0
    peak_memory_bytes: NonNegInt | None = None
    predicted_memory_bytes: NonNegInt = 0


class CheckCategory(_Model):
    """One kind of figure ``--check`` compared (losses, gradients, near-zero gradients, gradient
    norms, parameters, parameters within the tolerance only with the optimizer's noise allowance)."""

    name: str
    measure: str = Field(description="how a difference is measured, in words")
    compared: NonNegInt = Field(description="how many figures (steps, tensors x steps, tensors)")
    max_diff: NonNegFloat | None = Field(description="the largest difference (None: not comparable)")
    worst: str = Field(default="", description="where the largest difference is (tensor, step)")
    tensors: list[str] = Field(default_factory=list, description="the tensors in an exceptional category")


class CheckReport(_Model):
    """``--check``: the pipelined run against the unsplit model (``None``: not comparable)."""

    passed: bool
    tolerance: NonNegFloat
    max_loss_rel_diff: NonNegFloat | None
    max_param_rel_diff: NonNegFloat | None
    worst_param: str
    params_compared: NonNegInt
    losses_pipelined: list[FiniteFloat | None]
    losses_reference: list[FiniteFloat | None]
    max_grad_rel_diff: NonNegFloat | None = Field(
        default=None, description="the largest gradient difference (runs before it: not compared)"
    )
    worst_grad: str = ""
    grad_tolerance: NonNegFloat | None = Field(
        default=None, description="the tolerance gradients were judged at (None: the tolerance)"
    )
    categories: list[CheckCategory] = Field(default_factory=list, description="what was compared, by kind")


class RankInfo(_Model):
    """One rank of the run."""

    rank: NonNegInt
    replica: NonNegInt
    pipeline_rank: NonNegInt
    host: str = ""
    stages: list[NonNegInt]
    allreduce_bytes: NonNegInt = Field(default=0, description="gradient bytes of its data-parallel all-reduce")


class RankStep(_Model):
    """Where one rank's step went (ms)."""

    rank: NonNegInt
    step: NonNegInt
    start_ms: OffsetMs = Field(description="this rank's start after the step's first start (shared clock)")
    schedule_ms: Ms = Field(description="the pipeline schedule: every forward, backward and transfer")
    allreduce_ms: Ms = Field(description="the data-parallel gradient all-reduce (0 when D = 1)")
    tied_ms: Ms = Field(default=0.0, description="summing tied weights' gradients between pipeline ranks")
    optimizer_ms: Ms


class ActionTimes(_Model):
    """One stage's forward and backward actions in one step on one replica, indexed by
    micro-batch: start (ms after the step's first start) and duration."""

    stage: NonNegInt
    replica: NonNegInt = 0
    step: NonNegInt
    forward_start_ms: list[OffsetMs]
    forward_ms: list[Ms]
    backward_start_ms: list[OffsetMs]
    backward_ms: list[Ms]


class AxisTime(_Model):
    """One mesh axis's communication per step: measured (median over the timed steps of the
    slowest rank's time) beside the plan's prediction (``Predicted``: its busiest pipeline rank)."""

    measured_ms: Ms
    predicted_ms: NonNegFloat | None = Field(default=None, description="None: the plan predicts no figure for it")
    calls: NonNegInt | None = Field(default=None, description="collectives or transfers per step on the slowest rank")
    parts_ms: dict[str, Ms] = Field(
        default_factory=dict, description="the measured figure's parts, each a median of its own"
    )


class CollectiveTimes(_Model):
    """Measured communication per step, per mesh axis the plan has (``None``: the axis is absent)."""

    tensor_parallel: AxisTime | None = Field(
        default=None, description="DTensor's collectives, inside the layers' forward and backward (vs tensor_parallel_ms)"
    )
    data_parallel: AxisTime | None = Field(
        default=None, description="the flat gradient all-reduce after the schedule (vs allreduce_ms)"
    )
    fsdp: AxisTime | None = Field(
        default=None, description="FSDP2's parameter all-gathers and gradient reduce-scatters, ZeRO 2/3 (vs zero_ms)"
    )
    pipeline_transfers: AxisTime | None = Field(
        default=None,
        description="posting and waiting for the schedule's sends and receives; a receive's wait includes the "
        "peer's compute before it sends (vs pipeline_transfer_ms)",
    )
    tied_weights: AxisTime | None = Field(
        default=None, description="summing tied weights' gradients between pipeline ranks (not predicted)"
    )


class RunReport(_Model):
    """What ``pipeplan run --report`` measured against the plan it ran (input of ``pipeplan calibrate``).

    ``steps``, ``stages``, the ratios and the check are the printed report.  ``plan`` is the
    plan that ran.  ``ranks``, ``rank_steps`` and ``timeline`` say where the time went: per
    rank and step, the schedule, the all-reduces and the optimizer; per stage, replica and step,
    when each micro-batch's forward and backward started and how long it took.  Start times
    compare across ranks when ``shared_clock`` is true (every rank on one host).
    """

    schema_version: Literal[2] = REPORT_VERSION
    model: str
    plan_model: str
    schedule: Schedule
    pipeline_degree: PosInt
    data_parallel_degree: PosInt
    virtual_stages: PosInt
    num_microbatches: PosInt
    microbatch_size: PosInt
    global_batch_size: PosInt
    world_size: PosInt
    backend: str
    device: str
    optimizer: str
    lr: FiniteFloat
    seed: int
    threads_per_rank: PosInt | None = None
    warmup_steps: NonNegInt = 1
    steps: list[StepReport]
    stages: list[StageReport]
    measured_step_ms: Ms | None
    predicted_step_ms: Ms
    ratio: NonNegFloat | None
    #: per pipeline rank: median fraction of the step spent in forward/backward compute
    rank_busy_fraction: list[NonNegFloat | None] = Field(default_factory=list)
    check: CheckReport | None = None
    notes: list[str] = Field(default_factory=list)
    plan: Plan
    shared_clock: bool = False
    ranks: list[RankInfo] = Field(default_factory=list)
    rank_steps: list[RankStep] = Field(default_factory=list)
    timeline: list[ActionTimes] = Field(default_factory=list)
    collectives: CollectiveTimes | None = Field(
        default=None, description="communication per step and mesh axis, beside the plan's prediction"
    )

    @model_validator(mode="after")
    def _consistent(self) -> RunReport:
        p = self.plan
        for name in (
            "schedule", "pipeline_degree", "data_parallel_degree", "virtual_stages", "num_microbatches",
            "microbatch_size", "global_batch_size",
        ):
            if getattr(self, name) != getattr(p, name):
                raise ValueError(f"{name} is {getattr(self, name)!r} but the plan's is {getattr(p, name)!r}")
        if [(s.index, s.start, s.stop) for s in self.stages] != [(s.index, s.start, s.stop) for s in p.stages]:
            raise ValueError("stages do not match the plan's stages (index, start, stop)")
        m, k, d = p.num_microbatches, p.pipeline_degree, p.data_parallel_degree
        for i, row in enumerate(self.timeline):
            if row.stage >= len(p.stages) or row.replica >= d or row.step >= len(self.steps):
                raise ValueError(
                    f"timeline[{i}] names stage {row.stage}, replica {row.replica}, step {row.step}: the run has "
                    f"{len(p.stages)} stages, {d} replicas and {len(self.steps)} steps"
                )
            for field in ("forward_start_ms", "forward_ms", "backward_start_ms", "backward_ms"):
                if len(getattr(row, field)) != m:
                    raise ValueError(
                        f"timeline[{i}].{field} has {len(getattr(row, field))} entries: give one per micro-batch ({m})"
                    )
        for i, r in enumerate(self.rank_steps):
            if r.rank >= k * d or r.step >= len(self.steps):
                raise ValueError(
                    f"rank_steps[{i}] names rank {r.rank}, step {r.step}: the run has {k * d} ranks and "
                    f"{len(self.steps)} steps"
                )
        for i, info in enumerate(self.ranks):
            if info.rank >= k * d:
                raise ValueError(f"ranks[{i}] names rank {info.rank}: the run has {k * d} ranks")
        return self

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


# --------------------------------------------------------------------------- sweep

#: most points one sweep may ask for (device counts times device kinds)
MAX_SWEEP_POINTS = 32


class SweepSpec(_Model):
    """What-if planning: the same model and training on several cluster sizes and device kinds.

    Each point is ``{"devices": n, ...}`` in the cluster shorthand: the device counts times
    the device types (or memories) given; links and ``devices_per_node`` apply to every point.
    """

    devices: list[Annotated[int, Field(ge=1, le=MAX_DEVICES)]] = Field(
        min_length=1, max_length=MAX_SWEEP_POINTS, description="device counts, e.g. [8, 16, 32, 64]"
    )
    device_types: list[str] = Field(default_factory=list, description="device presets to compare")
    memories: list[Bytes] = Field(default_factory=list, description="memory sizes per device to compare")
    devices_per_node: PosInt | None = None
    intra_node: str | Interconnect | None = None
    inter_node: str | Interconnect | None = None
    target_samples_per_s: PosFloat | None = Field(
        default=None, description="report the fewest devices that reach this throughput"
    )
    time_limit_s: Annotated[float, Field(gt=0, le=MAX_TIME_LIMIT_S, allow_inf_nan=False)] = Field(
        default=1.0, description="solver time limit per point"
    )

    @model_validator(mode="after")
    def _check_points(self) -> SweepSpec:
        if self.device_types and self.memories:
            raise ValueError("give device_types or memories to compare, not both")
        kinds = max(1, len(self.device_types), len(self.memories))
        points = len(set(self.devices)) * kinds
        if points > MAX_SWEEP_POINTS:
            raise ValueError(
                f"{points} sweep points ({len(set(self.devices))} device counts x {kinds} device kinds) "
                f"is more than {MAX_SWEEP_POINTS}: sweep fewer counts or kinds"
            )
        return self


class SweepPoint(_Model):
    devices: PosInt
    device_kind: str = Field(description="the device type or memory this point compares")
    status: Literal["ok", "infeasible"]
    step_time_ms: NonNegFloat | None = None
    throughput_samples_per_s: NonNegFloat | None = None
    scaling_efficiency: NonNegFloat | None = Field(
        default=None,
        description="throughput per device relative to the smallest feasible point of the same kind",
    )
    memory_headroom: float | None = Field(
        default=None, description="least free share of usable memory over the plan's devices"
    )
    gap: NonNegFloat | None = Field(default=None, description="proven gap to the optimum at this point")
    pareto: bool = Field(default=False, description="no point of this kind with as few devices is as fast")
    reused: bool = Field(
        default=False, description="the best plan is a smaller point's plan, which leaves devices idle"
    )
    message: str = ""
    plan: Plan | None = None


class SweepResult(_Model):
    schema_version: Literal[1] = 1
    model: str
    profile_sha256: str
    target_samples_per_s: PosFloat | None = None
    #: per device kind, the fewest devices reaching the target (None: no point reaches it)
    fewest_devices_for_target: dict[str, int | None] = Field(default_factory=dict)
    points: list[SweepPoint]
    wall_time_s: NonNegFloat = 0.0


# --------------------------------------------------------------------------- loading


DOCUMENTS: Mapping[str, type[BaseModel]] = MappingProxyType({
    "profile": Profile,
    "cluster": Cluster,
    "training": TrainingSetup,
    "plan": Plan,
    "options": PlanOptions,
    "sweep": SweepSpec,
    "report": RunReport,
})


def _migrate_v1(kind: str, data: Any) -> Any:
    """Read a version-1 profile or plan as version 2.

    Version 2 added the profile's ``split_points`` (version 1 kept them in
    ``metadata.profiler.split_points``), per-layer ``kept_inputs`` (absent: none) and the
    plan's ``split_points`` (absent: every block).
    """
    if not isinstance(data, dict) or data.get("schema_version") != 1:
        return data
    out = dict(data, schema_version=2)  # then read as version 2 by _migrate_v2
    if kind == "profile" and "split_points" not in out:
        meta = out.get("metadata")
        profiler = meta.get("profiler") if isinstance(meta, dict) else None
        points = profiler.get("split_points") if isinstance(profiler, dict) else None
        if isinstance(points, list):
            out["split_points"] = list(points)
    return out


def _migrate_v2(data: Any) -> Any:
    """Read a version-2 profile or plan as version 3.

    Version 3 added the mesh axes: per layer how it shards over a tensor-parallel group
    (absent: replicated) and selective-recompute bytes; per plan ``tensor_parallel_degree``,
    ``zero_stage`` and ``sequence_parallel`` (absent: 1, 0, off: the plans version 2 could
    express).  Nothing to rewrite: the new fields' defaults are exactly that.
    """
    if not isinstance(data, dict) or data.get("schema_version") != 2:
        return data
    return dict(data, schema_version=3)


def _migrate_v3(data: Any) -> Any:
    """Read a version-3 profile or plan as version 4.

    Version 4 added the operation census of each layer (``LayerProfile.operations``; absent:
    the layer's measured or synthesized times are all there is), the cluster's
    ``nics_per_node`` (absent: one NIC per device, as version 3 priced the inter-node link),
    per-stage ``recompute_layers`` (absent: a recomputing stage checkpoints every layer) and the
    stage's ``memory_parts`` (absent: not broken down).  Version 3's whole-stage recompute held a
    stage's re-materialised activations all at once; version 4 checkpoints layer by layer, so an
    old plan re-estimated predicts less memory for its recomputing stages.
    """
    if not isinstance(data, dict) or data.get("schema_version") != 3:
        return data
    return dict(data, schema_version=4)


def _migrate_v4(data: Any) -> Any:
    """Read a version-4 profile or plan as version 5.

    Version 5 added mixture-of-experts layers (``LayerProfile.moe``, ``Operation.expert``), the
    fake-tensor device kind and ``MeasuredOn.pricing``.  Version 4 had no experts: nothing to fill.
    """
    if not isinstance(data, dict) or data.get("schema_version") != 4:
        return data
    return dict(data, schema_version=5)


def format_validation_error(err: ValidationError, what: str) -> InputError:
    """Turn a pydantic error into an :class:`InputError` naming each field path and value."""
    lines = []
    entries = []
    for e in err.errors(include_url=False):
        loc = ""
        for part in e["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        value = e.get("input")
        msg = e["msg"].removeprefix("Value error, ")
        line = f"  {loc}: {msg}" if loc else f"  {msg}"
        if not isinstance(value, dict | list):
            shown = json.dumps(value, default=str)
            line += f" (got {shown[:77] + '...' if len(shown) > 80 else shown})"
        lines.append(line)
        entries.append({"loc": loc, "msg": msg, "input": None if isinstance(value, dict | list) else value})
    return InputError(f"invalid {what}:\n" + "\n".join(lines), entries)


def parse_document(kind: str, data: Any, *, source: str = "") -> Any:
    """Validate ``data`` as a ``kind`` document ('profile', 'cluster', 'training', 'plan', 'options',
    'sweep', 'report')."""
    cls = DOCUMENTS[kind]
    what = f"{kind} {source}".strip()
    if isinstance(data, dict) and "schema_version" in data and "schema_version" in cls.model_fields:
        version = data["schema_version"]
        readable = _READABLE.get(kind, READABLE_VERSIONS)
        if version not in readable:
            raise InputError(
                f"invalid {what}: schema_version {version!r} is not supported; this pipeplan "
                f"reads versions {', '.join(map(str, readable))} (regenerate the file with this version)",
                [{"loc": "schema_version", "msg": "unsupported version", "input": version}],
            )
    try:
        _PRECHECKS[kind](data)
    except InputError as err:
        raise InputError(f"invalid {what}: {err}", err.errors) from None
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise format_validation_error(err, what) from None
    except (ValueError, TypeError, OverflowError) as err:  # raised by a "before" validator outside pydantic's wrapping
        raise InputError(f"invalid {what}: {err}") from None


def _no_precheck(data: Any) -> None:
    pass


#: versions each document kind accepts, where not :data:`READABLE_VERSIONS`
_READABLE: Mapping[str, tuple[int, ...]] = MappingProxyType({"report": READABLE_REPORT_VERSIONS})


def _check_report(data: Any) -> None:
    if isinstance(data, dict) and "schema_version" not in data and data.get("version") == 1:
        raise InputError(
            "this is a version-1 run report (written before reports had a schema): it lacks the plan "
            "and the timings that calibration needs; run the plan again with this pipeplan "
            "(pipeplan run --plan PLAN --model SPEC --report FILE)",
            [{"loc": "version", "msg": "unsupported version", "input": 1}],
        )
    check_report_data(data)


#: sizes checked on the parsed JSON, before validation builds anything proportional to them
_PRECHECKS: Mapping[str, Callable[[Any], None]] = MappingProxyType({
    "profile": check_profile_data,
    "cluster": check_cluster_data,
    "plan": check_plan_data,
    "training": _no_precheck,
    "options": _no_precheck,
    "sweep": lambda data: check_sweep_data(data, max_points=MAX_SWEEP_POINTS),
    "report": _check_report,
})


def load_document(kind: str, path: str) -> Any:
    """Read and validate a JSON file; errors name the file, the field path and the value.

    The JSON is read strictly (no NaN or Infinity) and sizes are checked before validation."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # bounded: a device file or a typo'd path cannot fill memory
        if len(raw) > MAX_FILE_BYTES:
            raise InputError(
                f"{kind} file {path!r} is larger than {MAX_FILE_BYTES // 2**20} MiB, more than any "
                f"{kind} pipeplan reads: check the path"
            )
        data = loads_strict(raw, what=f"{kind} file {path!r}")
    except FileNotFoundError:
        raise InputError(f"{kind} file {path!r} does not exist: check the path") from None
    except IsADirectoryError:
        raise InputError(f"{kind} file {path!r} is a directory: give a JSON file") from None
    except json.JSONDecodeError as err:
        raise InputError(
            f"{kind} file {path!r} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    except OSError as err:
        raise InputError(f"cannot read {kind} file {path!r}: {err}") from None
    return parse_document(kind, data, source=repr(path))


def json_schema(kind: str) -> dict[str, Any]:
    """JSON Schema of a document kind, as served in OpenAPI too."""
    return DOCUMENTS[kind].model_json_schema()
