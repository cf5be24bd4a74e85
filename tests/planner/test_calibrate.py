"""``pipeplan calibrate``: the fit recovers a known truth from synthetic run reports."""

from __future__ import annotations

import contextlib
import io
import json
import statistics
from pathlib import Path

import pytest

from pipeplan.cli import main
from planner.calibrate import calibrate, calibrated_cluster, link_samples, predict, uncalibrated
from planner.errors import InputError
from planner.schema import Plan, Profile, RunReport, load_document
from tests.planner.calib_helpers import (
    Truth,
    base_profile,
    holdout_error,
    make_plan,
    synthetic_report,
)

N = 8
#: every layer boundary is a stage boundary of some plan below, so every factor is identifiable
SPLITS = {
    "a": [(0, 2), (2, 4), (4, 6), (6, 8)],
    "b": [(0, 1), (1, 3), (3, 5), (5, 7)],
    "c": [(0, 3), (3, 5), (5, 7), (7, 8)],
}


def truth_factors() -> Truth:
    # uneven on purpose: each layer is slowed down differently from its neighbours
    return Truth(
        forward=(1.2, 1.9, 1.5, 1.3, 2.2, 1.4, 1.7, 1.1),
        backward=(1.6, 1.3, 2.0, 1.5, 1.2, 1.8, 1.4, 1.9),
        latency_s=0.4e-3,
        bandwidth=2e8,
        overhead_ms=5.0,
    )


def fixed_splits(base: Profile) -> dict[str, Plan]:
    b = [(0, 1), (1, 3), (3, 5), (5, 8)]
    return {
        "a": make_plan(base, SPLITS["a"], schedule="1f1b", microbatches=4, microbatch_size=2),
        "b": make_plan(base, b, schedule="gpipe", microbatches=4, microbatch_size=4),
        "c": make_plan(base, [(0, 3), (3, 5), (5, 7), (7, 8)], schedule="1f1b", microbatches=8, microbatch_size=1),
        "held": make_plan(base, [(0, 2), (2, 5), (5, 6), (6, 8)], schedule="1f1b", microbatches=4, microbatch_size=2),
    }


def test_recovers_factors_links_and_overhead_from_exact_reports() -> None:
    base, truth = base_profile(N), truth_factors()
    plans = fixed_splits(base)
    reports = [(name, synthetic_report(plans[name], base, truth)) for name in ("a", "b", "c")]
    result = calibrate(base, reports)
    cal = result.profile.calibration
    assert cal is not None
    for i in range(N):
        assert cal.layers[i].forward_scale == pytest.approx(truth.forward[i], rel=0.05), i
        assert cal.layers[i].backward_scale == pytest.approx(truth.backward[i], rel=0.05), i
        assert cal.layers[i].stages_seen == 3
        assert result.profile.layers[i].forward_ms[1] == pytest.approx(base.layers[i].forward_ms[1] * cal.layers[i].forward_scale)
    # the cpu preset puts every device on its own node: the links between them are inter-node
    link = cal.inter_node
    assert link is not None and cal.intra_node is None
    assert link.latency_s == pytest.approx(truth.latency_s, rel=0.05)
    assert link.bandwidth_bytes_per_s == pytest.approx(truth.bandwidth, rel=0.05)
    assert link.transfers > 20 and "latency and bandwidth fitted" in link.source
    assert cal.step_overhead_ms == pytest.approx(truth.overhead_ms, abs=1.0)
    # each training run, and a plan no run has seen, are predicted as they ran
    for name, r in reports:
        assert r.measured_step_ms is not None
        assert predict(r.plan, result.profile).predicted.step_time_ms == pytest.approx(r.measured_step_ms, rel=0.01), name
    assert holdout_error(result.profile, plans["held"], base, truth) < 0.01
    # and far better than before calibration
    assert abs(plans["held"].predicted.step_time_ms / truth.step_ms(plans["held"], base) - 1) > 0.2


