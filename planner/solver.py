"""The planner's public entry point: :func:`solve`, the fastest plan that fits, with its proven gap.

``solve(profile, cluster, training, options) -> Plan``; the CLI, the service
(``PIPEPLAN_SOLVER=planner.solver:solve``), the benchmarks and the notebook call it here.
The mesh axes beyond D x K (tensor parallelism, sequence parallelism, ZeRO) are searched by
:mod:`planner.search.axes`, which solves each mesh family with the D x K branch and bound of
:mod:`planner.search.driver`; the method, and the map of the modules that implement it
(configuration space, bounds, split searches, branch and bound), are in those two modules.  The
searched plan then checkpoints only the layers memory needs (:mod:`planner.search.partial`).
"""

from __future__ import annotations

from planner.cost import ScheduleTemplates
from planner.schema import Cluster, Plan, PlanOptions, Profile, TrainingSetup
from planner.search.axes import solve as search
from planner.search.partial import searched_options, with_partial_recompute

__all__ = ["solve"]


def solve(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions | None = None) -> Plan:
    """The fastest plan that fits (:mod:`planner.search.axes`), then checkpointing only the
    layers memory needs (:mod:`planner.search.partial`)."""
    options = options or PlanOptions()
    templates = ScheduleTemplates()  # the two searches share their schedules (the same shapes recur)
    plan = search(profile, cluster, training, searched_options(options), templates=templates)
    return with_partial_recompute(plan, profile, cluster, training, options, templates=templates)
