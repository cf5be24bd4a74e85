"""``pipeplan calibrate`` fits the device model's constants of a synthesized profile (torch-free).

The truth is the same model synthesized with known constants (gemm 0.62, memory 0.7 against the
a100-80g defaults 0.88 / 0.85): run reports of plans made from the default-priced profile, timed
where the truth holds, must give the constants back and predict the runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest

import planner.calibrate as calibrate_module
from planner.calibrate import calibrate, predict, uncalibrated
from planner.calibrate_device import device_pricing, identifiable_constants, pricing_text
from planner.cost import Layout, estimate
from planner.cost.compute import DeviceConstants, default_constants, layer_times
from planner.errors import InputError
from planner.schema import (
    Calibration,
    Cluster,
    LayerProfile,
    MeasuredOn,
    Operation,
    Plan,
    Profile,
    RunReport,
    TrainingSetup,
)
from profiler.synth import synth_transformer
from tests.planner.calib_helpers import Truth, base_profile, make_plan, synthetic_report
from tests.planner.test_calibrate import run_cli

DEVICE = "a100-80g"
TRUE = DeviceConstants(gemm_efficiency=0.62, memory_efficiency=0.7)


def synth(constants: DeviceConstants | None = None, *, layers: int = 6, mfu: float | None = None) -> Profile:
    """The test model (6 blocks, h 1024, s 1024) priced on an A100 with ``constants``."""
    return synth_transformer(
        layers=layers, hidden=1024, heads=16, seq=1024, vocab=32000, device_type=DEVICE, constants=constants, mfu=mfu
    )

#: the truth's links and overhead: the constants fit must not be thrown by them
LINKS = {"latency_s": 5e-6, "bandwidth": 2e10, "overhead_ms": 0.5}


def exact(profile: Profile) -> Truth:
    """Run where ``profile`` holds as it is (factors 1)."""
    n = profile.num_layers
    return Truth(tuple([1.0] * n), tuple([1.0] * n), **LINKS)


def a100_plan(
    profile: Profile, stages: list[tuple[int, int]], *, microbatch_size: int = 2, microbatches: int = 4,
    schedule: Literal["1f1b", "gpipe"] = "1f1b", recompute: bool = False, device_type: str = DEVICE,
) -> Plan:
    cluster = Cluster.model_validate({"devices": len(stages), "device_type": device_type})
    training = TrainingSetup(global_batch_size=microbatch_size * microbatches, optimizer="sgd")
    return estimate(
        profile, cluster, training,
        Layout(stages, num_microbatches=microbatches, schedule=schedule, recompute=recompute),
    )


def plans(profile: Profile) -> dict[str, Plan]:
    # "a" times the embedding alone (all memory-bound) and the head alone: stages of different
    # GEMM / memory mixes, which tell the two constants apart
    return {
        "a": a100_plan(profile, [(0, 1), (1, 4), (4, 7), (7, 8)]),
        "b": a100_plan(profile, [(0, 3), (3, 5), (5, 7), (7, 8)], microbatch_size=4, schedule="gpipe"),
        "c": a100_plan(profile, [(0, 2), (2, 4), (4, 6), (6, 8)], microbatch_size=1, microbatches=8, recompute=True),
        "held": a100_plan(profile, [(0, 2), (2, 5), (5, 7), (7, 8)], microbatch_size=2, microbatches=8),
    }


def reports_for(
    base: Profile, truth: Profile, names: tuple[str, ...] = ("a", "b", "c"), *, noise: float = 0.0
) -> list[tuple[str, RunReport]]:
    ps = plans(base)
    return [(n, synthetic_report(ps[n], truth, exact(truth), seed=i, noise=noise)) for i, n in enumerate(names)]


def test_recovers_known_constants_and_predicts_the_runs() -> None:
    base = synth()
    truth = synth(TRUE)
    reports = reports_for(base, truth)
    result = calibrate(base, reports)
    cal = result.profile.calibration
    assert cal is not None and cal.device_constants is not None
    dc = cal.device_constants
    assert dc.gemm_efficiency == pytest.approx(TRUE.gemm_efficiency, rel=0.02)
    assert dc.memory_efficiency == pytest.approx(TRUE.memory_efficiency, rel=0.02)
    assert dc.fitted == ["gemm_efficiency", "memory_efficiency"] and dc.device_type == DEVICE
    assert (dc.profiled_gemm_efficiency, dc.profiled_memory_efficiency) == (0.88, 0.85)
    assert dc.profiled_pricing == base.measured_on.pricing and dc.stages == 24
    assert "gemm_efficiency 0.62 and memory_efficiency 0.7 fitted to 24 timed stage(s)" in cal.device_constants_source
    assert "device model constants" in cal.method and "Gauss-Newton" in cal.method
    # the layers are re-priced with the fitted constants: the truth's times, and nothing left
    # for the per-layer factors to correct
    for layer, true_layer, c in zip(result.profile.layers, truth.layers, cal.layers, strict=True):
        assert c.forward_scale == pytest.approx(1.0, abs=0.01) and c.backward_scale == pytest.approx(1.0, abs=0.01)
        assert [x / c.forward_scale for x in layer.forward_ms] == pytest.approx(true_layer.forward_ms, rel=0.01)
        assert [x / c.backward_scale for x in layer.backward_ms] == pytest.approx(true_layer.backward_ms, rel=0.01)
        assert layer.backward_weight_ms == pytest.approx(true_layer.backward_weight_ms, rel=0.02)
    # measured_on.pricing says what priced it now, in the wording the next calibration reads
    pricing = result.profile.measured_on.pricing
    assert pricing is not None and pricing.startswith(f"device model {DEVICE}: gemm efficiency 0.62")
    assert "fitted by pipeplan calibrate" in pricing
    # every run, and a plan no run has seen, is predicted as it ran; before it was far off
    for name, r in reports:
        assert r.measured_step_ms is not None
        assert predict(r.plan, result.profile).predicted.step_time_ms == pytest.approx(r.measured_step_ms, rel=0.01), name
        assert abs(r.plan.predicted.step_time_ms / r.measured_step_ms - 1) > 0.2, name
    held = plans(base)["held"]
    measured = exact(truth).step_ms(held, truth)
    assert predict(held, result.profile).predicted.step_time_ms == pytest.approx(measured, rel=0.01)
    # the document round-trips
    assert Profile.model_validate_json(result.profile.model_dump_json()) == result.profile


def test_noisy_runs_still_give_the_constants() -> None:
    base = synth()
    truth = synth(TRUE)
    result = calibrate(base, reports_for(base, truth, noise=0.02))
    cal = result.profile.calibration
    assert cal is not None
    dc = cal.device_constants
    assert dc is not None and dc.fitted == ["gemm_efficiency", "memory_efficiency"]
    assert dc.gemm_efficiency == pytest.approx(TRUE.gemm_efficiency, rel=0.03)
    assert dc.memory_efficiency == pytest.approx(TRUE.memory_efficiency, rel=0.05)


def test_calibrating_again_starts_from_the_profiled_constants() -> None:
    base = synth()
    truth = synth(TRUE)
    reports = reports_for(base, truth)
    once = calibrate(base, reports).profile
    undone = uncalibrated(once)
    assert undone.measured_on == base.measured_on
    for a, b in zip(undone.layers, base.layers, strict=True):
        assert a.forward_ms == pytest.approx(b.forward_ms, rel=1e-9)
        assert a.backward_ms == pytest.approx(b.backward_ms, rel=1e-9)
        assert a.backward_input_ms == pytest.approx(b.backward_input_ms, rel=1e-9, abs=1e-12)
    again = calibrate(once, reports).profile.calibration
    assert again is not None and again.device_constants is not None
    assert again.device_constants.profiled_gemm_efficiency == 0.88
    assert again.device_constants.gemm_efficiency == pytest.approx(TRUE.gemm_efficiency, rel=0.02)


def gemm_only_profile(constants: DeviceConstants | None = None, *, layers: int = 6) -> Profile:
    """A profile of layers that are one large compute-bound GEMM each, priced by the device model."""
    sizes = [1, 2, 4]
    out = []
    for i in range(layers):
        ops = [[Operation(kind="gemm", dtype="bfloat16", m=2048 * b, n=4096 + 1024 * i, k=4096)] for b in sizes]
        times = [layer_times(o, device_type=DEVICE, constants=constants) for o in ops]
        out.append(
            LayerProfile(
                name=f"l{i}",
                param_bytes=(4096 + 1024 * i) * 4096 * 2,
                forward_ms=[t.forward for t in times],
                backward_ms=[t.backward for t in times],
                backward_input_ms=[t.backward_input for t in times],
                backward_weight_ms=[t.backward_weight for t in times],
                activation_bytes=[2048 * b * 4096 * 2 for b in sizes],
                output_bytes=[2048 * b * 4096 * 2 for b in sizes],
                operations=ops,
            )
        )
    c = constants or default_constants(DEVICE)
    return Profile(
        model="gemms",
        measured_on=MeasuredOn(device=f"synthetic:{DEVICE}", dtype="bfloat16", pricing=pricing_text(DEVICE, c)),
        microbatch_sizes=sizes,
        layers=out,
    )


def test_all_gemm_time_fits_gemm_efficiency_only() -> None:
    base = gemm_only_profile()
    truth = gemm_only_profile(DeviceConstants(gemm_efficiency=0.6, memory_efficiency=0.5))
    stages = [(0, 2), (2, 4), (4, 6)]
    ps = [a100_plan(base, stages), a100_plan(base, [(0, 1), (1, 3), (3, 6)], microbatch_size=4)]
    reports = [(f"r{i}", synthetic_report(p, truth, exact(truth))) for i, p in enumerate(ps)]
    result = calibrate(base, reports)
    cal = result.profile.calibration
    assert cal is not None and cal.device_constants is not None
    dc = cal.device_constants
    assert dc.fitted == ["gemm_efficiency"]
    assert dc.gemm_efficiency == pytest.approx(0.6, rel=0.02)
    assert dc.memory_efficiency == 0.85  # kept: no run's time depends on it
    assert "memory_efficiency kept at the profile's 0.85" in cal.device_constants_source
    assert "hardly depends on it" in cal.device_constants_source
    for name, r in reports:
        assert predict(r.plan, result.profile).predicted.step_time_ms == pytest.approx(r.measured_step_ms, rel=0.01), name


def test_one_mix_of_gemm_and_memory_fits_one_constant() -> None:
    # every timed stage holds blocks only, at one micro-batch size: each is the same mix of GEMM
    # and memory time, so only one constant (the larger share: gemm) can be told
    base, truth = synth(layers=8), synth(TRUE, layers=8)
    # the first and last stages (embedding, head) are run but too short to tell: time only the blocks
    p = a100_plan(base, [(0, 3), (3, 5), (5, 7), (7, 10)])
    report = synthetic_report(p, truth, exact(truth))
    timed = report.model_copy(update={
        "stages": [st.model_copy(update={"forward_ms": None, "backward_ms": None}) if st.index in (0, 3) else st
                   for st in report.stages],
        "timeline": [row for row in report.timeline if row.stage not in (0, 3)],
    })
    result = calibrate(base, [("r", timed)])
    cal = result.profile.calibration
    assert cal is not None and cal.device_constants is not None
    assert cal.device_constants.fitted == ["gemm_efficiency"]
    assert cal.device_constants.memory_efficiency == 0.85
    assert "only one of them is determined" in cal.device_constants_source


def test_measured_profile_is_calibrated_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    base = base_profile(8)
    truth = Truth(forward=(1.2, 1.9, 1.5, 1.3, 2.2, 1.4, 1.7, 1.1), backward=(1.6, 1.3, 2.0, 1.5, 1.2, 1.8, 1.4, 1.9))
    ps = [make_plan(base, [(0, 2), (2, 4), (4, 6), (6, 8)]), make_plan(base, [(0, 1), (1, 3), (3, 5), (5, 8)])]
    reports = [(f"r{i}", synthetic_report(p, base, truth)) for i, p in enumerate(ps)]
    assert device_pricing(base) == (None, "")
    new = calibrate(base, reports)
    # the path before this feature: no device-constants step at all
    monkeypatch.setattr(calibrate_module, "_fit_device_constants", lambda profile, reports, device_type: (profile, None, ""))
    old = calibrate(base, reports)
    assert new.profile == old.profile and new.notes == old.notes
    cal = new.profile.calibration
    assert cal is not None and cal.device_constants is None and cal.device_constants_source == ""
    assert "device model" not in cal.method and new.profile.measured_on.pricing is None


def test_flat_mfu_and_other_devices_keep_the_constants() -> None:
    flat = synth(mfu=0.5)
    truth = synth(mfu=0.4)
    result = calibrate(flat, reports_for(flat, truth, names=("a",)))
    cal = result.profile.calibration
    assert cal is not None and cal.device_constants is None
    assert "flat fraction of peak" in cal.device_constants_source and any("--mfu" in n for n in result.notes)
    # runs on another device than the profile was priced for: nothing fitted, said so
    base = synth()
    p = a100_plan(base, [(0, 4), (4, 8)], device_type="h100-80g")
    result = calibrate(base, [("h", synthetic_report(p, base, exact(base)))])
    cal = result.profile.calibration
    assert cal is not None and cal.device_constants is None
    assert "priced for 'a100-80g' but the runs ran on 'h100-80g'" in cal.device_constants_source


def test_bad_pricing_is_refused_with_the_value_and_the_fix() -> None:
    base = synth()
    broken = base.model_copy(update={"measured_on": base.measured_on.model_copy(
        update={"pricing": "device model a100-80g: gemm efficiency 1.7, memory efficiency 0.85"})})
    report = synthetic_report(plans(base)["a"], base, exact(base))
    with pytest.raises(InputError, match=r"1\.7.*re-synthesize the profile"):
        calibrate(broken, [("a", report)])


def test_schema_reads_old_calibrations_and_checks_the_constants() -> None:
    base = synth()
    truth = synth(TRUE)
    cal = calibrate(base, reports_for(base, truth, names=("a",))).profile.calibration
    assert cal is not None
    doc = cal.model_dump()
    old = {k: v for k, v in doc.items() if k not in ("device_constants", "device_constants_source")}
    assert Calibration.model_validate(old).device_constants is None  # written before: still reads
    doc["device_constants"]["gemm_efficiency"] = 1.5
    with pytest.raises(ValueError, match="less than or equal to 1"):
        Calibration.model_validate(doc)


def test_cli_prints_the_constants_and_the_synth_flags(tmp_path: Path) -> None:
    base = synth()
    truth = synth(TRUE)
    prof = tmp_path / "p.json"
    prof.write_text(base.model_dump_json())
    files = []
    for name, r in reports_for(base, truth):
        path = tmp_path / f"{name}.json"
        path.write_text(r.model_dump_json())
        files.append(str(path))
    out_file = tmp_path / "cal.json"
    code, out, err = run_cli(["calibrate", str(prof), *files, "-o", str(out_file)])
    assert code == 0, err
    assert f"device model {DEVICE}: gemm efficiency 0.62 (profiled 0.88), memory efficiency 0.7 (profiled 0.85)" in out
    assert f"--device-type {DEVICE} --gemm-efficiency 0.62 --memory-efficiency 0.7" in out
    # the flags give the profile the calibration re-priced
    synth_file = tmp_path / "synth.json"
    code, _, err = run_cli([
        "synth", "transformer", "--layers", "6", "--hidden", "1024", "--heads", "16", "--seq", "1024",
        "--vocab", "32000", "--device-type", DEVICE, "--gemm-efficiency", "0.62", "--memory-efficiency", "0.7",
        "-o", str(synth_file),
    ])
    assert code == 0, err
    again = Profile.model_validate_json(synth_file.read_text())
    calibrated = Profile.model_validate_json(out_file.read_text())
    assert calibrated.calibration is not None
    for a, b, c in zip(again.layers, calibrated.layers, calibrated.calibration.layers, strict=True):
        assert a.forward_ms == pytest.approx([x / c.forward_scale for x in b.forward_ms], rel=0.01)


def test_identifiable_constants_needs_different_mixes() -> None:
    """The rule calibrate and ``benchmarks/published.py`` share: rows that all mix GEMM and
    memory-bound time in one proportion determine one constant (the larger share's), rows of
    different mixes determine both, and rows that hardly depend on either determine none."""
    same = -np.array([[0.85, 0.15]] * 8)
    assert identifiable_constants(same, 0.03)[0] == [0]
    assert "same proportion" in identifiable_constants(same, 0.03)[1]
    mixed = -np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.1, 0.9]] * 2)
    assert identifiable_constants(mixed, 0.03) == ([0, 1], "")
    # the same mixes under far more noise than the spread allows: only one, then none
    assert len(identifiable_constants(mixed, 0.3)[0]) < 2
    assert identifiable_constants(-np.full((3, 2), 1e-4), 0.03)[0] == []