def test_one_report_spreads_each_stage_over_its_layers_in_proportion() -> None:
    base, truth = base_profile(N), truth_factors()
    plan = make_plan(base, SPLITS["a"])
    report = synthetic_report(plan, base, truth)
    cal = calibrate(base, [("a", report)]).profile.calibration
    assert cal is not None
    true_profile = truth.profile(base)
    for a, b in SPLITS["a"]:
        fwd = [cal.layers[i].forward_scale for i in range(a, b)]
        assert max(fwd) / min(fwd) == pytest.approx(1.0, abs=1e-3)  # one factor per stage
        # ... the stage's measured / profiled time
        measured = sum(true_profile.layers[i].forward_ms[1] for i in range(a, b))
        profiled = sum(base.layers[i].forward_ms[1] for i in range(a, b))
        assert fwd[0] == pytest.approx(measured / profiled, rel=0.03)


def test_combining_reports_of_different_splits_predicts_better() -> None:
    base, truth = base_profile(N), truth_factors()
    plans = fixed_splits(base)
    reports = {name: synthetic_report(plans[name], base, truth) for name in ("a", "b", "c")}
    one = calibrate(base, [("a", reports["a"])]).profile
    three = calibrate(base, [(n, reports[n]) for n in ("a", "b", "c")]).profile
    err_one = holdout_error(one, plans["held"], base, truth)
    err_three = holdout_error(three, plans["held"], base, truth)
    assert err_three < err_one / 3, (err_one, err_three)


def test_a_busier_run_moves_its_own_level_not_the_layers() -> None:
    """Two runs of different splits, one on a 30 % busier machine: the layer factors stay
    within the truth's range instead of bending a small layer to explain the difference."""
    base, truth = base_profile(N), Truth(forward=(1.5,) * N, backward=(1.5,) * N)
    plans = fixed_splits(base)
    reports = [
        ("a", synthetic_report(plans["a"], base, truth, level=1.3)),
        ("b", synthetic_report(plans["b"], base, truth, level=1.0)),
    ]
    cal = calibrate(base, reports).profile.calibration
    assert cal is not None
    factors = [c.forward_scale for c in cal.layers] + [c.backward_scale for c in cal.layers]
    assert 1.3 < min(factors) and max(factors) < 2.1, factors
    assert max(factors) / min(factors) < 1.25, factors
    # the overhead is what each run's step leaves unexplained at that run's own level, not
    # the busier run's extra compute
    assert cal.step_overhead_ms == pytest.approx(truth.overhead_ms, abs=1.0)


def test_noisy_reports_stay_close() -> None:
    base, truth = base_profile(N), truth_factors()
    plans = fixed_splits(base)
    reports = [(n, synthetic_report(plans[n], base, truth, noise=0.05, seed=i)) for i, n in enumerate("abc")]
    result = calibrate(base, reports)
    assert holdout_error(result.profile, plans["held"], base, truth) < 0.05


def test_data_parallel_all_reduce_is_a_link_sample() -> None:
    base, truth = base_profile(N), truth_factors()
    plan = make_plan(base, [(0, 4), (4, 8)], data_parallel=2, microbatches=4)
    report = synthetic_report(plan, base, truth)
    samples = link_samples(base, report)
    collectives = [s for s in samples if s.collective]
    assert collectives and all(s.latencies == 2.0 for s in collectives)  # 2(D-1) latencies of a ring
    # its time is what the ring formula says of the truth's link
    s = collectives[0]
    assert s.ms == pytest.approx(s.latencies * truth.latency_s * 1e3 + s.bytes / truth.bandwidth * 1e3, rel=1e-6)
    result = calibrate(base, [("dp", report)])
    link = result.profile.calibration.inter_node  # type: ignore[union-attr]
    assert link is not None and link.collectives == len(collectives)
    assert holdout_error(result.profile, plan, base, truth) < 0.01


def test_layers_no_run_timed_keep_their_profiled_times() -> None:
    base, truth = base_profile(N), truth_factors()
    plan = make_plan(base, SPLITS["a"])
    report = synthetic_report(plan, base, truth)
    # stage 1 (layers 2:4) was not timed
    stages = [s.model_copy(update={"forward_ms": None, "backward_ms": None}) if s.index == 1 else s for s in report.stages]
    timeline = [t for t in report.timeline if t.stage != 1]
    report = report.model_copy(update={"stages": stages, "timeline": timeline})
    result = calibrate(base, [("a", report)])
    cal = result.profile.calibration
    assert cal is not None
    for i in (2, 3):
        assert cal.layers[i].stages_seen == 0
        assert cal.layers[i].forward_scale == 1.0 and cal.layers[i].backward_scale == 1.0
        assert result.profile.layers[i].forward_ms == base.layers[i].forward_ms
    assert cal.layers[0].stages_seen == 1 and cal.layers[0].forward_scale != 1.0


