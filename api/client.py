"""Client of the planning service (httpx; no torch, no FastAPI).

``remote_plan`` posts a request and returns ``(id, plan)``; ``fetch_plan`` reads a stored plan
from its URL.  Every failure is a :class:`planner.errors.PipeplanError` with a message that
says what to do, never a traceback.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from planner.errors import InfeasibleError, InputError, PipeplanError
from planner.limits import loads_strict
from planner.schema import Cluster, Plan, PlanOptions, Profile, TrainingSetup, parse_document


class ServiceError(PipeplanError):
    """The planning service could not be reached or refused the request."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _base(server: str) -> str:
    server = server.strip()
    parts = urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InputError(
            f"{server!r} is not a server URL: write it like http://127.0.0.1:8000"
        )
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _headers(token: str | None) -> dict[str, str]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _error(response: httpx.Response, url: str, *, sent_token: bool) -> PipeplanError:
    """The exception for a non-success answer, carrying the server's own message."""
    status = response.status_code
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    if message is None and isinstance(body, dict) and "detail" in body:
        message = str(body["detail"])
    message = message or (response.text[:500].strip() or response.reason_phrase)
    if status == 401:
        what = "refused the token" if sent_token else "needs a token"
        return ServiceError(
            f"the planning service at {url} {what} ({message}): set the PIPEPLAN_API_TOKEN "
            "environment variable to the server's token",
            status=status,
        )
    if status == 404:
        return ServiceError(f"{url}: not found ({message})", status=status)
    if status == 422 and isinstance(body, dict) and body.get("error") == "infeasible":
        return InfeasibleError(str(message), body.get("details") or {})
    if status == 422:
        errors = body.get("errors") if isinstance(body, dict) else None
        return InputError(f"the planning service rejected the request: {message}", errors or [])
    if status == 413:
        return ServiceError(f"the planning service at {url} refused the request: {message}", status=status)
    return ServiceError(f"the planning service at {url} answered {status}: {message}", status=status)


def _send(method: str, url: str, *, token: str | None, timeout_s: float, body: bytes | None = None) -> Any:
    headers = _headers(token)
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        response = httpx.request(method, url, content=body, headers=headers, timeout=timeout_s)
    except httpx.ConnectError:
        raise ServiceError(
            f"cannot reach the planning service at {url}: is `pipeplan serve` running?"
        ) from None
    except httpx.TimeoutException:
        raise ServiceError(
            f"the planning service at {url} did not answer within {timeout_s:g} s: raise the timeout, "
            "or lower options.time_limit_s"
        ) from None
    except httpx.HTTPError as err:
        raise ServiceError(f"cannot talk to the planning service at {url}: {err}") from None
    if response.status_code >= 300:
        raise _error(response, url, sent_token=bool(token))
    try:
        return loads_strict(response.content, what=f"the answer from {url}")
    except ValueError:  # not JSON, or NaN/Infinity in it (InputError is a ValueError too)
        raise ServiceError(f"the planning service at {url} did not answer JSON: is this a pipeplan server?") from None


def _plan_of(data: Any, url: str) -> tuple[str, Plan]:
    if not isinstance(data, dict) or "plan" not in data or "id" not in data:
        raise ServiceError(f"the answer from {url} holds no plan: is this a pipeplan server?")
    try:
        plan: Plan = parse_document("plan", data["plan"], source=f"from {url}")
    except ValueError as err:
        raise ServiceError(f"the plan from {url} does not validate ({err}): server and client versions differ?") from None
    return str(data["id"]), plan


def remote_plan(
    server: str,
    *,
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions | None = None,
    token: str | None = None,
    timeout_s: float = 600.0,
) -> tuple[str, Plan]:
    """Plan on the service at ``server`` (``http://host:port``); return the plan's id and the plan."""
    url = f"{_base(server)}/v1/plans"
    payload = {
        "profile": profile.model_dump(mode="json"),
        "cluster": cluster.model_dump(mode="json"),
        "training": training.model_dump(mode="json"),
        "options": options.model_dump(mode="json") if options is not None else None,
    }
    body = json.dumps(payload, allow_nan=False).encode()
    return _plan_of(_send("POST", url, token=token, timeout_s=timeout_s, body=body), url)


def fetch_plan(url: str, *, token: str | None = None, timeout_s: float = 60.0) -> Plan:
    """The plan stored at ``url`` (``http://host:port/v1/plans/{id}``)."""
    base = _base(url)
    if "/v1/plans/" not in base or base.endswith("/v1/plans"):
        raise InputError(f"{url!r} is not a plan URL: write it like http://127.0.0.1:8000/v1/plans/<id>")
    return _plan_of(_send("GET", base, token=token, timeout_s=timeout_s), base)[1]
