"""Request dependencies: settings, store, solver pool and the bearer token check.

Each reads ``request.app.state``, filled by :func:`api.app.create_app`; tests replace any of
them with ``app.dependency_overrides``.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.settings import ApiSettings
from api.solving import SolverPool
from api.store import PlanStore

_bearer = HTTPBearer(auto_error=False, description="the server's PIPEPLAN_API_TOKEN")


def get_settings(request: Request) -> ApiSettings:
    settings: ApiSettings = request.app.state.settings
    return settings


def get_store(request: Request) -> PlanStore:
    store: PlanStore = request.app.state.store
    return store


def get_solver(request: Request) -> SolverPool:
    solver: SolverPool = request.app.state.solver
    return solver


def require_token(
    settings: Annotated[ApiSettings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """401 unless the server has no token or the request carries ``Authorization: Bearer <token>``."""
    if settings.api_token is None:
        return
    expected = settings.api_token.get_secret_value().encode()
    given = credentials.credentials.encode() if credentials is not None else b""
    if credentials is None or credentials.scheme.lower() != "bearer" or not secrets.compare_digest(given, expected):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong bearer token: send 'Authorization: Bearer <token>' with the "
            "server's PIPEPLAN_API_TOKEN",
            headers={"WWW-Authenticate": "Bearer"},
        )


SettingsDep = Annotated[ApiSettings, Depends(get_settings)]
StoreDep = Annotated[PlanStore, Depends(get_store)]
SolverDep = Annotated[SolverPool, Depends(get_solver)]
