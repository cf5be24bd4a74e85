"""The diagnosis of a failed job names the rank that caused it."""

from __future__ import annotations

import signal

from runtime.faults import RankStatus, diagnose, is_communication_error, read_statuses, write_status


def test_raising_rank_is_the_cause() -> None:
    statuses = {
        0: RankStatus(rank=0, state="failed", step=1, error_type="RuntimeError", error="Connection closed by peer", communication=True),
        1: RankStatus(rank=1, state="failed", step=1, error_type="ValueError", error="bad value 3"),
    }
    msg, ranks = diagnose(statuses, {0: 1, 1: 1}, world_size=2, timeout_s=30, stage_of={1: "stage 1"})
    assert ranks == [1]
    assert msg.startswith("rank 1 (stage 1) raised ValueError: bad value 3 (during step 1)")
    assert "then rank 0 gave up" in msg


def test_silent_death_is_named_with_its_signal() -> None:
    statuses = {
        0: RankStatus(rank=0, state="failed", step=2, error_type="RuntimeError", error="Read error: Connection reset by peer", communication=True),
        1: RankStatus(rank=1, state="running", step=2),
    }
    msg, ranks = diagnose(statuses, {0: 1, 1: -int(signal.SIGKILL)}, world_size=2, timeout_s=30)
    assert ranks == [1]
    assert "rank 1 died (killed by SIGKILL) during step 2" in msg


def test_hang_is_named_from_the_peers_timeout() -> None:
    statuses = {
        0: RankStatus(rank=0, state="failed", step=1, error_type="RuntimeError", error="Timed out waiting 5000ms", communication=True),
        1: RankStatus(rank=1, state="running", step=1),
    }
    msg, ranks = diagnose(statuses, {0: 1, 1: -int(signal.SIGTERM)}, world_size=2, timeout_s=5)
    assert ranks == [1]
    assert "rank 1 stopped responding during step 1" in msg and "5 s" in msg


def test_same_error_everywhere_is_reported_once() -> None:
    statuses = {r: RankStatus(rank=r, state="failed", phase="building the model", error_type="PlanMismatchError", error="layer 3 differs") for r in range(2)}
    msg, ranks = diagnose(statuses, {0: 1, 1: 1}, world_size=2, timeout_s=5)
    assert sorted(ranks) == [0, 1]
    assert msg.count("layer 3 differs") == 1 and msg.startswith("every rank raised")


def test_status_files_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    write_status(str(tmp_path), RankStatus(rank=1, pid=42, state="running", step=3, stages=[1, 3]))
    got = read_statuses(str(tmp_path), 2)
    assert list(got) == [1] and got[1].step == 3 and got[1].stages == [1, 3] and got[1].time > 0


def test_communication_errors() -> None:
    assert is_communication_error("RuntimeError", "[gloo] Timed out waiting 5000ms for recv")
    assert not is_communication_error("ZeroDivisionError", "division by zero")
