"""The mesh axes beyond data x pipeline: tensor parallelism T (with sequence parallelism) and ZeRO.

A plan on D x T x K devices is priced as the D x K plan of *one tensor-parallel rank*: every
TP group of T consecutive devices becomes one virtual device, and each layer becomes what one
device of its group runs and holds (:func:`mesh_problem`).  The schedule simulator, the memory
walk, the bounds and the split searches then work unchanged on that problem, so every bound
the solver proves for it holds for the mesh plan too.  Formulas (Narayanan et al. SC'21,
Korthikanti et al. 2022, Rajbhandari et al. 2020 "ZeRO"):

**Tensor parallelism** (Megatron: column-parallel then row-parallel linears).  For a layer that
shards (``LayerProfile.tensor_parallel`` not ``replicated``), with T > 1:

* time: ``t x (c / (T x e) + (1 - c) x r)`` plus its collectives, where ``c`` is
  ``tp_compute_fraction`` (the matrix products and attention), ``e`` is
  ``TrainingSetup.tensor_parallel_efficiency`` (smaller matrix products run less efficiently),
  and ``r`` is 1/T under sequence parallelism (norms and dropout on 1/T of the sequence), else 1;
* collectives: the forward's ``tp_forward_bytes`` and the backward's ``tp_backward_bytes`` go
  through ring all-reduces over the intra-node link, 2(T-1)/T x bytes / bandwidth plus 2(T-1)
  latencies each (``tp_forward_collectives`` of them; a block has 2 and 2).  With sequence
  parallelism they are reduce-scatter + all-gather pairs: the same bytes and latencies.  They
  are on the critical path (not overlapped); a recomputed forward repeats them;
* memory: ``tp_param_bytes`` / T plus the rest of the parameters (gradients and optimizer
  state follow the parameters); activations: ``tp_replicated_activation_bytes`` stay whole
  (``sp_replicated_activation_bytes`` under sequence parallelism), the rest / T;
* what crosses a stage cut is / T under sequence parallelism (the residual stream is
  sequence-sharded; each device sends its share over its own link), whole otherwise.

A replicated layer costs every device of the group its full time and memory.

**ZeRO** over the D replicas of each pipeline rank (stage z shards optimizer state; 2 also
gradients; 3 also parameters, each / D).  Communication, ring collectives on the link the
data-parallel group uses:

* z = 0: the gradient all-reduce after the last backward (as without ZeRO);
* z = 1: reduce-scatter of the gradients + all-gather of the updated parameters: the same
  bytes and latencies as the all-reduce, at the same time;
* z = 2: the gradient shards must be reduced as each micro-batch's backward makes them: a
  reduce-scatter per layer and micro-batch (added to its weight gradient), and the parameter
  all-gather after the step;
* z = 3: also an all-gather of each layer's parameters before its forward and before its
  backward, every micro-batch (added to the forward and to the input gradient), nothing after
  the step; each device also holds two layers' gathered parameters (the one running and the
  one prefetched: twice the largest layer's, counted for every rank);
* the per-micro-batch collectives hide behind ``TrainingSetup.zero_overlap`` of the layer's
  own compute: the layer takes ``t + max(0, comm - overlap x t)``.  The collective after the
  step is not overlapped with the last backward (as the gradient all-reduce never is here).

Gathered parameters and gradients are counted at the gradient's bytes per parameter byte.

**Selective recompute** (Korthikanti et al. 2022) is priced the same way, as a transformation of
the layers (:func:`selective_layer`): every attention block drops its
``selective_recompute_bytes`` (scores, softmax, dropout mask: 5·a·s²·b / T) and recomputes them
in its backward for ``selective_recompute_ms``.  As in Megatron (``--recompute-granularity``),
a plan recomputes either selectively or in full, not both: a selective plan's stages never
recompute in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from planner.context import ContextMemo, check_context, context_layer
from planner.cost.collectives import group_on, half_ring_ms, replica_link, ring_link, ring_ms
from planner.cost.compute import census_device, layer_times, shard_operation
from planner.cost.layers import SHA_KEY
from planner.errors import InputError
from planner.experts import check_experts, expert_layer
from planner.schema import (
    Cluster,
    Device,
    Interconnect,
    LayerProfile,
    Operation,
    Profile,
    TrainingSetup,
)

#: profile metadata key recording the mesh a profile was transformed for
MESH_KEY = "mesh_transformed"


@dataclass(frozen=True)
class Mesh:
    """The axes beyond D x K: tensor-parallel degree T, ZeRO stage, sequence parallelism,
    context-parallel degree C (:mod:`planner.context`) and expert-parallel degree E
    (:mod:`planner.experts`).  A group of T x C consecutive devices (T innermost) is one virtual
    device of the D x K problem (:attr:`group`)."""

    tensor_parallel: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    #: Megatron's selective recompute on every layer that gives its bytes (see :func:`selective_layer`)
    selective_recompute: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1
    #: how attention sees every key and value under context parallelism ("all-gather" or "ring")
    context_attention: str = "all-gather"

    @property
    def group(self) -> int:
        """Devices per virtual device: T x C."""
        return self.tensor_parallel * self.context_parallel

    @property
    def trivial(self) -> bool:
        return (
            self.tensor_parallel == 1 and self.zero_stage == 0 and not self.sequence_parallel
            and not self.selective_recompute and self.context_parallel == 1 and self.expert_parallel == 1
        )

    def describe(self) -> str:
        sp = "+SP" if self.sequence_parallel else ""
        sr = " selective-recompute" if self.selective_recompute else ""
        cp = f" C={self.context_parallel}" + ("(ring)" if self.context_attention == "ring" else "") \
            if self.context_parallel > 1 else ""
        ep = f" E={self.expert_parallel}" if self.expert_parallel > 1 else ""
        return f"T={self.tensor_parallel}{sp}{cp}{ep} zero={self.zero_stage}{sr}"


@dataclass(frozen=True)
class MeshProblem:
    """The D x K problem of one tensor-parallel rank (see the module docstring)."""

    profile: Profile
    cluster: Cluster
    training: TrainingSetup
    #: per layer: parameter bytes one device holds before ZeRO (what the plan reports)
    param_bytes: tuple[int, ...]
    #: bytes of gathered ZeRO-3 parameters every device holds (taken off its memory)
    gathered_bytes: int


def check_mesh(mesh: Mesh, cluster: Cluster, *, across_nodes: bool = False) -> None:
    """Refuse a tensor-parallel degree the cluster cannot host, with the fix."""
    t = mesh.tensor_parallel
    if t < 1:
        raise InputError(f"tensor-parallel degree must be >= 1, got {t}")
    if mesh.zero_stage not in (0, 1, 2, 3):
        raise InputError(f"zero stage must be 0, 1, 2 or 3, got {mesh.zero_stage}")
    if mesh.sequence_parallel and t == 1:
        raise InputError("sequence parallelism needs --tensor-parallel T > 1 (it shards inside the tensor-parallel group)")
    n, dpn = cluster.num_devices, cluster.devices_per_node
    if t > n:
        raise InputError(f"--tensor-parallel {t} needs {t} devices but the cluster has {n}: use T <= {n}")
    c = mesh.context_parallel
    if c < 1 or mesh.expert_parallel < 1:
        raise InputError(f"context- and expert-parallel degrees must be >= 1, got {c} and {mesh.expert_parallel}")
    if t * c > n:
        raise InputError(
            f"--tensor-parallel {t} x --context-parallel {c} = {t * c} devices but the cluster has {n}: "
            f"use T x C <= {n}"
        )
    if c > 1 and n % (t * c):
        raise InputError(
            f"--tensor-parallel {t} x --context-parallel {c} = {t * c} does not divide the {n} devices: use "
            f"T x C dividing {n}"
        )
    if not across_nodes:
        if t > dpn:
            raise InputError(
                f"--tensor-parallel {t} is more than the {dpn} devices per node: a tensor-parallel group "
                f"stays inside a node by default (use T <= {dpn}, or allow groups across nodes)"
            )
        if dpn % t:
            raise InputError(
                f"--tensor-parallel {t} does not divide the {dpn} devices per node, so some group would span "
                f"two nodes: use a divisor of {dpn}"
            )


def virtual_cluster(cluster: Cluster, t: int, *, gathered_bytes: int = 0, margin: float = 0.0) -> Cluster:
    """One virtual device per tensor-parallel group of ``t`` consecutive devices (the slowest and
    smallest of its members), ``gathered_bytes`` taken off its memory; devices per node / t."""
    if t == 1 and gathered_bytes == 0:
        return cluster
    groups = cluster.num_devices // t
    reserve = gathered_bytes / (1 - margin) if margin < 1 else gathered_bytes
    devices: list[Device] = []
    # (each virtual device keeps its members' CUDA context and fragmentation: what the cost
    # model's usable_bytes takes off every GPU)
    if len(set(map(id, cluster.devices))) == 1:  # one shared device object: one virtual device
        d = cluster.devices[0]
        devices = [Device(name=d.name, memory_bytes=max(0, int(d.memory_bytes - reserve)), speed=d.speed,
                          context_bytes=d.context_bytes, fragmentation=d.fragmentation)] * groups
    for g in range(groups if not devices else 0):
        members = cluster.devices[g * t:(g + 1) * t]
        mem = min(d.memory_bytes for d in members)
        speed = min(d.speed for d in members)
        devices.append(Device(name=members[0].name, memory_bytes=max(0, int(mem - reserve)), speed=speed,
                              context_bytes=max(d.context_bytes for d in members),
                              fragmentation=max(d.fragmentation for d in members)))
    # share equal devices, as the shorthand does (validation of 16k devices stays cheap)
    shared: dict[tuple[str, int, float, int, float], Device] = {}
    devices = [shared.setdefault((d.name, d.memory_bytes, d.speed, d.context_bytes, d.fragmentation), d)
               for d in devices]
    return Cluster(
        devices=devices,
        devices_per_node=max(1, cluster.devices_per_node // t),
        intra_node=cluster.intra_node,
        inter_node=cluster.inter_node,
        # each virtual device is t devices, each with its share of the node's NICs
        nics_per_node=None if cluster.nics_per_node is None else max(1, cluster.nics_per_node // t),
    )


def dp_link(cluster: Cluster, t: int, data_parallel: int, pipeline_degree: int) -> Interconnect:
    """The ring link of a data-parallel group under the default placement (replica d of pipeline
    rank k on TP group d·K + k: members T·K devices apart), every device of a node in some such
    group reducing at once (:func:`planner.cost.collectives.replica_link`)."""
    stride = t * pipeline_degree
    members = [d * stride for d in range(data_parallel) if d * stride < cluster.num_devices]
    return replica_link(cluster, members or [0])


def tp_link(cluster: Cluster, t: int) -> Interconnect:
    """The ring link of a tensor-parallel group of ``t`` consecutive devices: NVLink inside a
    node; a group spanning nodes runs its ring through the nodes' NICs
    (:func:`planner.cost.collectives.ring_link`)."""
    if t <= 1:
        return cluster.intra_node
    return ring_link(group_on(cluster, min(t, cluster.num_devices)), cluster)


def _scaled(values: Sequence[float] | None, factor: float) -> list[float] | None:
    return None if values is None else [v * factor for v in values]


def tp_collectives_ms(layer: LayerProfile, t: int, link: Interconnect) -> tuple[list[float], list[float]]:
    """A sharding layer's tensor-parallel collectives at T = ``t``, per profiled micro-batch
    size: (forward, backward) ms of one micro-batch (zeros for a replicated layer or T = 1)."""
    n = len(layer.forward_ms)
    if t <= 1 or not layer.shards:
        return [0.0] * n, [0.0] * n
    fwd_bytes = layer.tp_forward_bytes or [0] * n
    bwd_bytes = layer.tp_backward_bytes or fwd_bytes
    return (
        [ring_ms(x, t, layer.tp_forward_collectives, link) for x in fwd_bytes],
        [ring_ms(x, t, layer.tp_backward_collectives, link) for x in bwd_bytes],
    )


def zero_collectives_ms(
    param_bytes: float, zero: int, d: int, training: TrainingSetup, link: Interconnect
) -> tuple[float, float]:
    """ZeRO-2/3's per-micro-batch collectives of a layer holding ``param_bytes`` (one
    tensor-parallel rank's): (gradient reduce-scatter, parameter all-gather) ms, each at the
    gradient's bytes; the all-gather is ZeRO 3's, run before the forward and before the backward."""
    if zero < 2 or d <= 1:
        return 0.0, 0.0
    nbytes = param_bytes * training.gradient_bytes_per_param_byte
    rs = half_ring_ms(nbytes, d, link)
    return rs, (rs if zero == 3 else 0.0)


@dataclass(frozen=True)
class _Scales:
    """How much of a layer's forward, backward, input and weight gradient one device of a
    tensor-parallel group runs, and of its selective recompute."""

    forward: float
    backward: float
    input: float
    weight: float
    redo: float


#: the device model's scales of one census, by the identities of its operations (with them, to
#: check the identities still name them), T, sequence parallelism and the device
_ScaleMemo = dict[tuple[Any, ...], tuple[tuple[Operation, ...], _Scales]]


def _census_scales(layer: LayerProfile, t: int, sp: bool, device: str, memo: _ScaleMemo) -> list[_Scales] | None:
    """Per profiled micro-batch size, the device model's shard / whole times of the layer's census
    (:mod:`planner.cost.compute`): the measured times are the truth, the device model scales them
    to the shard (small GEMMs under a large T run less efficiently, which the flat efficiency
    misses).  None without a census.  ``memo`` shares the work between layers whose census is
    made of the same operation objects (synth's identical blocks), without hashing them."""
    if not census_prices(layer):
        return None
    out = []
    for ops in layer.operations or ():
        key = (*map(id, ops), t, sp, device)
        seen = memo.get(key)
        if seen is None or any(x is not y for x, y in zip(seen[0], ops, strict=True)):
            seen = (tuple(ops), _scales_of(ops, t, sp, device))
            memo[key] = seen
        out.append(seen[1])
    return out


def _scales_of(ops: Sequence[Operation], t: int, sp: bool, device: str) -> _Scales:
    whole = layer_times(ops, device_type=device)
    part = layer_times(ops, device_type=device, tensor_parallel=t, sequence_parallel=sp)
    core = [o for o in ops if o.kind == "attention"]
    redo = (layer_times(core, device_type=device, tensor_parallel=t).forward
            / layer_times(core, device_type=device).forward) if core else 1.0 / t

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else 1.0 / t

    return _Scales(
        ratio(part.forward, whole.forward), ratio(part.backward, whole.backward),
        ratio(part.backward_input, whole.backward_input), ratio(part.backward_weight, whole.backward_weight),
        redo,
    )


def _tp_layer(
    layer: LayerProfile,
    mesh: Mesh,
    training: TrainingSetup,
    link: Interconnect,
    *,
    device: str | None = None,
    memo: _ScaleMemo | None = None,
) -> LayerProfile:
    """What one device of a T-group runs and holds of ``layer`` (see the module docstring)."""
    t = mesh.tensor_parallel
    if t == 1 or not layer.shards:
        return layer
    sp = mesh.sequence_parallel
    census = _census_scales(layer, t, sp, device, {} if memo is None else memo) if device else None
    if census is not None:
        return _tp_layer_census(layer, census, t, sp, link)
    c = 1.0 if layer.tp_compute_fraction is None else layer.tp_compute_fraction
    scale = c / (t * training.tensor_parallel_efficiency) + (1.0 - c) * (1.0 / t if sp else 1.0)
    comm_f, comm_b = tp_collectives_ms(layer, t, link)
    fwd = [f * scale + cf for f, cf in zip(layer.forward_ms, comm_f, strict=True)]
    bwd = [b * scale + cb for b, cb in zip(layer.backward_ms, comm_b, strict=True)]
    # the backward's collectives carry the input gradient: they go with I
    if layer.backward_input_ms is not None or layer.backward_weight_ms is not None:
        if layer.backward_input_ms is not None and layer.backward_weight_ms is not None:
            bin_ = [x * scale + cb for x, cb in zip(layer.backward_input_ms, comm_b, strict=True)]
            bwt: list[float] | None = [x * scale for x in layer.backward_weight_ms]
        elif layer.backward_input_ms is not None:
            bin_ = [x * scale + cb for x, cb in zip(layer.backward_input_ms, comm_b, strict=True)]
            bwt = None
        else:
            assert layer.backward_weight_ms is not None
            bwt = [x * scale for x in layer.backward_weight_ms]
            bin_ = [max(0.0, b - w) for b, w in zip(bwd, bwt, strict=True)]
    else:
        bin_ = [b * scale / 2 + cb for b, cb in zip(layer.backward_ms, comm_b, strict=True)]
        bwt = [b * scale / 2 for b in layer.backward_ms]
    return layer.model_copy(
        update={
            **_tp_memory(layer, t, sp),
            "forward_ms": fwd,
            "backward_ms": bwd,
            "backward_input_ms": bin_,
            "backward_weight_ms": bwt,
            "forward_ms_spread": _scaled(layer.forward_ms_spread, scale),
            "backward_ms_spread": _scaled(layer.backward_ms_spread, scale),
            "selective_recompute_ms": _scaled(layer.selective_recompute_ms, c / (t * training.tensor_parallel_efficiency)),
        }
    )


def _tp_memory(layer: LayerProfile, t: int, sp: bool) -> dict[str, Any]:
    """The fields of ``layer`` one device of a T-group holds (parameters, activations, what
    crosses a cut; see the module docstring), as a ``model_copy`` update."""
    n = len(layer.forward_ms)
    shard_p = layer.param_bytes if layer.tp_param_bytes is None else min(layer.tp_param_bytes, layer.param_bytes)
    params = round(shard_p / t) + (layer.param_bytes - shard_p)
    repl_src = layer.sp_replicated_activation_bytes if sp else layer.tp_replicated_activation_bytes
    repl = repl_src or [0] * n
    acts = [round(min(r, a) + (a - min(r, a)) / t) for a, r in zip(layer.activation_bytes, repl, strict=True)]
    ratio = [a2 / a if a > 0 else 1.0 / t for a, a2 in zip(layer.activation_bytes, acts, strict=True)]
    cut = 1.0 / t if sp else 1.0
    return {
            "param_bytes": params,
            "activation_bytes": acts,
            "weight_grad_bytes": None
            if layer.weight_grad_bytes is None
            else [round(w * r) for w, r in zip(layer.weight_grad_bytes, ratio, strict=True)],
            "output_bytes": [round(x * cut) for x in layer.output_bytes],
            "cut_bytes": None if layer.cut_bytes is None else [round(x * cut) for x in layer.cut_bytes],
            "kept_inputs": None
            if layer.kept_inputs is None
            else [k.model_copy(update={"bytes": [round(x * cut) for x in k.bytes]}) for k in layer.kept_inputs],
            "selective_recompute_bytes": None
            if layer.selective_recompute_bytes is None
            else [round(x / t) for x in layer.selective_recompute_bytes],
            "peak_memory_bytes": None,
            "flops": _scaled(layer.flops, 1.0 / t),
    }


def _tp_layer_census(
    layer: LayerProfile, scales: list[_Scales], t: int, sp: bool, link: Interconnect
) -> LayerProfile:
    """:func:`_tp_layer` where the device model scales the measured times (:func:`_census_scales`)."""
    comm_f, comm_b = tp_collectives_ms(layer, t, link)
    fwd = [f * x.forward + cf for f, x, cf in zip(layer.forward_ms, scales, comm_f, strict=True)]
    bwd = [b * x.backward + cb for b, x, cb in zip(layer.backward_ms, scales, comm_b, strict=True)]
    bin0 = layer.backward_input_ms or [b / 2 for b in layer.backward_ms]
    bwt0 = layer.backward_weight_ms or [max(0.0, b - i) for b, i in zip(layer.backward_ms, bin0, strict=True)]
    bin_ = [i * x.input + cb for i, x, cb in zip(bin0, scales, comm_b, strict=True)]
    bwt = [w * x.weight for w, x in zip(bwt0, scales, strict=True)]
    bwd = [max(b, i + w) for b, i, w in zip(bwd, bin_, bwt, strict=True)]
    return layer.model_copy(update={
        **_tp_memory(layer, t, sp),
        "forward_ms": fwd,
        "backward_ms": bwd,
        "backward_input_ms": bin_,
        "backward_weight_ms": bwt,
        "forward_ms_spread": None if layer.forward_ms_spread is None
        else [v * x.forward for v, x in zip(layer.forward_ms_spread, scales, strict=True)],
        "backward_ms_spread": None if layer.backward_ms_spread is None
        else [v * x.backward for v, x in zip(layer.backward_ms_spread, scales, strict=True)],
        "selective_recompute_ms": None if layer.selective_recompute_ms is None
        else [v * x.redo for v, x in zip(layer.selective_recompute_ms, scales, strict=True)],
        # the shard's census, so that a micro-batch size beyond the profiled ones is read through
        # the device model here too (planner.cost.compute.census_ratios; the ratio of the shard's
        # compute also scales the collectives in its times, which grow with b as the work does)
        "operations": None if layer.operations is None
        else [[shard_operation(o, t, sequence_parallel=sp) for o in ops] for ops in layer.operations],
    })



def selective_layer(layer: LayerProfile) -> LayerProfile:
    """``layer`` under Megatron's selective recompute (Korthikanti et al. 2022, section 4.2).

    The backward does not find attention's scores, softmax output and dropout mask kept: it
    recomputes them from the kept query and key first.  So the layer keeps
    ``activation_bytes - selective_recompute_bytes`` and its backward (and input-gradient part,
    which the recompute precedes) takes ``selective_recompute_ms`` longer.  Nothing it drops is an
    input of a weight's gradient, so what the weight-gradient pass holds is capped at what the
    layer keeps.  A layer without the two fields (not an attention block) is unchanged.
    """
    drop, extra = layer.selective_recompute_bytes, layer.selective_recompute_ms
    if drop is None or extra is None:
        return layer
    acts = [max(0, a - x) for a, x in zip(layer.activation_bytes, drop, strict=True)]
    bin_ = layer.backward_input_ms
    if bin_ is not None:
        bin_ = [b + e for b, e in zip(bin_, extra, strict=True)]
    elif layer.backward_weight_ms is None:  # the default split: half of the backward, then the recompute
        bin_ = [b / 2 + e for b, e in zip(layer.backward_ms, extra, strict=True)]
    bwt = layer.backward_weight_ms
    if bwt is None and layer.backward_input_ms is None:
        bwt = [b / 2 for b in layer.backward_ms]
    return layer.model_copy(update={
        "activation_bytes": acts,
        "backward_ms": [b + e for b, e in zip(layer.backward_ms, extra, strict=True)],
        "backward_input_ms": bin_,
        "backward_weight_ms": bwt,
        "weight_grad_bytes": None if layer.weight_grad_bytes is None
        else [min(w, a) for w, a in zip(layer.weight_grad_bytes, acts, strict=True)],
        "selective_recompute_bytes": None,
        "selective_recompute_ms": None,
    })


def recomputes_selectively(profile: Profile) -> bool:
    """True when some layer of ``profile`` gives selective recompute's bytes and time."""
    return any(x.selective_recompute_bytes is not None and x.selective_recompute_ms is not None
               for x in profile.layers)


def _zero_layer(layer: LayerProfile, zero: int, d: int, training: TrainingSetup, link: Interconnect) -> LayerProfile:
    """``layer`` with ZeRO-2/3's per-micro-batch collectives in its times (hidden behind
    ``zero_overlap`` of its own compute); the forward's exposed gather is also written as
    ``forward_not_recomputed_ms``, which a recompute does not repeat."""
    # gradient reduce-scatter every micro-batch; ZeRO 3's parameter all-gather before fwd and bwd
    rs, ag = zero_collectives_ms(layer.param_bytes, zero, d, training, link)
    if rs == 0 and ag == 0:
        return layer
    hide = training.zero_overlap

    def add(t_: float, comm: float) -> float:
        return t_ + max(0.0, comm - hide * t_)

    fwd = [add(f, ag) for f in layer.forward_ms]
    # a recompute does not wait on the gather again: FSDP2 gathers before the backward
    # (torch.distributed.fsdp._fully_shard._fsdp_state: _pre_forward returns early in PRE_BACKWARD)
    before = layer.forward_not_recomputed_ms or [0.0] * len(fwd)
    skipped = [x + g - f for x, g, f in zip(before, fwd, layer.forward_ms, strict=True)]
    bwd_total = layer.backward_ms
    bin0 = layer.backward_input_ms or [b / 2 for b in bwd_total]
    bwt0 = layer.backward_weight_ms or [max(0.0, b - i) for b, i in zip(bwd_total, bin0, strict=True)]
    bin_ = [add(i, ag) for i in bin0]
    bwt = [add(w, rs) for w in bwt0]
    bwd = [max(b, i + w) + (i2 - i) + (w2 - w) for b, i, w, i2, w2 in zip(bwd_total, bin0, bwt0, bin_, bwt, strict=True)]
    return layer.model_copy(update={
        "forward_ms": fwd, "backward_ms": bwd, "backward_input_ms": bin_, "backward_weight_ms": bwt,
        "forward_not_recomputed_ms": skipped,
    })


def zero_factors(zero: int, d: int, training: TrainingSetup) -> tuple[float, float]:
    """(static bytes, bytes collected after the step as an all-reduce would) per parameter byte.

    Static: parameters (/D at stage 3) + gradients (/D from 2) + optimizer state (/D from 1).
    After the step, as all-reduce-equivalent bytes (a ring all-reduce moves twice a
    reduce-scatter's): z 0 and 1 the gradients, z 2 half of them (the parameter all-gather
    only), z 3 nothing.
    """
    g, o = training.gradient_bytes_per_param_byte, training.optimizer_state_factor
    if d <= 1:
        zero = 0
    static = (1.0 / d if zero >= 3 else 1.0) + (g / d if zero >= 2 else g) + (o / d if zero >= 1 else o)
    comm = g if zero <= 1 else (g / 2 if zero == 2 else 0.0)
    return static, comm


def mesh_problem(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    mesh: Mesh,
    *,
    data_parallel: int,
    pipeline_degree: int | None = None,
    across_nodes: bool = False,
) -> MeshProblem:
    """The D x K problem of one tensor-parallel rank of ``mesh`` (see the module docstring).

    ``profile`` must already be in the plan's dtype.  ZeRO's memory and after-step collective
    are written into the problem's parameter bytes and training factors: parameter bytes x a
    and gradient bytes g', optimizer state 0, with a(1 + g') = static and a·g' = the collected
    bytes (:func:`zero_factors`), so the cost model's own formulas give exactly ZeRO's static
    memory and collective.  ZeRO-2/3's per-micro-batch collectives need the data-parallel
    group's link, which depends on K when D·T fits a node: give ``pipeline_degree`` then
    (:func:`dp_link`).
    """
    check_mesh(mesh, cluster, across_nodes=across_nodes)
    if mesh.trivial:
        return MeshProblem(profile, cluster, training, tuple(x.param_bytes for x in profile.layers), 0)
    t, z, d = mesh.tensor_parallel, mesh.zero_stage, data_parallel
    if mesh.selective_recompute and not recomputes_selectively(profile):
        raise InputError(
            "selective recompute needs the profile's selective_recompute_bytes and selective_recompute_ms "
            "(synth gives them for transformer blocks; pipeplan profile for layers that keep attention scores, "
            "i.e. not fused attention): drop --selective-recompute, or use full recompute"
        )
    device = census_device(profile) if census_roles(profile) else None
    # every layer's share is a function of its content alone: a stack's identical blocks are
    # worked out once (the first of each kind), the others are copies under their own names
    first = same_layers(profile.layers)
    distinct = [x for i, x in enumerate(profile.layers) if first[i] == i]
    memo: _ScaleMemo = {}
    layers = [_tp_layer(layer, mesh, training, tp_link(cluster, t), device=device, memo=memo) for layer in distinct]
    c, e = mesh.context_parallel, mesh.expert_parallel
    if c > 1:
        check_context(profile, c, mesh.context_attention)
        context_memo: ContextMemo = {}
        layers = [
            context_layer(x, orig, c, t=t, sequence_parallel=mesh.sequence_parallel, cluster=cluster,
                          device=census_device(profile), mode=mesh.context_attention, memo=context_memo)
            for x, orig in zip(layers, distinct, strict=True)
        ]
    if e > 1:
        check_experts(profile, e, replicas=d * c)
        layers = [
            expert_layer(x, e, t=t, c=c, sequence_parallel=mesh.sequence_parallel, cluster=cluster,
                         pipeline_degree=pipeline_degree or 1, expert_tp_share=_expert_tp_share(orig, t))
            for x, orig in zip(layers, distinct, strict=True)
        ]
    if mesh.selective_recompute:
        layers = [selective_layer(x) for x in layers]
    g = mesh.group
    if z >= 2 and d > 1:
        if pipeline_degree is None and d * g < cluster.devices_per_node:
            raise ValueError("ZeRO-2/3 with D x T inside a node needs the pipeline degree (its link)")
        link = dp_link(cluster, g, d, pipeline_degree or cluster.num_devices)
        layers = [_zero_layer(layer, z, d, training, link) for layer in layers]
    slot = {i: j for j, i in enumerate(i for i in range(len(first)) if first[i] == i)}
    layers = [
        layers[slot[first[i]]] if first[i] == i else layers[slot[first[i]]].model_copy(update={"name": x.name})
        for i, x in enumerate(profile.layers)
    ]
    tp_params = tuple(x.param_bytes for x in layers)  # (selective recompute and ZeRO keep them)
    static, comm = zero_factors(z, d, training)
    base = 1.0 + training.gradient_bytes_per_param_byte + training.optimizer_state_factor
    gathered = 0
    new_training = training
    if (static, comm) != (base, training.gradient_bytes_per_param_byte):
        a = static - comm
        if a <= 0:
            raise InputError(
                f"ZeRO stage {z} with gradient_bytes_per_param_byte {training.gradient_bytes_per_param_byte} "
                "is not modelled (gradients larger than twice the parameters): use a smaller factor"
            )
        layers = [x.model_copy(update={"param_bytes": round(x.param_bytes * a)}) for x in layers]
        if z == 3 and d > 1:
            gathered = round(2 * max(tp_params) * training.gradient_bytes_per_param_byte)
        # the optimizer step's temporaries are the optimizer shard's (/D from ZeRO-1), per byte of
        # the folded parameters; they reuse the gathered layers' bytes (kept off the device),
        # which FSDP2 frees after the backward: a peak of max(walk + gathered, step)
        step = training.optimizer_step_factor / (d if z >= 1 and d > 1 else 1)
        new_training = training.model_copy(
            update={
                "optimizer": "sgd",
                "optimizer_state_bytes_per_param_byte": 0.0,
                "optimizer_step_bytes_per_param_byte": step / a,
                "optimizer_step_reuses_bytes": gathered,
                "gradient_bytes_per_param_byte": comm / a,
            }
        )
    sha = profile.metadata.get(SHA_KEY) or profile.sha256()
    new_profile = profile.model_copy(
        update={
            "layers": layers,
            "metadata": {**profile.metadata, SHA_KEY: sha, MESH_KEY: mesh.describe()},
        }
    )
    new_cluster = virtual_cluster(cluster, g, gathered_bytes=gathered, margin=training.memory_margin)
    return MeshProblem(new_profile, new_cluster, new_training, tp_params, gathered)


def same_layers(layers: Sequence[LayerProfile]) -> list[int]:
    """For each layer, the index of the first layer whose content (all but the name) is the
    same: a decoder stack's blocks map to its first block.  The content is compared as nested
    tuples of the fields' values (objects the layers share, such as a repeated block's census,
    are read once), so equal means equal."""
    memo: dict[int, object] = {}
    first: dict[object, int] = {}
    # layers made of the very same field objects (synth's copies of a block, a mesh problem's
    # copies of those) are equal without reading their content: one read per such group
    by_fields: dict[tuple[object, ...], int] = {}
    out = []
    for i, x in enumerate(layers):
        # (an object by its identity, tagged: never equal to a scalar field's value)
        fields = tuple(v if isinstance(v, (str, int, float, bool)) or v is None else ("id", id(v))
                       for k, v in x.__dict__.items() if k != "name")
        j = by_fields.get(fields)
        if j is None:
            j = by_fields[fields] = first.setdefault(_frozen(x, memo, skip="name"), i)
        out.append(j)
    return out


def _frozen(value: object, memo: dict[int, object], *, skip: str | None = None) -> object:
    """``value`` as a hashable nest of tuples (pydantic models by their type and fields)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    key = id(value)
    if skip is None and key in memo:
        return memo[key]
    if isinstance(value, (list, tuple)):
        out: object = tuple(_frozen(v, memo) for v in value)
    elif isinstance(value, dict):
        out = tuple(sorted((k, _frozen(v, memo)) for k, v in value.items()))
    elif isinstance(value, BaseModel):
        out = (type(value).__name__, *((k, _frozen(v, memo)) for k, v in value.__dict__.items() if k != skip))
    else:
        raise TypeError(f"cannot compare a layer field of type {type(value).__name__}")
    if skip is None:
        memo[key] = out
    return out


def _expert_tp_share(layer: LayerProfile, t: int) -> float:
    """The fraction of a layer's routed experts one tensor-parallel rank holds: 1/T when the
    layer's tensor-parallel parameters include them (synth's and Megatron's MoE blocks), else 1."""
    if t <= 1 or layer.moe is None or not layer.shards:
        return 1.0
    return 1.0 / t if (layer.tp_param_bytes or 0) >= layer.moe.expert_param_bytes else 1.0


def replicated_note(profile: Profile, t: int) -> str | None:
    """The plan's note naming the layers tensor parallelism does not divide (T > 1)."""
    if t <= 1:
        return None
    names = [x.name for x in profile.layers if not x.shards]
    if not names:
        return None
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    return f"tensor parallelism T={t} divides no work of {shown}: replicated on every device of a group"


def census_prices(layer: LayerProfile) -> bool:
    """Whether the device model can price ``layer``'s share of a tensor-parallel group from its
    census: the census says what divides (some ``tp_shard``), or nothing in the layer does (a
    vocabulary-parallel embedding: its lookup writes the whole output on every device).  A
    sharding layer whose census has no roles (a mixture-of-experts block, a block whose roles the
    profiler dropped, a census made before the profiler marked them) would be priced as
    replicated: the flat efficiency scales it."""
    if not layer.operations:
        return False
    return layer.tensor_parallel == "vocab-embedding" or any(o.tp_shard for ops in layer.operations for o in ops)


def census_roles(profile: Profile) -> bool:
    """Whether ``profile``'s census says which operations a tensor-parallel group divides
    (``Operation.tp_shard``): synth's does, and the profiler's (measured and fake-tensor) for the
    units it shards (transformer blocks, a column-parallel head: :mod:`profiler.census`); a
    census without any (a profile made before the profiler marked them) would price every
    sharded layer as replicated."""
    return any(o.tp_shard for x in profile.layers for ops in x.operations or () for o in ops)


def flat_scaling_note(profile: Profile, t: int) -> str | None:
    """The plan's note when tensor parallelism scales some layer without the device model: a
    sharding layer with no operation census (a profile made before schema version 4) or one
    without tensor-parallel roles (:func:`census_prices`), or a profile whose device has no
    device model."""
    if t <= 1:
        return None
    priced = census_device(profile) is not None and census_roles(profile)
    flat = [x.name for x in profile.layers if x.shards and not (priced and census_prices(x))]
    if not flat:
        return None
    shown = ", ".join(flat[:4]) + (f", ... ({len(flat)} in all)" if len(flat) > 4 else "")
    return (
        f"tensor parallelism T={t} scales {shown} by the flat tensor_parallel_efficiency: no operation census "
        "with tensor-parallel roles (synth and the profiler write them, but not for a profile made before the "
        "profiler did, a mixture-of-experts block or a block whose roles did not hold), or no device model for "
        "the profile's device"
    )
