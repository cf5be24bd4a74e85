"""``/healthz``: liveness, never behind the token, touching neither the database nor the solver."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import SolverDep
from api.models import Health
from api.version import service_version

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="liveness")
async def healthz(solver: SolverDep) -> Health:
    return Health(status="ok", version=service_version(), solves_running=solver.pending)
