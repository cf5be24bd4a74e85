"""The measured-vs-predicted report."""

from __future__ import annotations

import json

from runtime.report import build_report, render_lines
from tests.runtime.helpers import make_plan
from tests.runtime.test_plan_check import NAMES, PARAMS, _profile


def test_report_medians_ratios_and_json() -> None:
    plan = make_plan(_profile(NAMES, PARAMS), [(0, 2), (2, 5)], microbatches=2)
    pred = plan.predicted.step_time_ms
    report = build_report(
        plan,
        model="m:f",
        step_ms=[10 * pred, pred, 2 * pred, 3 * pred],
        losses=[1.0, 0.9, 0.8, 0.7],
        stage_forward_ms={0: [[100.0, 100.0], [1.0, 3.0], [2.0, 2.0], [2.0, 5.0]]},
        stage_backward_ms={1: [[50.0], [4.0], [4.0], [6.0]]},
        peak_memory={},
        backend="gloo",
        device="cpu",
        optimizer="sgd",
        lr=0.1,
        seed=0,
        threads_per_rank=1,
    )
    assert report.steps[0].warmup and not report.steps[1].warmup
    assert report.measured_step_ms == 2 * pred and report.ratio == 2.0  # median of steps 1..3
    s0, s1 = report.stages
    assert s0.forward_ms == 2.0 and s0.microbatches_timed == 6  # warm-up step dropped
    assert s0.forward_ratio == 2.0 / plan.stages[0].forward_ms
    assert s1.forward_ms is None and s1.backward_ms == 4.0
    data = json.loads(report.to_json())
    assert data["steps"][2]["ratio"] == 2.0 and data["stages"][1]["predicted_backward_ms"] == plan.stages[1].backward_ms
    # rank 0 (stage 0) computed 4, 4 and 7 ms in steps of 1, 2 and 3 x pred ms
    expected = sorted([4.0 / pred, 4.0 / (2 * pred), 7.0 / (3 * pred)])[1]
    assert report.rank_busy_fraction[0] == expected
    text = "\n".join(render_lines(report))
    assert "measured/predicted 2.00" in text and "(warm-up)" in text