def test_calibrating_a_calibrated_profile_starts_from_the_profiled_figures() -> None:
    base, truth = base_profile(N), truth_factors()
    plans = fixed_splits(base)
    ra = synthetic_report(plans["a"], base, truth)
    rb = synthetic_report(plans["b"], base, truth)
    once = calibrate(base, [("a", ra)]).profile
    assert uncalibrated(once).layers[3].forward_ms == pytest.approx(base.layers[3].forward_ms)
    again = calibrate(once, [("b", rb)]).profile
    direct = calibrate(base, [("b", rb)]).profile
    assert [x for layer in again.layers for x in layer.forward_ms] == pytest.approx(
        [x for layer in direct.layers for x in layer.forward_ms]
    )
    assert again.calibration is not None and [r.report for r in again.calibration.runs] == ["b"]


def test_provenance_and_the_cost_model_read_the_calibration() -> None:
    base, truth = base_profile(N), truth_factors()
    plans = fixed_splits(base)
    reports = [(f"runs/{n}.json", synthetic_report(plans[n], base, truth)) for n in ("a", "b")]
    result = calibrate(base, reports)
    prof = result.profile
    cal = prof.calibration
    assert cal is not None and cal.device_type == "cpu"
    assert [r.report for r in cal.runs] == ["runs/a.json", "runs/b.json"]
    assert cal.runs[0].plan.startswith("1f1b K=4 D=1 M=4x2 0:2,2:4,4:6,6:8")
    for run, (_, r) in zip(cal.runs, reports, strict=True):
        assert run.measured_step_ms == r.measured_step_ms
        assert run.predicted_before_ms == pytest.approx(r.plan.predicted.step_time_ms)
        assert abs(run.predicted_after_ms / run.measured_step_ms - 1) < abs(run.predicted_before_ms / run.measured_step_ms - 1)
    assert "median of measured - predicted" in cal.step_overhead_source and "Gauss-Newton" in cal.method
    # the document round-trips through the schema, and the cost model adds the overhead
    again = Profile.model_validate_json(prof.model_dump_json())
    assert again == prof
    plan = make_plan(prof, SPLITS["a"])
    assert plan.predicted.step_overhead_ms == cal.step_overhead_ms > 0
    assert plan.predicted.lower_bound_ms >= cal.step_overhead_ms
    assert any("calibrated from 2 run(s)" in n for n in plan.notes)
    # clusters of the runs' device kind get the fitted links; other kinds keep theirs
    link = cal.inter_node
    assert link is not None
    fitted = calibrated_cluster(plans["a"].cluster, prof)
    assert fitted.inter_node.latency_s == link.latency_s
    other = Plan.model_validate(plans["a"].model_dump()).cluster.model_copy(
        update={"devices": [d.model_copy(update={"name": "h100-80g"}) for d in plans["a"].cluster.devices]}
    )
    assert calibrated_cluster(other, prof) == other


def _write(path: Path, obj: Profile | RunReport) -> str:
    path.write_text(obj.model_dump_json(indent=1))
    return str(path)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_cli_calibrates_and_plan_uses_it(tmp_path: Path) -> None:
    base, truth = base_profile(N), truth_factors()
    plans = fixed_splits(base)
    prof = _write(tmp_path / "p.json", base)
    reports = [_write(tmp_path / f"r{n}.json", synthetic_report(plans[n], base, truth)) for n in ("a", "b")]
    out_file = tmp_path / "cal.json"
    code, out, err = run_cli(["calibrate", prof, *reports, "-o", str(out_file)])
    assert code == 0, err
    assert "calibrated from 2 run(s)" in out and "step overhead" in out and str(out_file) in out
    rows = [line for line in out.splitlines() if line.startswith(str(tmp_path))]
    assert len(rows) == 2
    cal: Profile = load_document("profile", str(out_file))
    assert cal.calibration is not None
    # plan and estimate with the calibrated profile: the fitted link and the overhead are used
    plan_file = tmp_path / "plan.json"
    code, out, err = run_cli(
        ["estimate", str(out_file), "--devices", "4", "--device-type", "cpu", "--batch-size", "8", "--optimizer", "sgd",
         "--stages", "0:2,2:5,5:6,6:8", "--microbatches", "4", "-o", str(plan_file), "--json"]
    )
    assert code == 0, err
    plan = json.loads(plan_file.read_text())
    assert plan["cluster"]["inter_node"]["latency_s"] == cal.calibration.inter_node.latency_s  # type: ignore[union-attr]
    assert plan["predicted"]["step_overhead_ms"] == cal.calibration.step_overhead_ms
    measured = truth.step_ms(plans["held"], base)
    assert abs(plan["predicted"]["step_time_ms"] / measured - 1) < 0.02
    # an explicit link flag wins over the calibration
    code, out, err = run_cli(
        ["estimate", str(out_file), "--devices", "4", "--device-type", "cpu", "--inter-node", "ib-ndr",
         "--stages", "0:4,4:8", "--microbatches", "4", "--json"]
    )
    assert code == 0, err
    assert json.loads(out)["cluster"]["inter_node"]["latency_s"] != cal.calibration.inter_node.latency_s  # type: ignore[union-attr]
    code, out, err = run_cli(["plan", str(out_file), "--devices", "2", "--device-type", "cpu", "--batch-size", "8",
                              "--time-limit", "1"])
    assert code == 0, err
    assert "note: costs calibrated from 2 run(s)" in out


