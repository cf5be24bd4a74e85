"""The planner's public entry point: :func:`solve`, the fastest plan that fits, with its proven gap.

``solve(profile, cluster, training, options) -> Plan``; the CLI, the service
(``PIPEPLAN_SOLVER=planner.solver:solve``), the benchmarks and the notebook call it here.
The method, and the map of the modules that implement it (configuration space, bounds, split
searches, branch and bound), are in :mod:`planner.search.driver`.
"""

from __future__ import annotations

from planner.search.driver import solve

__all__ = ["solve"]
