"""pipeplan's planner: the contracts, the cost model, the schedule simulator and the solver.

Torch-free by design: the service and the CLI import it on machines without torch.
"""

from planner.cost import estimate, plan_fits, simulate_plan
from planner.errors import InfeasibleError, InputError, PipeplanError, PlanMismatchError
from planner.schema import (
    SCHEMA_VERSION,
    Cluster,
    Plan,
    PlanOptions,
    Profile,
    TrainingSetup,
    load_document,
    parse_document,
)

__all__ = [
    "SCHEMA_VERSION",
    "Cluster",
    "InfeasibleError",
    "InputError",
    "PipeplanError",
    "Plan",
    "PlanMismatchError",
    "PlanOptions",
    "Profile",
    "TrainingSetup",
    "estimate",
    "load_document",
    "parse_document",
    "plan_fits",
    "simulate_plan",
]
