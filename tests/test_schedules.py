"""The schedules module: placements, the templates' shapes, the list scheduler, the action
text forms and the memory walk (checked against an event-by-event account of the timeline)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.schedules import (
    Action,
    ScheduleError,
    check_schedule_shape,
    first_backward_counts,
    format_actions,
    list_schedule,
    memory_points,
    parse_actions,
    peak_bytes,
    placement_of,
    rank_stages,
    schedule_actions,
    stage_rank,
    to_csv,
    validate_actions,
)
from planner.schema import SCHEDULE_CHUNKS, SCHEDULES
from planner.simulator import compile_actions, makespans, simulate

TEMPLATES = [s for s in SCHEDULES if s != "planned"]


def test_placements() -> None:
    assert [stage_rank("loop", s, 3, 2) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [stage_rank("v", s, 3, 2) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [stage_rank("contiguous", s, 3, 2) for s in range(6)] == [0, 0, 1, 1, 2, 2]
    assert rank_stages("v", 4, 2) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert placement_of("zbv") == placement_of("dualpipev") == "v"
    assert placement_of("interleaved-zb") == "loop"


@pytest.mark.parametrize("schedule", TEMPLATES)
def test_every_template_is_valid_and_runs(schedule: str) -> None:
    """Each stage on its placement's rank, every micro-batch forward once and backward once
    (B, or I then W), and the ranks can run the lists together (no deadlock)."""
    ran = 0
    for k, m, v in itertools.product(range(1, 6), range(1, 12), range(1, 5)):
        try:
            check_schedule_shape(schedule, k, m, v)  # type: ignore[arg-type]
        except ScheduleError:
            continue
        orders = schedule_actions(schedule, k, m, v)  # type: ignore[arg-type]
        mapping = validate_actions(orders, num_stages=k * v, num_microbatches=m)
        assert mapping == [stage_rank(placement_of(schedule), s, k, v) for s in range(k * v)]  # type: ignore[arg-type]
        compile_actions(orders, k * v, m)  # raises on a deadlock
        kinds = {a.kind for o in orders for a in o}
        assert kinds <= {"F", "B", "I", "W"}
        if schedule in ("zb-h1", "zb-h2", "zbv", "interleaved-zb"):
            assert "B" not in kinds and {"I", "W"} <= kinds
        ran += 1
    assert ran > 10


def test_shape_errors_name_the_constraint() -> None:
    with pytest.raises(ScheduleError, match=r"M >= 2K .* M=5 < 2K=6"):
        check_schedule_shape("dualpipev", 3, 5, 2)
    with pytest.raises(ScheduleError, match="exactly 2 chunks"):
        check_schedule_shape("zbv", 4, 8, 3)
    with pytest.raises(ScheduleError, match="K >= 2"):
        check_schedule_shape("zbv", 1, 8, 2)
    with pytest.raises(ScheduleError, match=r"rounds of equal size .* M=9 is not a multiple of 2"):
        check_schedule_shape("interleaved-zb", 4, 9, 2)
    with pytest.raises(ScheduleError, match="M=3 < K=4"):
        check_schedule_shape("zb-h1", 4, 3, 1)
    with pytest.raises(ScheduleError, match="one stage per rank"):
        check_schedule_shape("zb-h2", 4, 8, 2)
    with pytest.raises(ScheduleError, match="built for each split"):
        schedule_actions("planned", 2, 4)


def test_zero_bubble_templates_at_unit_times() -> None:
    """F = I = W = 1, free transfers: 1F1B takes (M + K - 1)·3; ZB-H1 cuts the bubble to
    K - 1 (the last rank cannot start before K - 1 forwards have passed, so 3M + K - 1 is the
    least any schedule takes); ZB-H2 reaches it too."""
    for k, m in [(2, 4), (4, 8), (4, 12), (6, 12)]:
        one = [1.0] * k
        two = [2.0] * k

        def span(schedule: str, k: int = k, m: int = m, one: list[float] = one, two: list[float] = two) -> float:
            orders = schedule_actions(schedule, k, m)  # type: ignore[arg-type]
            return simulate(orders, one, two, input_ms=one, weight_ms=one).makespan_ms

        assert span("1f1b") == pytest.approx(3 * (m + k - 1))
        assert span("zb-h1") == pytest.approx(3 * m + k - 1)
        assert span("zb-h2") == pytest.approx(3 * m + k - 1)


def test_zb_h2_keeps_at_most_2k_minus_1_in_flight() -> None:
    for k, m in [(3, 9), (4, 16)]:
        orders = schedule_actions("zb-h2", k, m)
        pts = memory_points(orders, rank_stages("loop", k, 1))
        for r in range(k):
            assert peak_bytes(pts[r], [1.0], [1.0], [0.0]) <= 2 * k - 1
        assert first_backward_counts("zb-h2", k, m)[0] == (2 * k - 1,)


def test_text_forms() -> None:
    orders = schedule_actions("zbv", 2, 4, 2)
    assert parse_actions(format_actions(orders)) == orders
    csv = to_csv(orders)
    rows = csv.splitlines()
    assert len(rows) == 2
    assert rows[0].split(",")[:3] == ["0F0", "0F1", "0F2"]
    assert all(Action.parse(cell) in orders[r] for r, row in enumerate(rows) for cell in row.split(","))
    assert str(Action.parse("12W345")) == "12W345"
    with pytest.raises(ScheduleError, match="not of the form"):
        Action.parse("0X1")


def _walk_from_events(orders, m, hf, hw, live, k, v, placement):  # type: ignore[no-untyped-def]
    """Memory of each rank, event by event, straight from the action semantics."""
    peaks = []
    for r, acts in enumerate(orders):
        cur = 0.0
        peak = 0.0
        for a in acts:
            j = [s for s in range(k * v) if stage_rank(placement, s, k, v) == r].index(a.stage)
            if a.kind == "F":
                cur += hf[r][j]
                peak = max(peak, cur)
            elif a.kind == "W":
                cur -= hw[r][j]
            else:
                peak = max(peak, cur + live[r][j])
                cur -= hf[r][j]
                if a.kind == "I":
                    cur += hw[r][j]
                    peak = max(peak, cur)
        peaks.append(peak)
    return peaks


@settings(max_examples=120, deadline=None)
@given(
    schedule=st.sampled_from(TEMPLATES),
    k=st.integers(1, 4),
    m=st.integers(1, 9),
    v=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_memory_points_give_the_walks_peak(schedule: str, k: int, m: int, v: int, seed: int) -> None:
    import random

    chunks = SCHEDULE_CHUNKS[schedule]  # type: ignore[index]
    v = {"1": 1, "2": 2}.get(chunks, v)
    try:
        check_schedule_shape(schedule, k, m, v)  # type: ignore[arg-type]
    except ScheduleError:
        return
    rng = random.Random(seed)
    orders = schedule_actions(schedule, k, m, v)  # type: ignore[arg-type]
    placement = placement_of(schedule)  # type: ignore[arg-type]
    hf = [[rng.uniform(0, 5) for _ in range(v)] for _ in range(k)]
    hw = [[rng.uniform(0, 5) for _ in range(v)] for _ in range(k)]
    live = [[rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(v)] for _ in range(k)]
    pts = memory_points(orders, rank_stages(placement, k, v))
    expect = _walk_from_events(orders, m, hf, hw, live, k, v, placement)
    for r in range(k):
        assert peak_bytes(pts[r], hf[r], hw[r], live[r]) == pytest.approx(expect[r])


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(1, 5),
    m=st.integers(1, 10),
    seed=st.integers(0, 10_000),
    tight=st.booleans(),
)
def test_list_schedule_replays_exactly_and_keeps_its_memory(k: int, m: int, seed: int, tight: bool) -> None:
    """The planned schedule's own makespan is the simulator's for its lists, its walk stays
    within each rank's capacity when one micro-batch fits, and the lists are valid."""
    import random

    rng = random.Random(seed)
    f = [rng.uniform(0.2, 3) for _ in range(k)]
    i = [rng.uniform(0.2, 3) for _ in range(k)]
    w = [rng.uniform(0.0, 3) for _ in range(k)]
    x = [rng.choice([0.0, rng.uniform(0, 2)]) for _ in range(k - 1)]
    hf = [rng.uniform(1, 4) for _ in range(k)]
    hw = [rng.uniform(0, 4) for _ in range(k)]
    live = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(k)]
    one = [max(a + lv, b) for a, b, lv in zip(hf, hw, live, strict=True)]  # one micro-batch's need
    cap = [o * (rng.uniform(1.0, 2.5) if tight else 100.0) for o in one]
    orders, span = list_schedule(
        m, forward_ms=f, input_ms=i, weight_ms=w, transfer_ms=x, held_forward=hf, held_weight=hw, live=live, capacity=cap
    )
    validate_actions(orders, num_stages=k, num_microbatches=m)
    finish = makespans(compile_actions(orders, k, m), f, [a + b for a, b in zip(i, w, strict=True)], x, binput=i, bweight=w)
    assert max(finish) == pytest.approx(span, rel=1e-12)
    pts = memory_points(orders, [[s] for s in range(k)])
    for r in range(k):
        assert peak_bytes(pts[r], [hf[r]], [hw[r]], [live[r]]) <= cap[r] * (1 + 1e-12)
    # never slower than running the micro-batches one by one
    assert span <= m * (sum(f) + sum(i) + sum(w) + 2 * sum(x)) + 1e-9


def test_list_schedule_runs_a_lone_microbatch_after_float_rounding() -> None:
    """A rank whose one micro-batch does not fit its capacity still runs one at a time.  Its
    held bytes return to 4e-16, not 0, after 8.81 + (2.93 - 8.81) - 2.93 (float rounding):
    the schedule deadlocked when it tested ``held == 0`` (found by the chain table's property
    test through ``brute_force`` under the planned schedule)."""
    hf, hw = 8.808424979435028, 2.9269305226455837
    assert hf + (hw - hf) - hw > 0  # the rounding this test is about
    orders, span = list_schedule(
        3, forward_ms=[1.0], input_ms=[1.0], weight_ms=[1.0], transfer_ms=[], held_forward=[hf],
        held_weight=[hw], live=[0.0], capacity=[5.0],
    )
    assert [a.kind for a in orders[0]] == ["F", "I", "W"] * 3
    assert span == pytest.approx(9.0)
