"""Gantt and memory charts for every schedule: non-empty images of the expected size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image

from planner.charts import (
    chart_figure,
    figure_svg,
    gantt_figure,
    gantt_svg,
    memory_breakdown,
    memory_figure,
    memory_svg,
    save_chart,
)
from planner.cost import simulate_plan, static_bytes
from planner.errors import InputError
from planner.schema import Plan, Profile

from .conftest import CASES, make_plan


def _svg_size(svg: str) -> tuple[float, float]:
    head = svg[svg.index("<svg") :][:600]
    w = re.search(r'\bwidth="([0-9.]+)pt"', head)
    h = re.search(r'\bheight="([0-9.]+)pt"', head)
    assert w and h, head
    return float(w.group(1)), float(h.group(1))


def _distinct_colours(path: Path) -> int:
    with Image.open(path) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None
    return len(colours)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gantt_png_has_the_figure_size(case: str, tiny_profile: Profile, tmp_path: Path) -> None:
    plan = make_plan(tiny_profile, case)
    fig = gantt_figure(plan, width_in=8.0, height_in=3.0, dpi=50)
    out = save_chart(fig, tmp_path / "g.png")
    with Image.open(out) as im:
        assert im.format == "PNG"
        assert im.size == (400, 150)
    # boxes in several colours: forward, backward, micro-batch shades, hatching, text
    assert _distinct_colours(out) > 20


@pytest.mark.parametrize("case", sorted(CASES))
def test_memory_png_has_the_figure_size(case: str, tiny_profile: Profile, tmp_path: Path) -> None:
    plan = make_plan(tiny_profile, case)
    out = save_chart(memory_figure(plan, width_in=6.0, height_in=4.0, dpi=50), tmp_path / "m.PNG")
    with Image.open(out) as im:
        assert im.size == (300, 200)
    assert _distinct_colours(out) > 10


@pytest.mark.parametrize("case", sorted(CASES))
def test_svgs_for_every_schedule(case: str, tiny_profile: Profile) -> None:
    plan = make_plan(tiny_profile, case)
    sim = simulate_plan(plan)
    gantt = gantt_svg(plan)
    k = plan.pipeline_degree
    # default size: 12 in wide, 1.6 in + 0.45 in per rank high, at 72 pt per inch
    assert _svg_size(gantt) == pytest.approx((12 * 72, (1.6 + 0.45 * k) * 72))
    assert f"bubble {sim.bubble_fraction:.1%}" in gantt
    assert gantt.count("<path") > sum(len(t) for t in sim.timelines)  # at least one box per event
    memory = memory_svg(plan)
    assert _svg_size(memory) == pytest.approx((720, 360))
    for label in ("parameters", "gradients", "optimizer state", "activations", "usable memory"):
        assert label in memory


def test_gantt_title_names_schedule_and_bubble(any_plan: Plan) -> None:
    fig = gantt_figure(any_plan)
    title = fig.axes[0].get_title()
    assert any_plan.schedule in title
    assert f"{simulate_plan(any_plan).bubble_fraction:.1%}" in title
    # one y tick (row) per pipeline rank
    assert len(fig.axes[0].get_yticks()) == any_plan.pipeline_degree


def test_memory_breakdown_adds_up_to_the_predicted_peak(any_plan: Plan) -> None:
    parts = memory_breakdown(any_plan)
    assert len(parts) == any_plan.pipeline_degree
    t = any_plan.training
    for p in parts:
        stages = [s for s in any_plan.stages if s.index in p.stages]
        assert p.parameters == sum(s.param_bytes for s in stages)
        assert p.gradients == pytest.approx(p.parameters * t.gradient_bytes_per_param_byte)
        assert p.optimizer_state == pytest.approx(p.parameters * t.optimizer_state_factor)
        assert p.parameters + p.gradients + p.optimizer_state == pytest.approx(static_bytes(p.parameters, t))
        assert p.total == pytest.approx(max(s.memory_bytes for s in stages), abs=1)
        # the peak is the walk's activations or, where larger, the optimizer step's temporaries
        # (these tiny plans' foreach Adam step: a float32 copy of the rank's parameters)
        assert (p.activations > 0) != (p.optimizer_step > 0)
        parts_ = stages[0].memory_parts
        assert parts_ is not None and p.optimizer_step == pytest.approx(parts_.optimizer_step, abs=2)
        assert p.limit == min(s.memory_limit_bytes for s in stages)


def test_memory_chart_flags_a_plan_that_does_not_fit(tiny_profile: Profile) -> None:
    plan = make_plan(tiny_profile, "gpipe", memory="20MB")
    over = [p.rank for p in memory_breakdown(plan) if p.total > p.limit]
    assert over, "the test plan should not fit 20 MB devices"
    title = memory_figure(plan).axes[0].get_title()
    assert "DOES NOT FIT" in title and str(over[0]) in title
    assert "fits" in memory_figure(make_plan(tiny_profile, "gpipe")).axes[0].get_title()


def test_save_chart_by_kind_and_suffix(any_plan: Plan, tmp_path: Path) -> None:
    svg = save_chart("memory", tmp_path / "m.svg", plan=any_plan)
    assert svg.read_text().lstrip().startswith("<?xml")
    png = save_chart("gantt", str(tmp_path / "g.png"), plan=any_plan)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_chart_errors_say_what_to_do(any_plan: Plan, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"g\.pdf.*must end in \.svg or \.png"):
        save_chart("gantt", tmp_path / "g.pdf", plan=any_plan)
    with pytest.raises(InputError, match="needs the plan"):
        save_chart("gantt", tmp_path / "g.svg")
    with pytest.raises(InputError, match="unknown chart 'pie'.*gantt, memory"):
        chart_figure("pie", any_plan)
    with pytest.raises(InputError, match="does not exist"):
        save_chart("gantt", tmp_path / "missing" / "g.svg", plan=any_plan)


def test_gantt_spans_the_predicted_step_with_the_allreduce(tiny_profile: Profile) -> None:
    """With D=2 replicas the chart ends where the cost model's step ends: pipeline + all-reduce."""
    from planner.charts import allreduce_per_rank

    plan = make_plan(tiny_profile, "1f1b")  # D=2
    assert plan.data_parallel_degree == 2
    sim = simulate_plan(plan)
    ar = allreduce_per_rank(plan)
    assert max(ar) == pytest.approx(plan.predicted.allreduce_ms) and max(ar) > 0
    finish = [max(e.end_ms for e in t) for t in sim.timelines]
    assert max(f + a for f, a in zip(finish, ar, strict=True)) == pytest.approx(plan.predicted.step_time_ms)
    ax = gantt_figure(plan).axes[0]
    assert ax.get_xlim()[1] == pytest.approx(plan.predicted.step_time_ms)
    assert f"step {plan.predicted.step_time_ms:.4g} ms" in ax.get_title()


