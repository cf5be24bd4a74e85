"""The measured-vs-predicted report."""

from __future__ import annotations

import json

import pytest

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


def _ranks(hosts: tuple[str, str], *, drop: bool = False) -> list:  # type: ignore[type-arg]
    from runtime.report import RankRecord

    out = []
    for r, host in enumerate(hosts):
        phases, events = [], []
        for step in range(3):
            t0 = 100.0 * step + 0.0005 * r  # rank 1 starts each step 0.5 ms after rank 0
            phases.append([t0, 0.010, 0.001, 0.0, 0.002])
            acts = [("F", 0, t0 + 0.001, t0 + 0.002), ("F", 1, t0 + 0.002, t0 + 0.003),
                    ("B", 0, t0 + 0.004, t0 + 0.006), ("B", 1, t0 + 0.006, t0 + 0.008)]
            events.append(acts[:-1] if drop and r == 1 and step == 2 else acts)
        out.append(RankRecord(rank=r, replica=0, host=host, stages=[r], allreduce_bytes=0, phases=phases,
                              events={r: events}))
    return out


def test_report_timeline_and_phases_on_one_clock() -> None:
    from runtime.report import load_report

    plan = make_plan(_profile(NAMES, PARAMS), [(0, 2), (2, 5)], microbatches=2)
    kw = dict(
        model="m:f", step_ms=[12.0, 12.0, 12.0], losses=[1.0, float("nan"), 0.5], stage_forward_ms={}, stage_backward_ms={},
        peak_memory={}, backend="gloo", device="cpu", optimizer="sgd", lr=0.1, seed=0, threads_per_rank=1,
    )
    report = build_report(plan, **kw, ranks=_ranks(("h", "h")))  # type: ignore[arg-type]
    assert report.shared_clock and report.plan == plan and report.warmup_steps == 1
    assert report.steps[1].loss is None  # NaN is not JSON: the report says "no value"
    assert len(report.rank_steps) == 6 and len(report.ranks) == 2
    r1 = [r for r in report.rank_steps if r.rank == 1]
    assert all(r.start_ms == pytest.approx(0.5) and r.schedule_ms == pytest.approx(10.0) for r in r1)
    assert all(r.optimizer_ms == pytest.approx(2.0) and r.allreduce_ms == pytest.approx(1.0) for r in r1)
    # the timed steps (1 and 2), one row per stage, times after the step's first start
    assert [(t.stage, t.step) for t in report.timeline] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    row = report.timeline[1]
    assert row.forward_start_ms == pytest.approx([1.5, 2.5]) and row.backward_ms == pytest.approx([2.0, 2.0])
    assert report.timeline[0].forward_start_ms == pytest.approx([1.0, 2.0])
    # the JSON is the schema's document, read back strictly
    again = load_report(report.to_json(), source="r.json")
    assert again == report
    # ranks on two hosts: each on its own clock; a step missing a micro-batch has no row
    apart = build_report(plan, **kw, ranks=_ranks(("h", "g"), drop=True))  # type: ignore[arg-type]
    assert not apart.shared_clock and all(r.start_ms == 0.0 for r in apart.rank_steps)
    assert apart.timeline[1].forward_start_ms == pytest.approx([1.0, 2.0])
    assert [(t.stage, t.step) for t in apart.timeline] == [(0, 1), (1, 1), (0, 2)]


def test_fold_loss_counts_it_in_the_last_forward() -> None:
    from runtime.worker import _fold_loss

    record: dict = {"forward": [[1.0, 2.0]], "backward": [[]], "events": [[("F", 0, 0.0, 0.001), ("F", 1, 0.002, 0.004)]]}  # type: ignore[type-arg]
    _fold_loss(record, 0, 0.0041, 0.0051)
    assert record["forward"][0] == pytest.approx([1.0, 3.0])
    assert record["events"][0][-1] == ("F", 1, 0.002, 0.0051)


def test_rss_note_round_trips_and_the_peak_rss_sees_an_allocation() -> None:
    from runtime.report import (
        RssRow,
        current_rss_bytes,
        parse_rss_note,
        peak_rss_bytes,
        reset_peak_rss,
        rss_note,
    )

    mib = 1 << 20
    rows = [RssRow(1, (1,), 700 * mib, 500 * mib, 400 * mib), RssRow(0, (0, 3), 512 * mib, None, None, False)]
    note = rss_note(rows)
    assert parse_rss_note(["other note", note]) == sorted(rows, key=lambda r: r.rank)
    assert parse_rss_note(["other note"]) == []
    before, peak0 = current_rss_bytes(), peak_rss_bytes()
    assert before is not None and peak0 is not None and peak0 >= before > 0
    block = bytearray(b"\1" * (peak0 + 64 * mib - before))  # touched: resident, above the old peak
    peak1 = peak_rss_bytes()
    assert peak1 is not None and peak1 >= peak0 + 32 * mib
    del block
    if reset_peak_rss():  # Linux: the peak starts again from the resident set now, below the block's
        peak2 = peak_rss_bytes()
        assert peak2 is not None and peak2 < peak1 - 32 * mib


