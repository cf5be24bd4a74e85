"""The app factory: ``uvicorn --factory api.app:create_app`` (what ``pipeplan serve`` runs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from api import errors
from api.charts import ChartRenderer
from api.deps import require_token
from api.intake import Limits, RequestReader
from api.middleware import AccessLogMiddleware, BodyLimitMiddleware
from api.models import EstimateRequest, PlanRequest, SweepRequest
from api.routers import estimate, health, pages, plans, presets, sweeps
from api.settings import ApiSettings
from api.solving import SolverPool
from api.store import PlanStore, open_store
from api.version import service_version

DESCRIPTION = """\
Pipeline-parallel partition planning as a service.  POST a profile (per-layer costs of a
traced model), the cluster and the training setup to `/v1/plans` and get a plan: stages,
micro-batches, schedule, recompute and the data x pipeline mesh, with the cost model's
predicted step time and per-device memory.  Identical requests return the stored plan.

When the server has `PIPEPLAN_API_TOKEN` set, every endpoint but `/healthz` needs
`Authorization: Bearer <token>`.
"""


def create_app(
    settings: ApiSettings | None = None,
    *,
    store: PlanStore | None = None,
    solver: SolverPool | None = None,
) -> FastAPI:
    """Build the service.  Settings default to the ``PIPEPLAN_*`` environment; the store's
    schema is created or migrated here; the solver pool starts on the first solve."""
    settings = settings if settings is not None else ApiSettings()
    store = store if store is not None else open_store(settings.db)
    store.migrate()
    solver = (
        solver
        if solver is not None
        else SolverPool(
            workers=settings.solver_workers,
            mode=settings.solver_mode,
            max_pending=settings.max_pending_solves,
            grace_s=settings.solve_grace_s,
            solver=settings.solver,
        )
    )

    reader = RequestReader(
        Limits.from_settings(settings), workers=settings.reader_workers, mode=settings.solver_mode
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        reader.start()  # spawns the reading processes now, so the first request does not wait
        try:
            yield
        finally:
            reader.close()
            solver.close()
            store.close()

    app = FastAPI(
        title="pipeplan",
        version=service_version(),
        description=DESCRIPTION,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.solver = solver
    app.state.reader = reader
    app.state.inflight = {}
    app.state.raw_index = plans.RawIndex()
    app.state.templates = pages.templates()
    app.state.charts = ChartRenderer()

    errors.install(app)
    for module in (plans, sweeps, estimate, presets, health, pages):
        app.include_router(module.router)

    docs_deps: list[Any] = [] if settings.public_docs else [Depends(require_token)]

    def openapi_with_request_bodies() -> dict[str, Any]:
        """FastAPI's document, plus the schemas of bodies that handlers validate themselves."""
        if app.openapi_schema is None:
            doc = FastAPI.openapi(app)
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (PlanRequest, EstimateRequest, SweepRequest):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in schema.pop("$defs", {}).items():
                    components.setdefault(name, sub)
                components[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi_with_request_bodies  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=docs_deps)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=docs_deps)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pipeplan API")

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AccessLogMiddleware)  # outermost: logs 413s too
    return app
