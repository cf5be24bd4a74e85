"""``/v1/estimate``: the cost model's prediction for a split you give."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from api.deps import SettingsDep, require_token
from api.limits import check_limits
from api.models import ErrorBody, EstimateRequest
from planner.schema import Plan

router = APIRouter(prefix="/v1", tags=["estimate"], dependencies=[Depends(require_token)])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token"},
    413: {"model": ErrorBody, "description": "request body too large"},
    422: {"model": ErrorBody, "description": "invalid request: field paths, or a split that does not fit the cluster"},
}


@router.post("/estimate", response_model=Plan, responses=_ERRORS, summary="predict a given split")
def estimate_plan(body: EstimateRequest, settings: SettingsDep) -> Plan:
    """Step time, bubble and per-stage memory of a fully specified plan
    (``planner.costmodel.estimate``; the same numbers every planner reports).  Runs in a
    worker thread, off the event loop."""
    from planner.costmodel import estimate

    check_limits(settings, body.profile, body.cluster, num_microbatches=body.num_microbatches)
    return estimate(
        body.profile,
        body.cluster,
        body.training,
        body.stages,
        num_microbatches=body.num_microbatches,
        schedule=body.schedule,
        recompute=body.recompute,
        data_parallel=body.data_parallel,
        pipeline_degree=body.pipeline_degree,
        devices=body.devices,
    )
