"""A search whose time runs out before it finds any plan proves nothing: it says so (a longer
time limit is the fix, not more memory), and the bound it reports still covers every plan."""

from __future__ import annotations

import pytest

from planner.errors import InfeasibleError, SearchCutShortError
from planner.schema import Cluster, PlanOptions, TrainingSetup
from planner.search import axes, driver
from planner.solver import solve
from profiler.synth import synth_transformer


def _instance() -> tuple[object, Cluster, TrainingSetup]:
    profile = synth_transformer(layers=12, hidden=1024, heads=16, seq=1024, vocab=32000, device_type="a100-80g",
                                microbatch_sizes=(1, 2))
    cluster = Cluster.model_validate({"devices": 8, "memory": "16GiB", "device_type": "a100-80g"})
    return profile, cluster, TrainingSetup(global_batch_size=32, optimizer="adam", dtype="bfloat16")


def _loaded_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wall-clock net is past at once and the hand rules find nothing: what a heavily loaded
    machine gives a short time limit."""
    monkeypatch.setattr(driver, "WALL_SAFETY", 1e-9)
    monkeypatch.setattr(driver, "seed_with_baselines", lambda search, configs: None)
    monkeypatch.setattr(driver, "seed_with_stack_rule", lambda search, **kw: None)
    monkeypatch.setattr(axes, "seed_split", lambda *a, **kw: None)


def test_a_search_out_of_time_says_so_and_keeps_a_valid_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    profile, cluster, training = _instance()
    options = PlanOptions(time_limit_s=0.5, tensor_parallel=1, zero_stage=0, selective_recompute=False,
                          partial_recompute=False)
    best = solve(profile, cluster, training, options)  # type: ignore[arg-type]
    _loaded_machine(monkeypatch)
    with pytest.raises(SearchCutShortError) as info:
        solve(profile, cluster, training, options)  # type: ignore[arg-type]
    err = info.value
    assert isinstance(err, InfeasibleError)  # (the CLI's and the service's handling stays)
    assert "time limit" in str(err) and "--time-limit" in str(err) and "no plan fits" not in str(err)
    assert 0 < err.details["bound_ms"] <= best.predicted.step_time_ms * (1 + 1e-9)


def test_the_mesh_search_never_calls_a_family_cut_short_infeasible(monkeypatch: pytest.MonkeyPatch) -> None:
    """T free, ZeRO 1 (no hand layout priced without a search): every family's solve runs out of
    time; the search must not diagnose "no plan fits" (its solves proved nothing)."""
    profile, cluster, training = _instance()
    options = PlanOptions(time_limit_s=1.0, zero_stage=1, partial_recompute=False)
    best = solve(profile, cluster, training, options)  # type: ignore[arg-type]
    _loaded_machine(monkeypatch)
    with pytest.raises(SearchCutShortError) as info:
        solve(profile, cluster, training, options)  # type: ignore[arg-type]
    assert "--time-limit" in str(info.value) and "no plan fits" not in str(info.value)
    assert 0 < info.value.details["bound_ms"] <= best.predicted.step_time_ms * (1 + 1e-9)
