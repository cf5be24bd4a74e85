"""``pipeplan profile`` end to end, and the bundled measured profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import examples.gpt as gpt
from pipeplan.cli import main
from planner.schema import load_document
from profiler.loading import load_entrypoint
from profiler.split import split_model

ROOT = Path(__file__).resolve().parents[2]


def test_profile_command_writes_a_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "--model", "examples.resnet:tiny", "--microbatch-sizes", "1,2", "--warmup", "1"]
    rc = main([*argv, "--repeats", "2", "--threads", "1", "-q", "-o", str(out)])
    assert rc == 0
    p = load_document("profile", str(out))
    entry = load_entrypoint("examples.resnet:tiny")
    assert p.sha256() == split_model(entry.model, entry.example_inputs).sha256()
    assert p.model == "examples.resnet:tiny" and p.microbatch_sizes == [1, 2]
    assert p.metadata["profiler"]["loss"] == "custom"
    assert "written to" in capsys.readouterr().out


def test_profile_command_split_points(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "profile --model examples.gpt:tiny --microbatch-sizes 1 --warmup 0 --repeats 1 -q --split-points blocks.2"
    assert main(argv.split()) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layer["name"] for layer in data["layers"]] == ["embed", "blocks.2"]
    assert data["split_points"] == ["blocks.2"] and data["schema_version"] == 5


def test_profile_command_warns_about_blocks_it_cannot_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "square.py"
    model.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        n = x.shape[0] * x.shape[0]\n"
        "        return self.b(self.a(x)) * n\n"
        "def f():\n"
        "    return M(), torch.ones(2, 4)\n"
    )
    assert main(["profile", "--model", f"{model}:f", "--microbatch-sizes", "1", "--warmup", "0", "--repeats", "1", "-q"]) == 0
    captured = capsys.readouterr()
    (line,) = [x for x in captured.err.splitlines() if x.startswith("warning:")]
    assert "cannot cut between 'a' and 'b'" in line and "square.py:7: n = x.shape[0] * x.shape[0]" in line
    assert [layer["name"] for layer in json.loads(captured.out)["layers"]] == ["a"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ("--model examples.gpt:nope", "'nope'"),
        ("--model nowhere/model.py:f", "does not exist"),
        ("--model examples.gpt:tiny --microbatch-sizes 0", "positive"),
        ("--model examples.gpt:tiny --split-points blocks.77", "blocks.77"),
        ("--model examples.gpt:tiny --device cuda:0 --microbatch-sizes 1", "cuda"),
    ],
)
def test_profile_command_errors(argv: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import torch

        if "cuda" in argv and torch.cuda.is_available():
            pytest.skip("CUDA is present")
    except ImportError:
        pass
    rc = main(["profile", *argv.split(), "-q"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and needle in err


def test_non_tensor_inputs_fail_cleanly_in_a_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("import torch\ndef f():\n    return torch.nn.Linear(2, 2), ('not a tensor',)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeplan", "profile", "--model", f"{path}:f"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "example_inputs[0] is a str" in proc.stderr and "Traceback" not in proc.stderr


def test_bundled_measured_profile_matches_the_example_model() -> None:
    p = load_document("profile", str(ROOT / "examples" / "profiles" / "gpt-tiny-cpu.json"))
    model, inputs, _ = gpt.tiny()
    assert p.sha256() == split_model(model, inputs).sha256()
    assert p.measured_on.device == "cpu" and p.measured_on.num_threads is not None
    assert p.model == "examples.gpt:tiny"


def test_measured_profile_feeds_the_cost_model() -> None:
    from planner.cost import Layout, estimate
    from planner.schema import parse_document

    p = load_document("profile", str(ROOT / "examples" / "profiles" / "gpt-tiny-cpu.json"))
    cluster = parse_document("cluster", {"devices": 2, "memory": "1GiB"})
    training = parse_document("training", {"global_batch_size": 16})
    plan = estimate(
        p, cluster, training,
        Layout(
            [(0, 3), (3, 6)],
            num_microbatches=4,
            schedule="1f1b",
        ),
    )
    assert plan.profile_sha256 == p.sha256()
    assert sum(s.param_bytes for s in plan.stages) == sum(layer.param_bytes for layer in p.layers)
    assert plan.predicted.step_time_ms > 0
