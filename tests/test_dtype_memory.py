"""The plan's compute dtype: recorded in the plan, and memory counted in that dtype's bytes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from planner.cost import Layout, estimate, profile_in_dtype, static_bytes
from planner.schema import (
    KeptInput,
    LayerProfile,
    MeasuredOn,
    PlanOptions,
    Profile,
    TrainingSetup,
    parse_document,
)
from planner.solver import solve
from tests.conftest import ROOT


def _profile(dtype: str = "float32") -> Profile:
    return Profile(
        model="m",
        measured_on=MeasuredOn(device="cpu", dtype=dtype),
        microbatch_sizes=[1, 2],
        layers=[
            LayerProfile(name=f"l{i}", param_bytes=1000 * (i + 1), forward_ms=[1, 2], backward_ms=[2, 4],
                         activation_bytes=[100, 200], output_bytes=[10, 20],
                         kept_inputs=[KeptInput(offset=0, bytes=[8, 16])] if i == 2 else None)
            for i in range(4)
        ],
    )  # fmt: skip


CLUSTER = parse_document("cluster", {"devices": 2, "memory": "1GiB"})


def _training(dtype: str | None, optimizer: str = "adam", *, fused: bool = True) -> TrainingSetup:
    # fused optimizer kernels by default: the peaks below are the walk's activations, which the
    # foreach step's temporaries (a float32 copy of the parameters) would otherwise exceed here
    return TrainingSetup(
        global_batch_size=4, optimizer=optimizer, dtype=dtype, fused_optimizer=fused  # type: ignore[arg-type]
    )


def _plan(profile: Profile, training: TrainingSetup):  # type: ignore[no-untyped-def]
    return estimate(
        profile, CLUSTER, training,
        Layout(
            [(0, 2), (2, 4)],
            num_microbatches=2,
            schedule="gpipe",
        ),
    )


def test_short_names_are_accepted_and_stored_long() -> None:
    assert TrainingSetup(dtype="bf16").dtype == "bfloat16"  # type: ignore[arg-type]
    assert TrainingSetup(dtype="fp16").dtype == "float16"  # type: ignore[arg-type]
    assert TrainingSetup(dtype="fp32").dtype == "float32"  # type: ignore[arg-type]
    assert TrainingSetup().dtype is None and TrainingSetup().run_dtype == "float32"
    with pytest.raises(ValidationError, match="dtype"):
        TrainingSetup(dtype="int8")  # type: ignore[arg-type]


def test_a_mixed_preset_with_a_dtype_is_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="use optimizer 'adam'"):
        TrainingSetup(optimizer="adam-mixed", dtype="bfloat16")


def test_older_plans_without_a_dtype_still_load() -> None:
    plan = _plan(_profile(), _training(None))
    data = json.loads(plan.model_dump_json())
    del data["training"]["dtype"]
    assert parse_document("plan", data).training.dtype is None


def test_without_a_dtype_nothing_is_rescaled() -> None:
    p16, p32 = _profile("bfloat16"), _profile()
    assert profile_in_dtype(p16, None) is p16
    assert profile_in_dtype(p32, None) is p32
    assert profile_in_dtype(p32, "float32") is p32
    # a float32 run of a 16-bit profile: everything in 4-byte elements
    scaled = profile_in_dtype(p16, "float32")
    assert [layer.param_bytes for layer in scaled.layers] == [2 * layer.param_bytes for layer in p16.layers]
    assert scaled.layers[0].activation_bytes == [200, 400]


def test_bf16_run_of_a_float32_profile_halves_activations_and_keeps_parameters() -> None:
    p = _profile()
    scaled = profile_in_dtype(p, "bfloat16")
    for a, b in zip(p.layers, scaled.layers, strict=True):
        assert b.param_bytes == a.param_bytes  # float32 master weights: as measured
        assert b.activation_bytes == [x // 2 for x in a.activation_bytes]
        assert b.output_bytes == a.output_bytes  # what crosses a cut keeps the profile's size
    assert scaled.layers[2].kept_inputs is not None and scaled.layers[2].kept_inputs[0].bytes == [4, 8]
    assert profile_in_dtype(scaled, "bfloat16") is scaled  # applied once
    fp32, bf16 = _plan(p, _training("float32")), _plan(p, _training("bfloat16"))
    assert bf16.training.dtype == "bfloat16" and fp32.training.dtype == "float32"
    assert bf16.profile_sha256 == fp32.profile_sha256 == p.sha256()  # the model's fingerprint
    # gpipe keeps M=2 micro-batches of activations (b = 2: 200 bytes per layer, kept 16 on stage 1)
    assert fp32.stages[0].memory_bytes - bf16.stages[0].memory_bytes == 2 * (400 - 200)
    assert fp32.stages[1].memory_bytes - bf16.stages[1].memory_bytes == 2 * (416 - 208)


def test_bf16_run_of_a_bf16_profile_counts_fp32_master_weights_like_the_mixed_preset() -> None:
    p = _profile("bfloat16")
    plain = _plan(p, _training(None, "adam"))
    mixed_preset = _plan(p, _training(None, "adam-mixed"))
    with_dtype = _plan(p, _training("bfloat16", "adam"))
    assert with_dtype.stages[0].param_bytes == 2 * plain.stages[0].param_bytes
    assert [s.memory_bytes for s in with_dtype.stages] == [s.memory_bytes for s in mixed_preset.stages]
    # foreach kernels: the step's float32 temporaries are the same in both descriptions too
    foreach = [_plan(p, _training(d, o, fused=False)) for d, o in (("bfloat16", "adam"), (None, "adam-mixed"))]
    assert foreach[0].stages[0].memory_parts.optimizer_step == foreach[1].stages[0].memory_parts.optimizer_step > 0
    assert [s.memory_bytes for s in foreach[0].stages] == [s.memory_bytes for s in foreach[1].stages]
    static_16bit = static_bytes(plain.stages[0].param_bytes, _training(None, "adam"))
    assert with_dtype.stages[0].memory_bytes - plain.stages[0].memory_bytes == pytest.approx(static_16bit, abs=1)


def test_the_solver_plans_in_the_dtype_and_keeps_the_fingerprint() -> None:
    profile = parse_document("profile", json.loads((ROOT / "examples" / "profiles" / "gpt-tiny-cpu.json").read_text()))
    cluster = parse_document("cluster", {"devices": 2, "device_type": "cpu"})
    options = PlanOptions(stages=2, num_microbatches=4, schedule="1f1b", data_parallel=1, time_limit_s=2)
    fp32 = solve(profile, cluster, _training(None, "sgd"), options)
    bf16 = solve(profile, cluster, _training("bf16", "sgd"), options)
    assert bf16.training.dtype == "bfloat16" and bf16.profile_sha256 == fp32.profile_sha256 == profile.sha256()
    assert sum(s.memory_bytes for s in bf16.stages) < sum(s.memory_bytes for s in fp32.stages)
