"""The schedule simulator: closed forms on uniform stages, and dependency properties on random ones."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costmodel import inflight_microbatches
from planner.simulator import (
    Action,
    ScheduleError,
    build_orders,
    format_orders,
    simulate,
    simulate_schedule,
)


@pytest.mark.parametrize(
    ("schedule", "k", "m"),
    [(s, k, m) for s in ("gpipe", "1f1b") for k, m in [(1, 1), (2, 4), (4, 8), (4, 4), (8, 32), (3, 7)]]
    + [("gpipe", 5, 2)],
)
def test_uniform_closed_form(schedule: str, k: int, m: int) -> None:
    f, b = 1.5, 3.0
    sim = simulate_schedule(schedule, k, m, [f] * k, [b] * k)  # type: ignore[arg-type]
    assert sim.makespan_ms == pytest.approx((m + k - 1) * (f + b))
    assert sim.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize(("k", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 32, 2), (3, 6, 3)])
def test_interleaved_bubble(k: int, m: int, v: int) -> None:
    """Narayanan et al. 2021: the bubble is (K-1)/(vM) of the ideal time."""
    f, b = 1.0, 2.0
    sim = simulate_schedule("interleaved-1f1b", k, m, [f / v] * (k * v), [b / v] * (k * v), virtual_stages=v)
    ideal = m * (f + b)
    assert (sim.makespan_ms - ideal) / ideal == pytest.approx((k - 1) / (v * m))


def test_text_form() -> None:
    text = format_orders(build_orders("1f1b", 3, 4))
    assert text.splitlines()[0] == "rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"
    assert text.splitlines()[2] == "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3"


def test_bad_shapes() -> None:
    with pytest.raises(ScheduleError, match="multiple of the pipeline degree"):
        build_orders("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(ScheduleError, match="M=2 < K=3; use M >= 3 or schedule 'gpipe'"):
        build_orders("1f1b", 3, 2)
    with pytest.raises(ScheduleError, match="need schedule 'interleaved-1f1b'"):
        build_orders("1f1b", 2, 4, 2)
    deadlock = [[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(deadlock, [1, 1], [1, 1])


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    k = draw(st.integers(1, 5))
    v = draw(st.integers(1, 3)) if schedule == "interleaved-1f1b" else 1
    m = draw(st.integers(1, 6)) * (k if schedule == "interleaved-1f1b" else 1)
    if schedule == "1f1b":
        m = max(m, k)  # Schedule1F1B's rule
    s = k * v
    times = st.floats(0.01, 10.0, allow_nan=False)
    fwd = draw(st.lists(times, min_size=s, max_size=s))
    bwd = draw(st.lists(times, min_size=s, max_size=s))
    rec = draw(st.lists(st.sampled_from([0.0, 0.5]), min_size=s, max_size=s))
    xfer = draw(st.lists(st.floats(0.0, 2.0), min_size=s - 1, max_size=s - 1))
    return schedule, k, m, v, fwd, bwd, rec, xfer


@settings(max_examples=150, deadline=None)
@given(cases())
def test_dependencies_hold(case) -> None:  # type: ignore[no-untyped-def]
    schedule, k, m, v, fwd, bwd, rec, xfer = case
    sim = simulate_schedule(schedule, k, m, fwd, bwd, virtual_stages=v, recompute_ms=rec, transfer_ms=xfer)
    s_count = k * v
    f_end: dict[tuple[int, int], float] = {}
    b_start: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    f_start: dict[tuple[int, int], float] = {}
    eps = 1e-9
    for rank, events in enumerate(sim.timelines):
        # no device runs two ops at once
        for a, b in itertools.pairwise(events):
            assert b.start_ms >= a.end_ms - eps
        for e in events:
            assert e.rank == rank and e.stage % k == rank
            assert e.end_ms >= e.start_ms
            if e.kind == "forward":
                f_start[(e.stage, e.microbatch)] = e.start_ms
                f_end[(e.stage, e.microbatch)] = e.end_ms
            elif e.kind == "recompute":
                b_start[(e.stage, e.microbatch)] = e.start_ms
            else:
                b_start.setdefault((e.stage, e.microbatch), e.start_ms)
                b_end[(e.stage, e.microbatch)] = e.end_ms
        # makespan >= every device's busy time
        assert sim.makespan_ms >= sim.busy_ms(rank) - eps
    assert len(f_end) == len(b_end) == s_count * m
    for (s, mb), start in f_start.items():
        if s > 0:  # every forward follows its predecessor stage's forward plus transfer
            assert start >= f_end[(s - 1, mb)] + xfer[s - 1] - eps
    for (s, mb), start in b_start.items():
        assert start >= f_end[(s, mb)] - eps
        if s < s_count - 1:  # every backward follows the next stage's backward plus transfer
            assert start >= b_end[(s + 1, mb)] + xfer[s] - eps
    assert sim.makespan_ms == pytest.approx(max(b_end.values()))


@settings(max_examples=100, deadline=None)
@given(cases())
def test_inflight_closed_forms(case) -> None:  # type: ignore[no-untyped-def]
    """The cost model's in-flight counts: exact for GPipe and 1F1B, an upper bound for interleaved."""
    schedule, k, m, v, fwd, bwd, rec, xfer = case
    sim = simulate_schedule(schedule, k, m, fwd, bwd, virtual_stages=v, recompute_ms=rec, transfer_ms=xfer)
    for rank in range(k):
        closed = inflight_microbatches(schedule, k, m, rank, v)
        if schedule == "interleaved-1f1b":
            own = [sim.peak_inflight[s] for s in range(rank, k * v, k)]
            assert max(own) <= closed
        else:
            assert sim.peak_inflight[rank] == closed
