"""The real-model zoo end to end: profile -> plan (K = 2 1F1B, and 4 chunks interleaved) ->
``run --check`` on 2 gloo ranks, every entry with its default dropout.

GPT-2 takes the README's command-line path (``pipeplan profile``, ``plan``, ``pipeplan run``);
the others profile in this process, plan with the solver and launch the ranks with torchrun
directly (the same worker, without the launcher's second model build).  2 steps each, a tiny
global batch: the check compares losses and every parameter with the unsplit model trained in
one process (SGD, tolerance 1e-5).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from planner.schema import parse_document
from planner.solver import solve
from profiler.loading import load_entrypoint
from profiler.measure import profile
from tests.runtime.helpers import run_cli, run_torchrun

pytestmark = pytest.mark.slow

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HF = ["gpt2", "llama", "qwen2", "mixtral", "bert", "t5", "vit"]
VISION = ["resnet", "mobilenet", "convnext", "densenet", "googlenet"]
ZOO = [
    *(pytest.param(f"examples.hf:{n}", marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers"))
      for n in HF),
    *(f"examples.vision:{n}" for n in VISION),
]  # fmt: skip
SCHEDULES = {"1f1b": {"stages": 2}, "interleaved": {"stages": 2, "virtual_stages": 2, "schedule": "interleaved-1f1b"}}


@pytest.fixture(scope="module")
def profiles() -> dict[str, Any]:
    """Each entry's profile, measured once for both schedules."""
    return {}


def _plan(spec: str, schedule: str, profiles: dict[str, Any]) -> Any:
    if spec not in profiles:
        entry = load_entrypoint(spec)
        profiles[spec] = profile(entry.model, entry.example_inputs, keywords=entry.keywords, microbatch_sizes=(1, 2),
                                 loss_fn=entry.loss_fn, warmup=0, repeats=1, progress=False, name=spec)  # fmt: skip
    prof = profiles[spec]
    cluster = parse_document("cluster", {"devices": 2, "device_type": "cpu", "intra_node": "loopback"})
    training = parse_document("training", {"global_batch_size": 8, "optimizer": "sgd"})
    options = {"data_parallel": 1, "num_microbatches": 4, "schedule": "1f1b", **SCHEDULES[schedule]}
    return solve(prof, cluster, training, parse_document("options", options))


def _check(report_file: Path, proc: Any) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check: dict[str, Any] = json.loads(report_file.read_text())["check"]
    assert check["passed"] and check["max_loss_rel_diff"] <= 1e-5 and check["max_param_rel_diff"] <= 1e-5, check
    return check


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("spec", ZOO)
def test_zoo_entry_trains_pipelined_exactly_like_the_unsplit_model(
    spec: str, schedule: str, profiles: dict[str, Any], tmp_path: Path
) -> None:
    if spec == "examples.hf:gpt2" and schedule == "1f1b":
        pytest.skip("GPT-2 1F1B runs through the command line below")
    plan = _plan(spec, schedule, profiles)
    assert plan.pipeline_degree == 2 and len(plan.stages) == (4 if schedule == "interleaved" else 2)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.model_dump_json())
    report = tmp_path / "report.json"
    proc, _ = run_torchrun(2, ["--plan", str(plan_file), "--model", spec, "--steps", "2", "--lr", "0.05",
                               "--check", "--report", str(report), "--timeout", "60"], timeout=300)  # fmt: skip
    _check(report, proc)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_gpt2_through_the_command_line(tmp_path: Path) -> None:
    """The README's path on a raw GPT2LMHeadModel called with input_ids as a keyword argument,
    dropout 0.1: profile -> plan --devices 2 -> pipeplan run --check (1F1B; its interleaved
    plan runs above); an interleaved plan asked for with --stages 4 has 4 stages."""
    prof = tmp_path / "gpt2.json"
    proc, _ = run_cli(["profile", "--model", "examples.hf:gpt2", "--microbatch-sizes", "1,2", "--warmup", "0",
                       "--repeats", "1", "-q", "-o", str(prof)], timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    names = [layer["name"] for layer in json.loads(prof.read_text())["layers"]]
    assert [n for n in names if n.startswith("transformer.h.")] == [f"transformer.h.{i}" for i in range(4)]
    for flags, stages in ((["--schedule", "interleaved-1f1b", "--stages", "4", "--virtual-stages", "2"], 4),
                          (["--stages", "2", "--schedules", "gpipe,1f1b,interleaved-1f1b"], 2)):  # fmt: skip
        plan_file = tmp_path / "plan.json"
        proc, _ = run_cli(["plan", str(prof), "--devices", "2", "--device-type", "cpu", "--batch-size", "8",
                           "--optimizer", "sgd", "--data-parallel", "1", "--microbatches", "4", *flags,
                           "-o", str(plan_file)])  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert len(json.loads(plan_file.read_text())["stages"]) == stages  # --stages counts stages
        if stages == 4:
            continue
        report = tmp_path / "report.json"
        proc, _ = run_cli(["run", "--plan", str(plan_file), "--model", "examples.hf:gpt2", "--steps", "2",
                           "--lr", "0.05", "--check", "--report", str(report), "--timeout", "60"], timeout=300)  # fmt: skip
        _check(report, proc)
        assert "dropout" in proc.stdout
