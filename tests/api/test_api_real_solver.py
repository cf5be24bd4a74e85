"""The service with the real planner (``planner.solver.solve``) in the default process pool."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from planner.cost import plan_fits, reestimate
from planner.schema import Cluster, Plan, Profile, TrainingSetup

pytest.importorskip("planner.solver")
pytest.importorskip("ortools")


def test_real_solver_round_trip(make_app: Callable[..., FastAPI], plan_body: dict[str, Any]) -> None:
    body = copy.deepcopy(plan_body)
    body["training"] = {"global_batch_size": 16}
    body["options"] = {"time_limit_s": 3.0}
    infeasible = copy.deepcopy(body)
    infeasible["cluster"] = {"devices": 2, "memory": "1MiB"}
    with TestClient(make_app("planner.solver:solve", mode="process", workers=1)) as c:
        r = c.post("/v1/plans", json=body)
        bad = c.post("/v1/plans", json=infeasible)
    assert r.status_code == 201, r.text
    plan = Plan.model_validate(r.json()["plan"])
    assert plan_fits(plan)
    assert plan.solver.status in ("optimal", "feasible")
    # the numbers are the cost model's for the chosen split
    again = reestimate(
        plan,
        Profile.model_validate(body["profile"]),
        cluster=Cluster.model_validate(body["cluster"]),
        training=TrainingSetup.model_validate(body["training"]),
    )
    assert again.predicted.step_time_ms == pytest.approx(plan.predicted.step_time_ms)

    assert bad.status_code == 422, bad.text
    data = bad.json()
    assert data["error"] == "infeasible"
    assert data["details"], data
    assert data["message"]
