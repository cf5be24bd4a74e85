"""``POST /v1/sweeps``: the same sweep as ``pipeplan sweep``, bounded like plans."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from planner.schema import Profile, SweepResult, SweepSpec, TrainingSetup
from planner.sweep import sweep


def _body(profile: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "profile": profile,
        "training": {"global_batch_size": 8},
        "sweep": {"devices": [1, 2, 4], "memories": ["16GiB"], "time_limit_s": 0.5, **spec},
    }


def test_sweep_matches_the_library(make_app: Callable[..., FastAPI], tiny_profile_dict: dict[str, Any]) -> None:
    body = _body(tiny_profile_dict, target_samples_per_s=1.0)
    with TestClient(make_app("planner.solver:solve", mode="process", workers=1)) as c:
        r = c.post("/v1/sweeps", json=body)
    assert r.status_code == 200, r.text
    got = SweepResult.model_validate(r.json())
    want = sweep(
        Profile.model_validate(tiny_profile_dict), TrainingSetup(global_batch_size=8),
        SweepSpec.model_validate(body["sweep"]),
    )
    assert [(p.devices, p.step_time_ms, p.pareto) for p in got.points] == [
        (p.devices, p.step_time_ms, p.pareto) for p in want.points
    ]
    assert got.fewest_devices_for_target == want.fewest_devices_for_target == {"16.00 GiB": 1}


def test_sweep_limits_are_422_before_work(
    make_app: Callable[..., FastAPI], tiny_profile_dict: dict[str, Any]
) -> None:
    with TestClient(make_app("planner.solver:solve", mode="thread", workers=1, max_devices=64)) as c:
        too_many = c.post("/v1/sweeps", json=_body(tiny_profile_dict, devices=list(range(1, 40))))
        too_big = c.post("/v1/sweeps", json=_body(tiny_profile_dict, devices=[8, 1_000_000_000]))
        over_server = c.post("/v1/sweeps", json=_body(tiny_profile_dict, devices=[128]))
        no_memory = c.post("/v1/sweeps", json={**_body(tiny_profile_dict), "sweep": {"devices": [2]}})
        bad_kind = c.post("/v1/sweeps", json=_body(tiny_profile_dict, memories=[], device_types=["tpu-v9"]))
    for r, text in (
        (too_many, "39 device counts"),
        (too_big, "1,000,000,000 devices"),
        (over_server, "128 devices is beyond what this server plans"),
        (no_memory, "sweep.memories"),
        (bad_kind, "tpu-v9"),
    ):
        assert r.status_code == 422, (text, r.status_code, r.text)
        assert text in r.json()["message"], (text, r.json())
        assert r.elapsed.total_seconds() < 1.0
