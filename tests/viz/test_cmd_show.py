"""``pipeplan show``: text grid by default, chart files on request, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from pipeplan.cli import main
from planner.grid import text_grid
from planner.schema import Profile

from .conftest import make_plan


@pytest.fixture()
def plan_file(tiny_profile: Profile, tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(make_plan(tiny_profile, "1f1b").model_dump_json())
    return path


def test_show_prints_the_text_grid(plan_file: Path, tiny_profile: Profile, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n") == text_grid(make_plan(tiny_profile, "1f1b"))
    assert out.splitlines()[1].startswith("rank 0 | F0")


def test_show_slot_and_width(plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(plan_file), "--width", "12"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rank")]
    assert len(rows) == 2 and all(len(r.split("|")[1].split()) <= 12 for r in rows)
    assert main(["show", str(plan_file), "--slot-ms", "1000000"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rank")]
    assert all(len(r.split("|")[1].split()) == 1 for r in rows)


def test_show_writes_both_charts(plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gantt, memory = tmp_path / "g.svg", tmp_path / "m.png"
    assert main(["show", str(plan_file), "--gantt", str(gantt), "--memory", str(memory)]) == 0
    out = capsys.readouterr().out
    assert f"Gantt chart written to {gantt}" in out and f"memory chart written to {memory}" in out
    assert 'width="864pt"' in gantt.read_text()[:2000]
    with Image.open(memory) as im:
        assert im.size == (1000, 500)


def test_show_with_profile_reevaluates(
    plan_file: Path, tiny_profile_dict: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the same model measured twice as slow: same fingerprint, twice the step time
    slower = dict(tiny_profile_dict)
    slower["layers"] = [
        {**layer, "forward_ms": [2 * x for x in layer["forward_ms"]], "backward_ms": [2 * x for x in layer["backward_ms"]]}
        for layer in tiny_profile_dict["layers"]
    ]
    prof = tmp_path / "slow.json"
    prof.write_text(json.dumps(slower))
    plan = json.loads(plan_file.read_text())
    assert main(["show", str(plan_file), "--profile", str(prof)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    old = plan["predicted"]["step_time_ms"]
    assert f"{old:.2f} ms in the plan" in first
    new = float(first.split(", ")[-1].split(" ms")[0])
    # compute doubles; the all-reduce of D=2 replicas does not
    assert new > 1.5 * old


def test_show_refuses_a_profile_of_another_model(
    plan_file: Path, tiny_profile_dict: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = dict(tiny_profile_dict)
    other["layers"] = [{**tiny_profile_dict["layers"][0], "param_bytes": 1}, *tiny_profile_dict["layers"][1:]]
    prof = tmp_path / "other.json"
    prof.write_text(json.dumps(other))
    assert main(["show", str(plan_file), "--profile", str(prof)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "give a profile of the same model" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gantt", "g.pdf"], "'g.pdf': the file name must end in .svg or .png"),
        (["--slot-ms", "0"], "--slot-ms must be a positive number"),
        (["--width", "0"], "--width must be >= 1"),
    ],
)
def test_show_bad_options(plan_file: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(plan_file), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_show_bad_plan_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path / "nope.json")]) == 1
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 1, "model": "x"}))
    assert main(["show", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "invalid plan" in err and "stages" in err


def test_show_writes_the_actions_as_torch_csv(tiny_profile: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One row per rank, one action per cell: what the plan predicted (its own actions)."""
    plan = make_plan(tiny_profile, "zbv")
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    out_csv = tmp_path / "actions.csv"
    assert main(["show", str(path), "--actions", str(out_csv)]) == 0
    assert f"actions of 4 ranks (zbv) written to {out_csv}" in capsys.readouterr().out
    rows = out_csv.read_text().splitlines()
    assert plan.actions is not None
    assert [row.split(",") for row in rows] == [line.split() for line in plan.actions]
    assert rows[0].startswith("0F0,") and "7I0" in rows[0].split(",")  # rank 0 holds stages 0 and 7 (V)
    assert main(["show", str(path), "--actions", "-"]) == 0
    assert capsys.readouterr().out.splitlines() == rows
    assert main(["show", str(path), "--actions", str(tmp_path / "no" / "such.csv")]) == 1
    assert "cannot write the actions" in capsys.readouterr().err


def test_show_grid_draws_input_and_weight_gradients(tiny_profile: Profile) -> None:
    grid = text_grid(make_plan(tiny_profile, "zb-h1"))
    cells = {c for line in grid.splitlines() if line.startswith("rank") for c in line.split("|")[1].split()}
    assert any(c.startswith("I") for c in cells) and any(c.startswith("W") for c in cells)
    assert "I input gradient, W weight gradient" in grid.splitlines()[-1]
    assert "(V placement)" in text_grid(make_plan(tiny_profile, "zbv")).splitlines()[0]
