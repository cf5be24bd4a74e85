"""The text grid of a schedule: exact layouts derived by hand, and properties on random schedules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import simulate_plan
from planner.errors import InputError
from planner.grid import grid_rows, text_grid
from planner.schema import Plan
from planner.simulator import simulate_schedule

# GPipe, K=2 ranks, M=3 micro-batches, forward 1 ms, backward 2 ms, free transfers.
# Rank 0 runs F0..F2 in [0,3); rank 1 runs each forward 1 ms later, F2 ending at 4.
# Rank 1's backwards start at 4 (B0 4-6, B1 6-8, B2 8-10); rank 0's B(m) waits for rank 1's:
# B0 6-8, B1 8-10, B2 10-12.  Makespan 12; busy 9 of 12 ms per rank: bubble 25%.
GPIPE_2X3 = """\
makespan 12 ms, bubble 25.0%, one column = 1 ms
rank 0 | F0 F1 F2 .  .  .  B0 B0 B1 B1 B2 B2
rank 1 | .  F0 F1 F2 B0 B0 B1 B1 B2 B2 .  .
F forward, B backward, R recompute, . idle; number = micro-batch"""

# 1F1B, same sizes: rank 0 warms up with K-1 = 1 extra forward (F0 F1 B0 F2 B1 B2); rank 1
# alternates (F0 B0 F1 B1 F2 B2).  F1 on rank 1 waits for its B0 to free it (4-5), rank 0's
# F2 runs after its B0 (6-7), its B2 waits for rank 1's B2 (ends 10): 10-12.
ONE_F_ONE_B_2X3 = """\
rank 0 | F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2
rank 1 | .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  ."""


def test_gpipe_tiny_layout_exact() -> None:
    sim = simulate_schedule("gpipe", 2, 3, [1.0, 1.0], [2.0, 2.0])
    assert text_grid(sim, slot_ms=1.0) == GPIPE_2X3


def test_gpipe_tiny_layout_default_slot_is_shortest_event() -> None:
    sim = simulate_schedule("gpipe", 2, 3, [1.0, 1.0], [2.0, 2.0])
    assert text_grid(sim) == GPIPE_2X3


def test_1f1b_tiny_layout_exact() -> None:
    sim = simulate_schedule("1f1b", 2, 3, [1.0, 1.0], [2.0, 2.0])
    assert text_grid(sim, slot_ms=1.0, header=False, legend=False) == ONE_F_ONE_B_2X3


def test_recompute_cells_precede_backward() -> None:
    # one rank, one micro-batch: F 1 ms, R 1 ms, B 2 ms
    sim = simulate_schedule("gpipe", 1, 1, [1.0], [2.0], recompute_ms=[1.0])
    assert grid_rows(sim, slot_ms=1.0) == [["F0", "R0", "B0", "B0"]]


def test_interleaved_cells_name_the_chunk() -> None:
    sim = simulate_schedule("interleaved-1f1b", 2, 2, [1.0] * 4, [1.0] * 4, virtual_stages=2)
    rows = grid_rows(sim, slot_ms=1.0)
    cells = {c for r in rows for c in r if c != "."}
    # each rank runs F and B of micro-batches 0, 1 on chunks 0 and 1: 8 distinct cells
    assert all(len(row) == round(sim.makespan_ms) for row in rows)
    for row in rows:
        assert sorted(c for c in row if c != ".") == sorted(
            f"{k}{m}:{c}" for k in "FB" for m in range(2) for c in range(2)
        )
    assert len(cells) == 8
    assert "chunk" in text_grid(sim, slot_ms=1.0)


def test_plan_input_matches_simulation(any_plan: Plan) -> None:
    sim = simulate_plan(any_plan)
    text = text_grid(any_plan, slot_ms=0.5, max_columns=10_000)
    assert text.splitlines()[1:-1] == text_grid(sim, slot_ms=0.5, header=False, legend=False).splitlines()
    assert text.startswith(f"{any_plan.schedule} K={any_plan.pipeline_degree} M={any_plan.num_microbatches}")
    assert len(text.splitlines()) == any_plan.pipeline_degree + 2


def test_max_columns_caps_the_width(any_plan: Plan) -> None:
    for cap in (5, 17, 40):
        rows = grid_rows(simulate_plan(any_plan), slot_ms=simulate_plan(any_plan).makespan_ms / cap)
        assert all(len(r) == cap for r in rows)
        text = text_grid(any_plan, max_columns=cap, header=False, legend=False)
        assert all(len(line.split("|")[1].split()) <= cap for line in text.splitlines())


@pytest.mark.parametrize("slot", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_slot_is_a_clear_error(slot: float) -> None:
    sim = simulate_schedule("gpipe", 2, 2, [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(InputError, match="slot_ms must be a positive"):
        text_grid(sim, slot_ms=slot)


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    k=st.integers(1, 4),
    m=st.integers(1, 6),
    data=st.data(),
)
def test_integer_durations_fill_exact_cell_counts(schedule: str, k: int, m: int, data: st.DataObject) -> None:
    """With integer event times and 1 ms slots every event fills exactly its duration in cells."""
    if schedule == "1f1b":
        m = max(m, k)  # Schedule1F1B needs M >= K
    fwd = data.draw(st.lists(st.integers(1, 3), min_size=k, max_size=k))
    bwd = data.draw(st.lists(st.integers(1, 3), min_size=k, max_size=k))
    rec = data.draw(st.lists(st.sampled_from([0, 1, 2]), min_size=k, max_size=k))
    sim = simulate_schedule(
        schedule,  # type: ignore[arg-type]
        k,
        m,
        [float(x) for x in fwd],
        [float(x) for x in bwd],
        recompute_ms=[float(x) for x in rec],
    )
    rows = grid_rows(sim, slot_ms=1.0)
    assert len(rows) == k
    for r, row in enumerate(rows):
        assert len(row) == round(sim.makespan_ms)
        for mb in range(m):
            assert row.count(f"F{mb}") == fwd[r]
            assert row.count(f"B{mb}") == bwd[r]
            assert row.count(f"R{mb}") == rec[r]
            # the forward comes before the recompute, which comes before the backward
            last_f = max(i for i, c in enumerate(row) if c == f"F{mb}")
            first_b = min(i for i, c in enumerate(row) if c == f"B{mb}")
            assert last_f < first_b
        idle = row.count(".")
        assert idle == round(sim.makespan_ms - sim.busy_ms(r))
