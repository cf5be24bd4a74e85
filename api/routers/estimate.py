"""``/v1/estimate``: the cost model's prediction for a split you give."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from api.deps import SettingsDep, SolverDep, require_token
from api.intake import RequestReader
from api.models import ErrorBody
from planner.schema import Plan

router = APIRouter(prefix="/v1", tags=["estimate"], dependencies=[Depends(require_token)])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token"},
    413: {"model": ErrorBody, "description": "request body too large"},
    422: {"model": ErrorBody, "description": "invalid request: field paths, or a split that does not fit the cluster"},
}


@router.post(
    "/estimate",
    response_model=Plan,
    responses=_ERRORS,
    summary="predict a given split",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/EstimateRequest"}}},
        }
    },
)
async def estimate_plan(request: Request, settings: SettingsDep, solver: SolverDep) -> Response:
    """Step time, bubble and per-stage memory of a fully specified plan (an
    ``EstimateRequest``; ``planner.cost.estimate``, the same numbers every planner
    reports).  The body is read off the event loop and the estimate runs in the solver pool,
    stopped after ``PIPEPLAN_MAX_TIME_LIMIT_S`` plus the grace period."""
    reader: RequestReader = request.app.state.reader
    canonical = await reader.estimate(await request.body())
    text = await solver.estimate(canonical, timeout_s=settings.max_time_limit_s + settings.solve_grace_s)
    return Response(content=text, media_type="application/json")
