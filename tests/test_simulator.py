"""The schedule simulator: closed forms on uniform stages, and dependency properties on random ones."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.schedules import first_backward_counts, placement_of, stage_rank
from planner.schema import SCHEDULE_CHUNKS, SCHEDULES
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
    early = [[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ScheduleError, match="0B0 runs before the forward 0F0"):
        simulate(early, [1, 1], [1, 1])
    a = Action.parse
    deadlock = [[a("0F0"), a("0B0"), a("0F1"), a("0B1")], [a("1F1"), a("1B1"), a("1F0"), a("1B0")]]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(deadlock, [1, 1], [1, 1])
    with pytest.raises(ScheduleError, match="W0 runs before its input gradient"):
        simulate([[a("0F0"), a("0W0"), a("0I0")]], [1], [1])
    with pytest.raises(ScheduleError, match="is run by two ranks"):
        simulate([[a("0F0"), a("0B0")], [a("0F1"), a("0B1")]], [1], [1])
    with pytest.raises(ScheduleError, match="M >= 2K"):
        build_orders("dualpipev", 3, 5, 2)
    with pytest.raises(ScheduleError, match="exactly 2 chunks"):
        build_orders("zbv", 3, 5, 3)
    with pytest.raises(ScheduleError, match="rounds of equal size"):
        build_orders("interleaved-zb", 4, 9, 2)


TEMPLATES = [s for s in SCHEDULES if s != "planned"]


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    schedule = draw(st.sampled_from(TEMPLATES))
    chunks = SCHEDULE_CHUNKS[schedule]
    k = draw(st.integers(2 if chunks != "1" else 1, 5))
    v = {"1": 1, "2": 2}.get(chunks) or draw(st.integers(1, 3))
    m = draw(st.integers(1, 6)) * (k if chunks == "n" else 1)
    if schedule in ("1f1b", "zb-h1"):
        m = max(m, k)  # Schedule1F1B's rule
    if schedule == "dualpipev":
        m = max(m, 2 * k)
    s = k * v
    times = st.floats(0.01, 10.0, allow_nan=False)
    fwd = draw(st.lists(times, min_size=s, max_size=s))
    bwd = draw(st.lists(times, min_size=s, max_size=s))
    share = draw(st.lists(st.floats(0.0, 1.0), min_size=s, max_size=s))
    rec = draw(st.lists(st.sampled_from([0.0, 0.5]), min_size=s, max_size=s))
    xfer = draw(st.lists(st.floats(0.0, 2.0), min_size=s - 1, max_size=s - 1))
    inp = [b * x for b, x in zip(bwd, share, strict=True)]
    wgt = [b - i for b, i in zip(bwd, inp, strict=True)]
    return schedule, k, m, v, fwd, bwd, rec, xfer, inp, wgt


@settings(max_examples=200, deadline=None)
@given(cases())
def test_dependencies_hold(case) -> None:  # type: ignore[no-untyped-def]
    """Every schedule: no rank runs two actions at once, every stage runs on its placement's
    rank, forwards follow the previous stage's forward plus the transfer, a backward or input
    gradient follows its forward and the next stage's gradient plus the transfer, a weight
    gradient follows its input gradient, and every action lasts what it should."""
    schedule, k, m, v, fwd, bwd, rec, xfer, inp, wgt = case
    sim = simulate_schedule(
        schedule, k, m, fwd, bwd, virtual_stages=v, recompute_ms=rec, transfer_ms=xfer, input_ms=inp, weight_ms=wgt
    )
    s_count = k * v
    placement = placement_of(schedule)
    f_end: dict[tuple[int, int], float] = {}
    f_start: dict[tuple[int, int], float] = {}
    g_start: dict[tuple[int, int], float] = {}  # B or I (from its recompute on)
    g_end: dict[tuple[int, int], float] = {}
    w_start: dict[tuple[int, int], float] = {}
    eps = 1e-9
    ends = []
    for rank, events in enumerate(sim.timelines):
        # no device runs two ops at once
        for a, b in itertools.pairwise(events):
            assert b.start_ms >= a.end_ms - eps
        for e in events:
            assert e.rank == rank and stage_rank(placement, e.stage, k, v) == rank
            assert e.end_ms >= e.start_ms
            key = (e.stage, e.microbatch)
            if e.kind == "forward":
                f_start[key] = e.start_ms
                f_end[key] = e.end_ms
                assert e.end_ms - e.start_ms == pytest.approx(fwd[e.stage])
            elif e.kind == "recompute":
                g_start[key] = e.start_ms
            elif e.kind == "backward_weight":
                w_start[key] = e.start_ms
                assert e.end_ms - e.start_ms == pytest.approx(wgt[e.stage])
            else:
                g_start.setdefault(key, e.start_ms)
                g_end[key] = e.end_ms
                assert e.end_ms - e.start_ms == pytest.approx(bwd[e.stage] if e.kind == "backward" else inp[e.stage])
            ends.append(e.end_ms)
        # makespan >= every device's busy time
        assert sim.makespan_ms >= sim.busy_ms(rank) - eps
    assert len(f_end) == len(g_end) == s_count * m
    for (s, mb), start in f_start.items():
        if s > 0:  # every forward follows its predecessor stage's forward plus transfer
            assert start >= f_end[(s - 1, mb)] + xfer[s - 1] - eps
    for (s, mb), start in g_start.items():
        assert start >= f_end[(s, mb)] - eps
        if s < s_count - 1:  # every backward follows the next stage's gradient plus transfer
            assert start >= g_end[(s + 1, mb)] + xfer[s] - eps
    for key, start in w_start.items():
        assert start >= g_end[key] - eps
    assert sim.makespan_ms == pytest.approx(max(ends))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_first_backward_counts_are_a_moment_of_every_walk(case) -> None:  # type: ignore[no-untyped-def]
    """The closed forms the bounds use: when a rank starts its first backward it holds at least
    that many micro-batches of each chunk (GPipe and 1F1B: exactly, and that is their peak)."""
    schedule, k, m, v, fwd, bwd, rec, xfer, inp, wgt = case
    sim = simulate_schedule(
        schedule, k, m, fwd, bwd, virtual_stages=v, recompute_ms=rec, transfer_ms=xfer, input_ms=inp, weight_ms=wgt
    )
    counts = first_backward_counts(schedule, k, m, v)  # type: ignore[arg-type]
    placement = placement_of(schedule)
    for rank, events in enumerate(sim.timelines):
        own = sorted({e.stage for e in events})
        held = dict.fromkeys(own, 0)
        for e in events:
            if e.kind == "forward":
                held[e.stage] += 1
            elif e.kind in ("backward", "backward_input"):
                assert all(held[s] >= c for s, c in zip(own, counts[rank], strict=True)), (rank, held, counts[rank])
                break
        assert [stage_rank(placement, s, k, v) for s in own] == [rank] * v
        if schedule in ("gpipe", "1f1b"):
            assert sim.peak_inflight[rank] == counts[rank][0]
