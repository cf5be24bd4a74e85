"""Exception handlers: every error is JSON ``{"error", "message", ...}`` with the fix in the message."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from api.intake import invalid_request, json_safe, safe_entries, safe_text, validation_entries
from api.solving import SolverBusyError, SolverFailedError, SolverTimeoutError
from api.store import StoreUnavailableError
from api.workers import WorkerDiedError, WorkerTimeoutError
from planner.errors import InfeasibleError, InputError, PipeplanError

_CODES = {401: "unauthorized", 404: "not_found", 413: "too_large", 503: "busy", 504: "timeout"}
logger = logging.getLogger("pipeplan.api")


def error_response(
    status: int, error: str, message: str, *, headers: Mapping[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """A JSON error body that always serializes: whatever the offending input held (NaN,
    Infinity, bytes, lone surrogates, huge objects) is made JSON-safe first."""
    body: dict[str, Any] = {"error": error, "message": safe_text(message)}
    for key, value in extra.items():
        if value is None:
            continue
        if key == "errors":
            body[key] = safe_entries(value)
        elif key == "details" and isinstance(value, dict):
            body[key] = {safe_text(str(k), 200): json_safe(v) for k, v in list(value.items())[:50]}
        else:
            body[key] = json_safe(value)
    return JSONResponse(status_code=status, content=body, headers=headers)


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = invalid_request(validation_entries(exc.errors()))
        return error_response(422, "invalid_request", str(err), errors=err.errors)

    @app.exception_handler(InfeasibleError)
    async def _infeasible(_request: Request, exc: InfeasibleError) -> JSONResponse:
        return error_response(422, "infeasible", str(exc), details=exc.details)

    @app.exception_handler(InputError)
    async def _input(_request: Request, exc: InputError) -> JSONResponse:
        return error_response(422, "invalid_request", str(exc), errors=exc.errors)

    @app.exception_handler(PipeplanError)
    async def _pipeplan(_request: Request, exc: PipeplanError) -> JSONResponse:
        return error_response(422, "invalid_request", str(exc), errors=[])

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        code = _CODES.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "internal")
        return error_response(exc.status_code, code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(SolverBusyError)
    async def _busy(_request: Request, exc: SolverBusyError) -> JSONResponse:
        return error_response(503, "busy", str(exc), headers={"Retry-After": "5"})

    @app.exception_handler(SolverTimeoutError)
    async def _timeout(_request: Request, exc: SolverTimeoutError) -> JSONResponse:
        return error_response(504, "timeout", str(exc))

    @app.exception_handler(WorkerTimeoutError)
    async def _read_timeout(_request: Request, exc: WorkerTimeoutError) -> JSONResponse:
        return error_response(
            503, "busy", f"reading the request took too long ({exc}): the server is overloaded, retry later",
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(WorkerDiedError)
    async def _read_died(_request: Request, exc: WorkerDiedError) -> JSONResponse:
        logger.error("a reading worker died: %s", exc)
        return error_response(503, "busy", f"the request could not be read ({exc}): retry later", headers={"Retry-After": "5"})

    @app.exception_handler(StoreUnavailableError)
    async def _store_down(_request: Request, exc: StoreUnavailableError) -> JSONResponse:
        logger.error("plan database unavailable: %s", exc)
        return error_response(503, "busy", str(exc), headers={"Retry-After": "5"})

    @app.exception_handler(SolverFailedError)
    async def _failed(_request: Request, exc: SolverFailedError) -> JSONResponse:
        logger.error("solver failed: %s", exc)
        return error_response(500, "internal", f"the solver failed: {exc}")
