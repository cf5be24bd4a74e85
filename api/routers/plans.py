"""``/v1/plans``: solve a request (or return the stored plan of an identical one), fetch plans."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.charts import ChartKind, ChartRenderer
from api.deps import SolverDep, StoreDep, require_token
from api.intake import RequestReader
from api.models import ErrorBody, PlanRequest, PlanResponse
from api.store import PlanStore, StoredPlan

router = APIRouter(prefix="/v1", tags=["plans"], dependencies=[Depends(require_token)])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token"},
    413: {"model": ErrorBody, "description": "request body too large"},
    422: {"model": ErrorBody, "description": "invalid request (field paths) or infeasible (with details)"},
}


class RawIndex:
    """Bounded map from the SHA-256 of a request body's bytes to its cache key, so a
    byte-identical repeat skips validation and canonicalization (event-loop only)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, str] = OrderedDict()

    def get(self, raw_sha: str) -> str | None:
        sha = self._items.get(raw_sha)
        if sha is not None:
            self._items.move_to_end(raw_sha)
        return sha

    def put(self, raw_sha: str, sha: str) -> None:
        self._items[raw_sha] = sha
        self._items.move_to_end(raw_sha)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def plan_id(sha: str) -> str:
    return sha[:24]


def _time_limit(stored: StoredPlan) -> float:
    """``options.time_limit_s`` of a stored canonical request, without parsing all of it.

    The canonical text is ``{"cluster":{...},"options":{...},"profile":...``: the first
    ``,"options":`` is the top-level key (a quote inside a JSON string is escaped, and the
    cluster has no key of that name), so only the small options object is parsed."""
    text = stored.request_json
    start = text.find(',"options":')
    if start < 0:  # not canonical (never written by this service): parse it all
        limit: float = json.loads(text)["options"]["time_limit_s"]
        return limit
    options, _ = json.JSONDecoder().raw_decode(text, start + len(',"options":'))
    return float(options["time_limit_s"])


def plan_response_json(stored: StoredPlan, *, cached: bool) -> str:
    """The :class:`PlanResponse` body, built around the stored plan text (no re-serialization)."""
    head = {
        "id": stored.id,
        "cached": cached,
        "request_sha256": stored.request_sha256,
        "created_at": stored.created_at.isoformat(),
        "time_limit_s": _time_limit(stored),
    }
    return json.dumps(head, separators=(",", ":"))[:-1] + ',"plan":' + stored.plan_json + "}"


def _json(text: str, status: int, *, headers: dict[str, str] | None = None) -> Response:
    return Response(content=text, status_code=status, media_type="application/json", headers=headers)


def _absorb(future: asyncio.Future[StoredPlan]) -> None:
    if not future.cancelled():
        future.exception()  # mark retrieved: waiters re-raise it themselves


