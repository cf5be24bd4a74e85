"""Property-based tests of every operation in /openapi.json: no input gives a 5xx."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings

from api.app import create_app
from api.settings import ApiSettings


@pytest.fixture()
def api_schema(make_app: Callable[..., FastAPI]) -> schemathesis.BaseSchema:
    app = make_app(max_time_limit_s=1.0)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)
def test_no_server_errors(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) >= {"error", "message"}, body


def test_openapi_documents_the_contracts(tmp_path: object) -> None:
    """Request and response bodies are the planner's schema classes, not copies."""
    app = create_app(ApiSettings(db="sqlite://"))
    doc = app.openapi()
    names = set(doc["components"]["schemas"])
    assert {"Profile", "Cluster", "TrainingSetup", "PlanOptions", "Plan", "PlanRequest", "ErrorBody"} <= names
    paths = doc["paths"]
    assert set(paths) >= {"/v1/plans", "/v1/plans/{plan_id}", "/v1/estimate", "/v1/presets", "/healthz"}
    assert "201" in paths["/v1/plans"]["post"]["responses"]
    assert "422" in paths["/v1/plans"]["post"]["responses"]
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