def test_collectives_per_axis_beside_the_plans_prediction() -> None:
    """Per axis, per step the slowest rank's time, median over the steps after the first, beside
    the plan's ``Predicted`` figure; axes the plan does not have are left out."""
    from runtime.report import collective_times, collectives_note

    base = make_plan(_profile(NAMES, PARAMS), [(0, 2), (2, 5)], microbatches=2)
    predicted = base.predicted.model_copy(
        update={"tensor_parallel_ms": 1.5, "zero_ms": 2.5, "pipeline_transfer_ms": 0.25, "allreduce_ms": 4.0}
    )
    plan = base.model_copy(update={"tensor_parallel_degree": 2, "data_parallel_degree": 2, "zero_stage": 3,
                                   "predicted": predicted})  # fmt: skip

    def step(tp: float, ag: float, rs: float, send: float, recv: float, calls: int = 3) -> dict[str, float]:
        return {"tensor_parallel_ms": tp, "tensor_parallel_calls": calls, "data_parallel_ms": 1.0,
                "tied_weights_ms": 0.0, "fsdp_all_gather_ms": ag, "fsdp_reduce_scatter_ms": rs, "fsdp_calls": 2,
                "transfer_send_ms": send, "transfer_receive_ms": recv, "transfer_calls": 4}  # fmt: skip

    # two ranks, 4 steps; step 0 is warm-up (huge, dropped)
    rows = [
        [step(99, 99, 99, 99, 99), step(1, 1, 1, 1, 1), step(2, 1, 3, 1, 5), step(3, 5, 0, 1, 1)],
        [step(99, 99, 99, 99, 99), step(4, 2, 2, 0, 1, calls=5), step(1, 1, 1, 1, 1), step(2, 1, 1, 2, 2)],
    ]
    times = collective_times(plan, rows)
    assert times is not None
    assert times.tensor_parallel is not None and times.fsdp is not None and times.pipeline_transfers is not None
    assert times.data_parallel is not None and times.tied_weights is None  # no tied-weight sums measured
    # tensor parallel: per step max(1, 4), max(2, 1), max(3, 2) -> median 3; calls max(3, 5), 3, 3 -> 3
    assert times.tensor_parallel.measured_ms == 3.0 and times.tensor_parallel.calls == 3
    assert times.tensor_parallel.predicted_ms == 1.5
    # FSDP: sums per step (2, 4), (4, 2), (5, 2) -> slowest 4, 4, 5 -> median 4; parts from the slowest rank
    assert times.fsdp.measured_ms == 4.0 and times.fsdp.predicted_ms == 2.5
    assert times.fsdp.parts_ms == {"all_gather": 2.0, "reduce_scatter": 2.0}  # medians of (2,1,5) and (2,3,0)
    # transfers: (2, 1), (6, 2), (2, 4) -> 2, 6, 4 -> 4; parts: send (1,1,2) -> 1, receive (1,5,2) -> 2
    assert times.pipeline_transfers.measured_ms == 4.0 and times.pipeline_transfers.predicted_ms == 0.25
    assert times.pipeline_transfers.parts_ms == {"send": 1.0, "receive": 2.0}
    assert times.data_parallel.measured_ms == 1.0 and times.data_parallel.predicted_ms == 4.0
    note = collectives_note(plan, times)
    assert note.startswith("collectives per step: tensor-parallel collectives")
    assert "measured 3.00 ms in 3 redistributions, predicted 1.50 ms" in note
    assert "measured 4.00 ms in 2 collectives (all-gathers 2.00 ms, reduce-scatters 2.00 ms), predicted 2.50 ms" in note
    assert "measured 4.00 ms in 4 sends and receives" in note and "predicted 0.25 ms" in note
    assert "waiting on receives 2.00 ms" in note and "a receive waits for the peer's compute" in note
    # a K = 1, D = 1, T = 1 plan has no axis to report; a plan from before the per-axis figures says so
    solo = base.model_copy(update={"pipeline_degree": 1})
    assert collectives_note(solo, collective_times(solo, rows)) == ""
    old = plan.model_copy(update={"predicted": base.predicted.model_copy(update={"tensor_parallel_ms": None})})
    assert "the plan predicts none" in collectives_note(old, collective_times(old, rows))
