"""Stand-in solvers (spawned worker processes import them as ``api_fake_solver:...``: pytest puts tests/api/ on sys.path).

They build plans with the real cost model, so responses are real plans; only the search is
replaced by an even split (the API tests exercise the service, not the optimizer).
"""

from __future__ import annotations

import time

from planner.cost import Layout, estimate
from planner.errors import InfeasibleError
from planner.schema import Cluster, Plan, PlanOptions, Profile, TrainingSetup


def even_split(num_layers: int, k: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_layers / k) for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


def solve(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> Plan:
    """Even split over min(devices, layers) stages, M = the global batch up to 256 (else its
    largest divisor that is); infeasible when it overflows."""
    k = options.stages if isinstance(options.stages, int) else min(cluster.num_devices, profile.num_layers)
    g = training.global_batch_size
    m = options.num_microbatches or max(x for x in range(1, min(g, 256) + 1) if g % x == 0)
    plan = estimate(
        profile, cluster, training,
        Layout(
            even_split(profile.num_layers, k),
            num_microbatches=m,
        ),
    )
    worst = max(plan.stages, key=lambda s: s.memory_bytes - s.memory_limit_bytes)
    if worst.memory_bytes > worst.memory_limit_bytes:
        raise InfeasibleError(
            f"stage {worst.index} needs {worst.memory_bytes} bytes but its device allows "
            f"{worst.memory_limit_bytes}: add devices or memory",
            {"stage": worst.index, "memory_bytes": worst.memory_bytes, "limit_bytes": worst.memory_limit_bytes},
        )
    return plan


def slow_solve(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> Plan:
    """:func:`solve` after sleeping ``options.time_limit_s`` (a long solve that frees the GIL)."""
    time.sleep(options.time_limit_s)
    return solve(profile, cluster, training, options)


def busy_solve(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> Plan:
    """:func:`solve` after spinning the CPU in Python for ``options.time_limit_s`` (holds the GIL)."""
    end = time.perf_counter() + options.time_limit_s
    x = 0
    while time.perf_counter() < end:
        x += 1
    return solve(profile, cluster, training, options)


def broken_solve(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> Plan:
    raise RuntimeError("solver bug")


def stuck_solve(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> Plan:
    """Spins forever, ignoring its time limit, when the profile's metadata says ``"stuck": true``
    (a solver bug); otherwise :func:`solve`."""
    if profile.metadata.get("stuck"):
        while True:
            pass
    return solve(profile, cluster, training, options)
