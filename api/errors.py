"""Exception handlers: every error is JSON ``{"error", "message", ...}`` with the fix in the message."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from api.solving import SolverBusyError, SolverFailedError, SolverTimeoutError
from planner.errors import InfeasibleError, InputError, PipeplanError

_CODES = {401: "unauthorized", 404: "not_found", 413: "too_large", 503: "busy", 504: "timeout"}
logger = logging.getLogger("pipeplan.api")


def format_loc(loc: Sequence[Any]) -> str:
    """``("body", "profile", "layers", 3, "forward_ms")`` -> ``body.profile.layers[3].forward_ms``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _shown(value: Any) -> Any:
    """The offending value, unless it is a large object (then ``None``: the path says where)."""
    if isinstance(value, dict | list):
        text = json.dumps(value, default=str)
        return value if len(text) <= 200 else None
    if isinstance(value, str) and len(value) > 200:
        return value[:197] + "..."
    if isinstance(value, bytes):
        return value[:200].decode("utf-8", "replace")
    return value


def validation_entries(errors: Sequence[Any]) -> list[dict[str, Any]]:
    entries = []
    for e in errors:
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        ctx = e.get("ctx") or {}
        if e.get("type") == "json_invalid" and "error" in ctx:
            msg = f"the body is not valid JSON: {ctx['error']}"
        entries.append({"loc": format_loc(e.get("loc", ())), "msg": msg, "input": _shown(e.get("input"))})
    return entries


def error_response(
    status: int, error: str, message: str, *, headers: Mapping[str, str] | None = None, **extra: Any
) -> JSONResponse:
    body: dict[str, Any] = {"error": error, "message": message}
    body.update({k: v for k, v in extra.items() if v is not None})
    return JSONResponse(status_code=status, content=json.loads(json.dumps(body, default=str)), headers=headers)


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        entries = validation_entries(exc.errors())
        lines = [f"  {e['loc'] or '(body)'}: {e['msg']}" for e in entries[:20]]
        more = f"\n  ... and {len(entries) - 20} more" if len(entries) > 20 else ""
        return error_response(422, "invalid_request", "invalid request:\n" + "\n".join(lines) + more, errors=entries)

    @app.exception_handler(InfeasibleError)
    async def _infeasible(_request: Request, exc: InfeasibleError) -> JSONResponse:
        return error_response(422, "infeasible", str(exc), details=exc.details)

    @app.exception_handler(InputError)
    async def _input(_request: Request, exc: InputError) -> JSONResponse:
        entries = [{"loc": str(e.get("loc", "")), "msg": str(e.get("msg", "")), "input": _shown(e.get("input"))} for e in exc.errors]
        return error_response(422, "invalid_request", str(exc), errors=entries)

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

    @app.exception_handler(SolverFailedError)
    async def _failed(_request: Request, exc: SolverFailedError) -> JSONResponse:
        logger.error("solver failed: %s", exc)
        return error_response(500, "internal", f"the solver failed: {exc}")