def test_cli_errors(tmp_path: Path) -> None:
    base, truth = base_profile(N), truth_factors()
    plan = make_plan(base, SPLITS["a"])
    report = synthetic_report(plan, base, truth)
    prof = _write(tmp_path / "p.json", base)
    good = _write(tmp_path / "r.json", report)
    out = str(tmp_path / "out.json")

    other = base_profile(N + 1)
    code, _, err = run_cli(["calibrate", _write(tmp_path / "other.json", other), good, "-o", out])
    assert code == 1 and err.startswith("error: report ") and "ran a plan for another model" in err, err

    h100 = plan.cluster.model_copy(update={"devices": [d.model_copy(update={"name": "h100-80g"}) for d in plan.cluster.devices]})
    odd = report.model_copy(update={"plan": plan.model_copy(update={"cluster": h100})})
    code, _, err = run_cli(["calibrate", prof, good, _write(tmp_path / "odd.json", odd), "-o", out])
    assert code == 1 and "different kinds of devices" in err, err

    untimed = report.model_copy(
        update={"stages": [s.model_copy(update={"forward_ms": None, "backward_ms": None}) for s in report.stages], "timeline": []}
    )
    code, _, err = run_cli(["calibrate", prof, _write(tmp_path / "untimed.json", untimed), "-o", out])
    assert code == 1 and "no report timed any stage" in err, err

    v1 = json.loads(report.model_dump_json())
    del v1["schema_version"]
    v1["version"] = 1
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    code, _, err = run_cli(["calibrate", prof, str(tmp_path / "v1.json"), "-o", out])
    assert code == 1 and "version-1 run report" in err and "pipeplan run" in err, err

    code, _, err = run_cli(["calibrate", prof, *([good] * 65), "-o", out])
    assert code == 1 and "65 run reports is beyond what one calibration reads (at most 64)" in err, err

    code, _, err = run_cli(["calibrate", prof, str(tmp_path / "missing.json"), "-o", out])
    assert code == 1 and "report file" in err and "does not exist" in err, err
    assert not Path(out).exists()


def test_real_report_shapes_are_what_the_fit_reads() -> None:
    """The fit reads each stage's times from the report's median step (the step its step time
    is): per step the mean over the micro-batches."""
    base, truth = base_profile(N), truth_factors()
    plan = make_plan(base, SPLITS["a"])
    report = synthetic_report(plan, base, truth, noise=0.1, seed=3, steps=6)
    # distinct step times: timed steps 1..5, the median one is step 4
    times = {1: 90.0, 2: 130.0, 3: 80.0, 4: 100.0, 5: 120.0}
    report = report.model_copy(
        update={"steps": [s.model_copy(update={"measured_ms": times.get(s.step, s.measured_ms)}) for s in report.steps]}
    )
    from planner.calibrate import stage_means

    means = stage_means(report)
    for st in report.stages:
        (row,) = [t for t in report.timeline if t.stage == st.index and t.step == 4]  # one replica
        assert means[st.index][0] == pytest.approx(statistics.fmean(row.forward_ms))
        assert means[st.index][1] == pytest.approx(statistics.fmean(row.backward_ms))
        rows = [t for t in report.timeline if t.stage == st.index and t.step >= report.warmup_steps]
        assert st.forward_ms == pytest.approx(statistics.median(x for t in rows for x in t.forward_ms))
    with pytest.raises(InputError, match="at least one run report"):
        calibrate(base, [])