def test_large_plan_is_rasterized_and_labels_thinned() -> None:
    """40 ranks x 40 micro-batches = 3200 boxes: rows become an image in the SVG, <= 48 row labels."""
    from planner.cost import Layout, estimate
    from planner.schema import Cluster, TrainingSetup
    from profiler.synth import synth_transformer

    prof = synth_transformer(layers=38, hidden=256, heads=4, seq=128, vocab=1000, microbatch_sizes=(1,))
    k = 40
    plan = estimate(
        prof, Cluster.model_validate({"devices": k, "device_type": "h100-80g"}), TrainingSetup(global_batch_size=40),
        Layout(
            [(i, i + 1) for i in range(k)],
            num_microbatches=40,
            schedule="1f1b",
        ),
    )
    fig = gantt_figure(plan)
    assert len(fig.axes[0].get_yticks()) <= 48
    svg = figure_svg(fig)
    assert "<image" in svg  # the rasterized rows
    assert _svg_size(svg) == pytest.approx((12 * 72, 16 * 72))  # the height is capped at 16 in
    mem = memory_figure(plan)
    assert 0 < len(mem.axes[0].get_xticks()) <= 33  # thinned to about 32



@pytest.mark.parametrize(("memory", "unit", "scale"), [("1GiB", "MiB", 2**20), ("80GiB", "GiB", 2**30)])
def test_memory_bars_stack_to_the_breakdown(tiny_profile: Profile, memory: str, unit: str, scale: int) -> None:
    plan = make_plan(tiny_profile, "interleaved-1f1b", memory=memory)
    ax = memory_figure(plan).axes[0]
    assert ax.get_ylabel() == unit
    parts = memory_breakdown(plan)
    # parameters, gradients, optimizer state, activations, and the optimizer step where it is a peak
    assert len(ax.containers) == 4 + any(p.optimizer_step for p in memory_breakdown(plan))
    for i, p in enumerate(parts):
        height = sum(c.patches[i].get_height() for c in ax.containers)  # type: ignore[attr-defined]
        assert height == pytest.approx(p.total / scale)
    limit_line = next(c for c in ax.collections if c.get_label() == "usable memory (limit)")
    tops = sorted({round(seg[0][1], 6) for seg in limit_line.get_segments()})  # type: ignore[attr-defined]
    assert tops == sorted({round(p.limit / scale, 6) for p in parts})
