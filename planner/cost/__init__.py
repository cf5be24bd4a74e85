"""The cost model: a plan's step time and per-device peak memory, one module per concern.

* :mod:`planner.cost.layers`: a profile's per-layer costs at one micro-batch size
  (:class:`LayerCosts`), and the profile in a run's dtype;
* :mod:`planner.cost.memory`: a rank's static bytes and what its schedule's walk holds
  (activation checkpointing layer by layer);
* :mod:`planner.cost.collectives`: point-to-point transfers and collectives on a link;
* :mod:`planner.cost.step`: the step estimate of a whole plan (:func:`estimate`).

Modules outside the package import these names from ``planner.cost``.
"""

from planner.cost.collectives import (
    allreduce_ms,
    boundary_transfer_ms,
    half_ring_ms,
    ring_ms,
    transfer_ms,
)
from planner.cost.compute import DTYPE_BYTES
from planner.cost.layers import (
    SHA_KEY,
    LayerCosts,
    interpolate,
    layer_costs,
    profile_in_dtype,
    split_backward,
    structure_sha,
)
from planner.cost.memory import (
    RankTerms,
    held_bytes,
    memory_lower_bound,
    outside_allocator,
    rank_memory_bytes,
    rank_memory_from_terms,
    rank_memory_terms,
    static_bytes,
    step_temporary_bytes,
    usable_bytes,
)
from planner.cost.step import (
    Layout,
    ScheduleTemplates,
    StageTimes,
    busy_ms,
    default_devices,
    estimate,
    lower_bound_ms,
    mesh_collectives_ms,
    pipeline_transfer_ms,
    plan_fits,
    plan_orders,
    planned_actions,
    reestimate,
    simulate_plan,
    stage_times,
)

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "DTYPE_BYTES",
    "SHA_KEY",
    "AllReduceAlgorithm",
    "Group",
    "LayerCosts",
    "Layout",
    "RankTerms",
    "ScheduleTemplates",
    "StageTimes",
    "all_gather_ms",
    "all_reduce_ms",
    "all_to_all_ms",
    "allreduce_ms",
    "boundary_transfer_ms",
    "busy_ms",
    "cross_node_bandwidth",
    "default_devices",
    "devices_group",
    "estimate",
    "group_on",
    "half_ring_ms",
    "held_bytes",
    "interpolate",
    "layer_costs",
    "lower_bound_ms",
    "memory_lower_bound",
    "mesh_collectives_ms",
    "outside_allocator",
    "pipeline_transfer_ms",
    "plan_fits",
    "plan_orders",
    "planned_actions",
    "profile_in_dtype",
    "rank_memory_bytes",
    "rank_memory_from_terms",
    "rank_memory_terms",
    "reduce_scatter_ms",
    "reestimate",
    "replica_link",
    "ring_bandwidth",
    "ring_link",
    "ring_ms",
    "send_recv_ms",
    "simulate_plan",
    "split_backward",
    "stage_times",
    "static_bytes",
    "step_temporary_bytes",
    "structure_sha",
    "transfer_ms",
    "usable_bytes",
]
