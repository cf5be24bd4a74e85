"""``/v1/sweeps``: what-if planning over cluster sizes and device kinds (``pipeplan sweep``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from api.deps import SolverDep, require_token
from api.intake import RequestReader
from api.models import ErrorBody
from planner.schema import SweepResult

router = APIRouter(prefix="/v1", tags=["sweeps"], dependencies=[Depends(require_token)])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token"},
    413: {"model": ErrorBody, "description": "request body too large"},
    422: {"model": ErrorBody, "description": "invalid request: field paths and the fix"},
    503: {"model": ErrorBody, "description": "too many solves queued or running"},
    504: {"model": ErrorBody, "description": "the sweep ran far past its time limits and was stopped"},
}


@router.post(
    "/sweeps",
    response_model=SweepResult,
    responses=_ERRORS,
    summary="plan one model on several cluster sizes and device kinds",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SweepRequest"}}},
        }
    },
)
async def create_sweep(request: Request, solver: SolverDep) -> Response:
    """The best plan at each point (a ``SweepRequest``: device counts times device types or
    memories), with throughput, scaling efficiency, memory headroom, proven gap, the Pareto
    front and the fewest devices reaching ``target_samples_per_s``; not stored.  Bounded like
    plans: at most 32 points, each with the server's time limit at most."""
    reader: RequestReader = request.app.state.reader
    canonical, points, time_limit = await reader.sweep(await request.body())
    text = await solver.sweep(canonical, points=points, time_limit_s=time_limit)
    return Response(content=text, media_type="application/json")
