"""`pipeplan estimate` and `pipeplan schema`: output, JSON, and clear errors instead of tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.cli import main
from planner.schema import parse_document

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "examples" / "profiles" / "tiny.json")
ESTIMATE = ["estimate", TINY, "--devices", "4", "--memory", "1GiB", "--stages", "0:2,2:4,4:6,6:8", "--microbatches", "8"]


def test_estimate_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ESTIMATE, "--recompute", "0,1,0,0"]) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "bubble" in out
    assert "solver: given" in out
    assert "blocks.5 .. head" in out


def test_estimate_json_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.json"
    assert main([*ESTIMATE, "--json", "-o", str(target), "--schedule", "gpipe"]) == 0
    printed = json.loads(capsys.readouterr().out)
    plan = parse_document("plan", json.loads(target.read_text()))
    assert printed["predicted"] == json.loads(plan.model_dump_json())["predicted"]
    assert plan.solver.status == "given" and plan.schedule == "gpipe"
    assert [s.stop for s in plan.stages] == [2, 4, 6, 8]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--stages", "0:2,2:9"], "model has 8 layers"),
        (["--stages", "0:2,x"], "cannot read stage 'x'"),
        (["--recompute", "0,maybe"], "cannot read 'maybe'"),
        (["--microbatches", "5"], "does not split"),
        (["--optimizer", "lion"], "unknown optimizer 'lion'"),
    ],
)
def test_estimate_errors(extra: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = list(ESTIMATE)
    for i in range(0, len(extra), 2):
        flag = extra[i]
        if flag in args:
            args[args.index(flag) + 1] = extra[i + 1]
        else:
            args += extra[i : i + 2]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert fragment in err
    assert "Traceback" not in err


def test_missing_memory_is_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = json.loads(Path(TINY).read_text())
    profile["measured_on"]["device"] = "cuda"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    assert main(["estimate", str(path), "--devices", "2", "--stages", "0:4,4:8", "--microbatches", "2"]) == 1
    assert "--memory 80GiB or --device-type h100-80g" in capsys.readouterr().err


def test_bad_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    profile = json.loads(Path(TINY).read_text())
    profile["layers"][3]["forward_ms"] = [1.0]
    path.write_text(json.dumps(profile))
    assert main(["estimate", str(path), "--devices", "2", "--stages", "0:4,4:8", "--microbatches", "2"]) == 1
    err = capsys.readouterr().err
    assert "layers[3].forward_ms has 1 entries but microbatch_sizes [1, 2, 4] has 3" in err


@pytest.mark.parametrize("kind", ["profile", "cluster", "plan"])
def test_schema_command(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", kind]) == 0
    assert json.loads(capsys.readouterr().out)["type"] == "object"


def test_module_entry_point_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipeplan", *ESTIMATE, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pipeline_degree"] == 4
