"""Expert parallelism, axis E: a mixture-of-experts layer's routed experts sharded over E ranks.

The E ranks are drawn from the data-parallel (and context-parallel) ranks of a pipeline stage,
as in Megatron-LM (``--expert-model-parallel-size``) and torchtitan: every rank keeps its own
tokens, sends each token's hidden state to the ranks holding its top-k experts (the dispatch
all-to-all), runs the experts it holds on the tokens it receives, and returns the results (the
combine all-to-all).  Priced per layer (:func:`expert_layer`) on what one device runs and holds:

* **Parameters.** A layer marked ``moe`` (:class:`planner.schema.MoELayer`) holds 1/E of its
  routed experts' parameters (after tensor parallelism's share); attention, the router, shared
  experts and dense layers keep their data- and tensor-parallel sharding.  The gradients and
  optimizer state follow the parameters; the expert gradients are reduced over the D·C/E
  replicas of each expert (priced as the data-parallel reduction of the smaller parameter bytes:
  a ring over D members, at least the time of one over D·C/E).
* **Time.** Under balanced routing (the profile's assumption) a rank runs as many expert tokens
  as without expert parallelism: E/E of the experts for E times its tokens' share, so the
  expert GEMMs keep their time.  Each MoE layer adds a dispatch and a combine all-to-all of
  ``dispatch_bytes`` (tokens x top-k x hidden x dtype bytes, / C under context parallelism and
  / T under sequence parallelism) forward, and the same two backward, on the critical path
  (:func:`planner.cost.collectives.all_to_all_ms`).
* **Constraints.** E divides every MoE layer's expert count, and D·C.

The group: when E <= C, E members of the context-parallel group (T apart); otherwise whole
context-parallel groups of E/C data-parallel replicas, K·T·C devices apart under the default
placement (replica d of pipeline rank k on group d·K + k).
"""

from __future__ import annotations

import math

from planner.cost.collectives import Group, all_to_all_ms, devices_group, group_on
from planner.errors import InputError
from planner.schema import Cluster, LayerProfile, Profile


def expert_counts(profile: Profile) -> list[int]:
    """The expert count of every MoE layer (empty: a dense model)."""
    return [layer.moe.experts for layer in profile.layers if layer.moe is not None]


def check_experts(profile: Profile, e: int, *, replicas: int | None = None) -> None:
    """Refuse an expert-parallel degree the profile or the mesh cannot take, with the fix."""
    if e < 1:
        raise InputError(f"--expert-parallel must be >= 1, got {e}")
    if e == 1:
        return
    counts = expert_counts(profile)
    if not counts:
        raise InputError(
            f"--expert-parallel {e}: the profile has no mixture-of-experts layers (none is marked moe): drop "
            "--expert-parallel, or profile the MoE model with this pipeplan (profile --fake --hf-config, synth --experts)"
        )
    bad = sorted({n for n in counts if n % e})
    if bad:
        divisors = [x for x in range(1, min(counts) + 1) if all(n % x == 0 for n in counts)]
        raise InputError(f"--expert-parallel {e} does not divide the layers' expert counts {bad}: use one of {divisors}")
    if replicas is not None and replicas % e:
        raise InputError(
            f"--expert-parallel {e} needs E to divide the D x C = {replicas} data- and context-parallel ranks of a "
            f"stage (the experts are sharded over them): use a data-parallel degree that makes D x C a multiple of {e}"
        )


def expert_group(cluster: Cluster, e: int, *, t: int, c: int, pipeline_degree: int) -> Group:
    """The E ranks of an expert-parallel group (see the module docstring)."""
    if e <= c:
        return group_on(cluster, e, stride=t, concurrent=min(t, max(1, cluster.num_devices // e)))
    span = pipeline_degree * t * c
    members = [(i % c) * t + (i // c) * span for i in range(e)]
    members = [m for m in members if m < cluster.num_devices] or [0]
    return devices_group(cluster, members)


def expert_layer(
    layer: LayerProfile,
    e: int,
    *,
    t: int,
    c: int,
    sequence_parallel: bool,
    cluster: Cluster,
    pipeline_degree: int,
    expert_tp_share: float,
) -> LayerProfile:
    """What one rank of an expert-parallel group of ``e`` holds and runs of ``layer`` (already
    one tensor- and context-parallel rank's).  ``expert_tp_share``: the fraction of the routed
    experts' bytes one tensor-parallel rank holds (1/T when tensor parallelism shards them)."""
    if e <= 1 or layer.moe is None:
        return layer
    held = layer.moe.expert_param_bytes * expert_tp_share
    a2a = _dispatch_combine_ms(layer, e, t=t, c=c, sequence_parallel=sequence_parallel, cluster=cluster,
                               pipeline_degree=pipeline_degree)
    update: dict[str, object] = {
        "param_bytes": max(0, math.ceil(layer.param_bytes - held * (1 - 1 / e))),
        "forward_ms": [x + a for x, a in zip(layer.forward_ms, a2a, strict=True)],
        "backward_ms": [x + a for x, a in zip(layer.backward_ms, a2a, strict=True)],
        "forward_ms_spread": None,
        "backward_ms_spread": None,
    }
    if layer.backward_input_ms is not None:
        update["backward_input_ms"] = [x + a for x, a in zip(layer.backward_input_ms, a2a, strict=True)]
    return layer.model_copy(update=update)


def all_to_all_per_microbatch_ms(layer: LayerProfile, e: int, *, t: int, c: int, sequence_parallel: bool,
                                 cluster: Cluster, pipeline_degree: int) -> list[float]:
    """The layer's all-to-alls of one micro-batch, forward + backward, per profiled size (0 when not MoE)."""
    if e <= 1 or layer.moe is None:
        return [0.0] * len(layer.forward_ms)
    one_way = _dispatch_combine_ms(layer, e, t=t, c=c, sequence_parallel=sequence_parallel, cluster=cluster,
                                   pipeline_degree=pipeline_degree)
    return [2 * x for x in one_way]  # forward and backward


def _dispatch_combine_ms(layer: LayerProfile, e: int, *, t: int, c: int, sequence_parallel: bool,
                         cluster: Cluster, pipeline_degree: int) -> list[float]:
    """A MoE layer's dispatch and combine all-to-alls of one pass (forward, or backward), per
    profiled size: its ``dispatch_bytes`` / C (/ T under sequence parallelism), twice."""
    assert layer.moe is not None
    group = expert_group(cluster, e, t=t, c=c, pipeline_degree=pipeline_degree)
    share = c * (t if sequence_parallel else 1)
    return [2 * all_to_all_ms(b / share, group, cluster) for b in layer.moe.dispatch_bytes]