def test_stage_times_come_from_one_step_so_they_simulate_the_measured_step() -> None:
    """A busy machine slows different stages in different steps: per-stage medians over the
    steps would pair a fast first stage with a fast last stage that no step ran, and predict a
    step faster than the median one measured.  The median step's own stage times reproduce it."""
    base = base_profile(N)
    truth = Truth(forward=(1.0,) * N, backward=(1.0,) * N, overhead_ms=0.0)
    plan = make_plan(base, [(0, 4), (4, 8)], schedule="gpipe", devices=2)
    report = synthetic_report(plan, base, truth, steps=4)
    # step 1: stage 0 twice as slow; step 2: stage 1 twice as slow; step 3 as profiled
    slow = {(1, 0), (2, 1)}
    timeline = [
        row.model_copy(
            update={
                key: [x * 2 for x in getattr(row, key)]
                for key in ("forward_ms", "backward_ms")
                if (row.step, row.stage) in slow
            }
        )
        for row in report.timeline
    ]
    from planner.calibrate import stage_means
    from planner.simulator import simulate_schedule

    def makespan(fwd: list[float], bwd: list[float]) -> float:
        return simulate_schedule(plan.schedule, 2, plan.num_microbatches, fwd, bwd).makespan_ms

    per_step = {
        step: makespan(
            [statistics.fmean(r.forward_ms) for r in sorted(timeline, key=lambda r: r.stage) if r.step == step],
            [statistics.fmean(r.backward_ms) for r in sorted(timeline, key=lambda r: r.stage) if r.step == step],
        )
        for step in (1, 2, 3)
    }
    steps = [s.model_copy(update={"measured_ms": per_step.get(s.step, s.measured_ms)}) for s in report.steps]
    report = report.model_copy(update={"timeline": timeline, "steps": steps})
    means = stage_means(report)
    predicted = makespan([means[0][0], means[1][0]], [means[0][1], means[1][1]])  # type: ignore[list-item]
    assert predicted == pytest.approx(statistics.median(per_step.values()), rel=1e-6)
    assert predicted > min(per_step.values()) * 1.2  # the per-stage medians' step is the fastest one


def test_report_rows_are_counted_before_validation() -> None:
    from planner.limits import MAX_REPORT_ROWS
    from planner.schema import parse_document

    base, truth = base_profile(N), truth_factors()
    data = synthetic_report(make_plan(base, SPLITS["a"]), base, truth).model_dump(mode="json")
    for name in ("rank_steps", "timeline"):
        bad = dict(data, **{name: [None] * (MAX_REPORT_ROWS + 1)})  # validation would name each None
        with pytest.raises(InputError, match=f"{MAX_REPORT_ROWS + 1:,} .* is beyond what a run report holds"):
            parse_document("report", bad)


def test_selective_recompute_time_scales_with_the_forward_and_is_undone() -> None:
    """Selective recompute reruns part of a layer's forward: calibration scales its time by the
    layer's forward factor, and calibrating again starts from the profiled figure."""
    base, truth = base_profile(N), truth_factors()
    sel = [[0.25 * t for t in layer.forward_ms] for layer in base.layers]
    base = base.model_copy(update={"layers": [
        layer.model_copy(update={"selective_recompute_ms": s, "selective_recompute_bytes": [100] * len(s)})
        for layer, s in zip(base.layers, sel, strict=True)
    ]})  # fmt: skip
    plans = fixed_splits(base)
    reports = [(name, synthetic_report(plans[name], base, truth)) for name in ("a", "b", "c")]
    result = calibrate(base, reports)
    cal = result.profile.calibration
    assert cal is not None
    for i, layer in enumerate(result.profile.layers):
        assert layer.selective_recompute_ms is not None
        for got, profiled in zip(layer.selective_recompute_ms, sel[i], strict=True):
            assert got == pytest.approx(profiled * cal.layers[i].forward_scale, rel=1e-12)
    undone = uncalibrated(result.profile)
    for i, layer in enumerate(undone.layers):
        assert layer.selective_recompute_ms == pytest.approx(sel[i], rel=1e-12)