@router.post(
    "/plans",
    status_code=201,
    response_model=PlanResponse,
    responses={200: {"model": PlanResponse, "description": "an identical request was solved before"}, **_ERRORS},
    summary="plan a model on a cluster",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PlanRequest"}}},
        }
    },
)
async def create_plan(request: Request, store: StoreDep, solver: SolverDep) -> Response:
    """Solve the request (a ``PlanRequest``: profile, cluster, training, options), or return
    the stored plan of an identical one (``200``, ``cached``).

    The solver's time limit is ``options.time_limit_s`` capped by the server's
    ``PIPEPLAN_MAX_TIME_LIMIT_S``.  Sizes beyond the server's limits, ``NaN``/``Infinity`` and
    invalid fields get ``422`` with field paths; infeasible requests get ``422`` with
    ``{"error": "infeasible", "message", "details"}``.  A solve that overruns its time limit
    by the grace period is stopped: ``504``.
    """
    raw = await request.body()
    # hashing a large body takes tens of ms: a thread keeps the event loop free (hashlib drops the GIL)
    raw_sha = (await run_in_threadpool(_sha256, raw)) if len(raw) > 2**16 else _sha256(raw)
    index: RawIndex = request.app.state.raw_index
    known = index.get(raw_sha)
    if known is not None:
        stored = await run_in_threadpool(store.get_by_request, known)
        if stored is not None:
            return _json(plan_response_json(stored, cached=True), 200, headers={"Location": f"/v1/plans/{stored.id}"})

    reader: RequestReader = request.app.state.reader
    intake = await reader.plan(raw)  # parsed, size-checked and validated off the event loop
    sha = intake.sha256
    headers = {"Location": f"/v1/plans/{plan_id(sha)}"}
    stored = await run_in_threadpool(store.get_by_request, sha)
    if stored is not None:
        index.put(raw_sha, sha)
        return _json(plan_response_json(stored, cached=True), 200, headers=headers)

    inflight: dict[str, asyncio.Future[StoredPlan]] = request.app.state.inflight
    running = inflight.get(sha)
    if running is not None:  # the same request is being solved: wait for that solve
        stored = await asyncio.shield(running)
        return _json(plan_response_json(stored, cached=True), 200, headers=headers)

    future: asyncio.Future[StoredPlan] = asyncio.get_running_loop().create_future()
    future.add_done_callback(_absorb)
    inflight[sha] = future
    try:
        start = time.perf_counter()
        plan_json = await solver.solve(intake.canonical, time_limit_s=intake.time_limit_s)
        elapsed = time.perf_counter() - start
        stored = await run_in_threadpool(
            lambda: store.put(
                plan_id(sha),
                sha,
                model=intake.model,
                request_json=intake.canonical,
                plan_json=plan_json,
                solve_s=elapsed,
            )
        )
        future.set_result(stored)
        index.put(raw_sha, sha)
    except Exception as err:
        future.set_exception(err)
        raise
    except BaseException:
        future.cancel()
        raise
    finally:
        inflight.pop(sha, None)
    return _json(plan_response_json(stored, cached=False), 201, headers=headers)


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


async def _stored_or_404(store: StoreDep, plan_id: str) -> StoredPlan:
    stored = await run_in_threadpool(store.get, plan_id)
    if stored is None:
        raise HTTPException(
            status_code=404,
            detail=f"no plan with id {plan_id!r} on this server: check the id, or POST the request "
            "to /v1/plans to create it",
        )
    return stored


@router.get(
    "/plans/{plan_id}",
    response_model=PlanResponse,
    responses={404: {"model": ErrorBody, "description": "unknown id"}, 401: _ERRORS[401]},
    summary="a stored plan",
)
async def get_plan(plan_id: str, store: StoreDep) -> Response:
    stored = await _stored_or_404(store, plan_id)
    return _json(plan_response_json(stored, cached=True), 200)


@router.get(
    "/plans/{plan_id}/request",
    response_model=PlanRequest,
    responses={404: {"model": ErrorBody, "description": "unknown id"}, 401: _ERRORS[401]},
    summary="the canonical request a stored plan answers",
)
async def get_plan_request(plan_id: str, store: StoreDep) -> Response:
    stored = await _stored_or_404(store, plan_id)
    return _json(stored.request_json, 200)


_SVG: dict[int | str, dict[str, Any]] = {200: {"content": {"image/svg+xml": {}}, "description": "an SVG image"}}


@router.get(
    "/plans/{plan_id}/gantt.svg",
    response_class=Response,
    responses={**_SVG, 404: {"model": ErrorBody, "description": "unknown id"}, 401: _ERRORS[401]},
    summary="the plan's schedule as a Gantt chart",
)
async def get_gantt(request: Request, plan_id: str, store: StoreDep) -> Response:
    return await _chart(request, store, plan_id, "gantt")


@router.get(
    "/plans/{plan_id}/memory.svg",
    response_class=Response,
    responses={**_SVG, 404: {"model": ErrorBody, "description": "unknown id"}, 401: _ERRORS[401]},
    summary="each stage's predicted memory against its limit",
)
async def get_memory(request: Request, plan_id: str, store: StoreDep) -> Response:
    return await _chart(request, store, plan_id, "memory")


async def _chart(request: Request, store: PlanStore, plan_id: str, kind: ChartKind) -> Response:
    """A stored plan's chart, drawn off the event loop (or the one drawn before)."""
    stored = await _stored_or_404(store, plan_id)
    charts: ChartRenderer = request.app.state.charts
    svg = await run_in_threadpool(charts.svg, kind, stored.id, stored.plan_json)
    return Response(content=svg, media_type="image/svg+xml")
