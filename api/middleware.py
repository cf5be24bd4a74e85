"""ASGI middleware: request body limit (413) and structured access logs."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCESS_LOGGER = "pipeplan.access"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _too_large(limit: int) -> str:
    return (
        f"the request body is larger than the server's limit of {limit} bytes: send a smaller "
        "profile, or raise PIPEPLAN_MAX_BODY_BYTES on the server"
    )


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


class BodyLimitMiddleware:
    """``413`` for a body over ``max_bytes``: by Content-Length up front, or while it streams in."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, {"error": "invalid_request", "message": "bad Content-Length"})
                    return
                if declared > self.max_bytes:
                    await _send_json(send, 413, {"error": "too_large", "message": _too_large(self.max_bytes)})
                    return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI lets an HTTPException raised while reading the body through
                    raise HTTPException(status_code=413, detail=_too_large(self.max_bytes))
            return message

        await self.app(scope, limited, send)


class AccessLogMiddleware:
    """One JSON line per request on the ``pipeplan.access`` logger, and an ``X-Request-ID``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.logger = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        request_id = ""
        for name, value in scope.get("headers", []):
            if name == b"x-request-id":
                text = value.decode("latin-1")
                request_id = text if _REQUEST_ID.match(text) else ""
        request_id = request_id or uuid.uuid4().hex
        status = 500
        size = 0

        async def logged_send(message: Message) -> None:
            nonlocal status, size
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            elif message["type"] == "http.response.body":
                size += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            if self.logger.isEnabledFor(logging.INFO):
                client = scope.get("client")
                self.logger.info(
                    json.dumps(
                        {
                            "ts": time.time(),
                            "request_id": request_id,
                            "method": scope.get("method"),
                            "path": scope.get("path"),
                            "status": status,
                            "duration_ms": round((time.perf_counter() - start) * 1e3, 3),
                            "response_bytes": size,
                            "client": f"{client[0]}:{client[1]}" if client else None,
                        }
                    )
                )
