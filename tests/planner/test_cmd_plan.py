"""The ``plan`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeplan.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_plan_table_and_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan.json"
    rc = main(["plan", str(ROOT / "examples/profiles/tiny.json"), "--devices", "4", "--memory", "1GiB",
               "--batch-size", "8", "--time-limit", "2", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for needle in ("memory / limit", "recompute", "predicted step", "vs baseline uniform", "vs baseline gpipe-4k",
                   "solver: ", "gap"):
        assert needle in text, needle
    plan = json.loads(out.read_text())
    assert plan["num_layers"] == 8 and plan["solver"]["status"] in ("optimal", "feasible")
    rc = main(["plan", str(ROOT / "examples/profiles/tiny.json"), "--devices", "4", "--memory", "1GiB",
               "--batch-size", "8", "--json", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["schedule"], plan["pipeline_degree"], plan["num_microbatches"]) == ("gpipe", 2, 2)


def test_bad_options_exit_1(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["plan", str(ROOT / "examples/profiles/tiny.json"), "--devices", "2", "--memory", "1GiB",
               "--stages", "5"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.startswith("error: stages=5 needs 5 devices") and "--stages 2" in err


def test_default_profile_and_no_heavy_imports() -> None:
    code = (
        "import sys, pipeplan.cmd_plan; "
        "assert not {'torch','ortools','fastapi','matplotlib'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    out = subprocess.run([sys.executable, "-m", "pipeplan", "plan", "--devices", "8", "--batch-size", "64",
                          "--time-limit", "2", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["model"] == "gpt-48l-10b"


def test_a_recompute_list_of_the_wrong_length_is_refused_with_the_count_it_needs(capsys) -> None:  # type: ignore[no-untyped-def]
    """Interleaved stages take one flag per chunk (K x v).  With T > 1 the mesh search used to
    swallow the mismatch and end in 'no memory size makes this model fit'."""
    for extra in ([], ["--tensor-parallel", "2", "--data-parallel", "1"]):
        rc = main(["plan", str(ROOT / "examples/profiles/tiny.json"), "--devices", "4", "--memory", "1GiB",
                   "--batch-size", "8", "--stages", "4", "--virtual-stages", "2", "--schedule", "interleaved-1f1b",
                   "--recompute", "1,1", *extra])  # fmt: skip
        assert rc == 1
        err = capsys.readouterr().err
        assert "recompute lists 2 flags but stages=2 x virtual_stages=2 make 4: give one per stage" in err, err
        assert "no memory size" not in err
