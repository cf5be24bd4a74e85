"""Infeasible input: the numbers in the error, and that the suggested fixes work."""

from __future__ import annotations

import pytest

from planner import infeasible
from planner.errors import InfeasibleError
from planner.infeasible import with_count, with_memory
from planner.schema import PlanOptions, TrainingSetup
from planner.solver import solve
from planner.units import parse_bytes
from tests.planner.helpers import assert_valid, cluster, random_profile


def _error(profile, cl, training, options) -> InfeasibleError:  # type: ignore[no-untyped-def]
    with pytest.raises(InfeasibleError) as info:
        solve(profile, cl, training, options)
    return info.value


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_memory_and_min_devices_are_right(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the numbers, not the diagnosis's budget, are under test: on a loaded machine (two test
    # sessions on 2 cores) 10 s ran out before the least device count was found
    monkeypatch.setattr(infeasible, "DIAGNOSIS_BUDGET_S", 120.0)
    profile = random_profile(seed, 10)
    training = TrainingSetup(global_batch_size=8, optimizer="adam")
    # the D x K diagnosis: ZeRO 0 (with ZeRO free the smallest memory is smaller; test_axes covers it)
    options = PlanOptions(time_limit_s=2, zero_stage=0)
    cl = cluster(2, "100MiB")
    err = _error(profile, cl, training, options)
    d = err.details
    assert d["layer"] is None
    need = d["min_memory_bytes"]
    # the number is in the message, with the flag that fixes it
    assert "--memory" in str(err)
    # the fix works ...
    plan = solve(profile, with_memory(cl, need), training, options)
    assert_valid(plan, profile)
    # ... and the flag's rounded value too
    flag = str(err).split("--memory ")[1].split(")")[0]
    assert parse_bytes(flag) >= need
    solve(profile, with_memory(cl, parse_bytes(flag)), training, options)
    # ... and it is the smallest (to the 1 MiB resolution)
    with pytest.raises(InfeasibleError):
        solve(profile, with_memory(cl, need - 2**20), training, options)
    n = d["min_devices"]
    assert n is not None and n > 2
    assert f"--devices {n}" in str(err)
    plan = solve(profile, with_count(cl, n), training, options)
    assert_valid(plan, profile)
    with pytest.raises(InfeasibleError):
        solve(profile, with_count(cl, n - 1), training, options)


def test_layer_too_big_for_any_device() -> None:
    profile = random_profile(5, 6)
    big = profile.layers[3].model_copy(update={"param_bytes": 600 * 2**20})
    profile = profile.model_copy(update={"layers": [*profile.layers[:3], big, *profile.layers[4:]]})
    training = TrainingSetup(global_batch_size=4, optimizer="adam")
    cl = cluster(4, "1GiB")
    err = _error(profile, cl, training, PlanOptions())
    d = err.details
    assert d["layer"] == "l3" and d["layer_bytes"] >= 600 * 2**20 * 4
    assert d["min_devices"] is None
    assert "'l3'" in str(err) and "no number of these devices helps" in str(err)
    assert d["layer_bytes"] <= d["min_memory_bytes"] * (1 - training.memory_margin) + 2**21
    solve(profile, with_memory(cl, d["min_memory_bytes"]), training, PlanOptions())


def test_fixed_options_that_prevent_a_fit_are_named() -> None:
    profile = random_profile(2, 8)
    training = TrainingSetup(global_batch_size=8, optimizer="sgd")
    from planner.infeasible import min_memory_bytes

    loose = PlanOptions(schedule="1f1b", stages=2, num_microbatches=8)
    tight = loose.model_copy(update={"recompute": False})
    (a, _), (b, _) = min_memory_bytes(profile, cluster(2), training, loose), min_memory_bytes(profile, cluster(2), training, tight)  # type: ignore[misc]
    cl = with_memory(cluster(2), (a + b) // 2)
    err = _error(profile, cl, training, tight)
    assert "drop --no-recompute" in str(err)


def test_cli_exit_code_2() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pipeplan", "plan", "examples/profiles/tiny.json", "--devices", "2", "--memory", "10MiB",
         "--batch-size", "8"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: no plan fits") and "Traceback" not in out.stderr
    assert "--memory" in out.stderr


def test_the_diagnosis_keeps_to_its_budget_and_says_what_it_did_not_find(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its budget the diagnosis stops: a memory that fits, said not to be the least, or
    none said at all; it never suggests a fix it did not see fit."""
    import time

    profile = random_profile(0, 10)
    training = TrainingSetup(global_batch_size=8, optimizer="adam")
    options = PlanOptions(time_limit_s=2, zero_stage=0, schedule="1f1b")
    cl = cluster(2, "100MiB")
    full = _error(profile, cl, training, options)
    assert "The smallest memory per device" in str(full)
    monkeypatch.setattr(infeasible, "DIAGNOSIS_BUDGET_S", 0.0)  # past it at once
    start = time.perf_counter()
    cut = _error(profile, cl, training, options)
    assert time.perf_counter() - start < 60
    assert cut.details["min_memory_bytes"] is None and cut.details["min_devices"] is None
    assert "was found within the diagnosis's 0 s" in str(cut)
    assert "would also fit if you" not in str(cut)  # (the schedule's release was not tested)
    # with the clock past the deadline in the middle of the bisection, the memory it reports fits
    calls = {"n": 0}
    real = infeasible.any_fits

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] > 3:
            kwargs["deadline"] = -1.0
        return real(*args, **kwargs)

    monkeypatch.setattr(infeasible, "any_fits", slow)
    found = infeasible.min_memory_bytes(profile, cl, training, options, deadline=float("inf"))
    assert found is not None
    memory, exact = found
    assert not exact and memory >= full.details["min_memory_bytes"]
    solve(profile, with_memory(cl, memory), training, options)  # it fits


def test_a_fixed_tensor_parallel_degree_is_diagnosed_as_fixed() -> None:
    """With T fixed, the diagnosis is of the T-sharded problem and counts GPUs (it said "Without
    tensor parallelism or ZeRO: ..." and gave T = 1's numbers, contradicting the fixed T): the
    memory and the device count it names fit at that T."""
    from planner.schema import Cluster
    from profiler.synth import synth_transformer

    profile = synth_transformer(layers=8, hidden=2048, heads=16, seq=2048, vocab=32000, device_type="a100-80g",
                                microbatch_sizes=(1, 2))
    training = TrainingSetup(global_batch_size=16, optimizer="adam", dtype="bfloat16")
    cl = Cluster.model_validate({"devices": 4, "memory": "3GiB", "device_type": "a100-80g"})
    options = PlanOptions(time_limit_s=1, tensor_parallel=2, sequence_parallel=False, selective_recompute=False,
                          zero_stage=0)
    err = _error(profile, cl, training, options)
    text = str(err)
    assert "Without tensor parallelism" not in text
    assert "With T=2 and ZeRO 0" in text and "these 4 device(s) (2 groups of 2)" in text
    d = err.details
    assert d["devices"] == 4 and d["min_memory_bytes"] > cl.devices[0].memory_bytes
    plan = solve(profile, with_memory(cl, d["min_memory_bytes"]), training, options)
    assert plan.tensor_parallel_degree == 2
    n = d["min_devices"]
    assert n is not None and n % 2 == 0 and f"--devices {n}" in text
    assert solve(profile, with_count(cl, n), training, options).tensor_parallel_degree == 2
    with pytest.raises(InfeasibleError):
        solve(profile, with_count(cl, n - 2), training, options)
