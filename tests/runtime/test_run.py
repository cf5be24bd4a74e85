"""End to end: ``pipeplan run`` on 2 CPU processes (gloo), against the unsplit model.

Each test launches real ranks through torchrun; OMP_NUM_THREADS=1.  They are the issue's
acceptance tests: GPipe, 1F1B, interleaved 1F1B (2 stages per rank), recompute and
D = 2 x K = 1 reproduce the single-process run after 3 steps; a mismatched plan is refused;
a rank that raises or hangs ends the job promptly with no process left behind (a rank
that dies is diagnosed from its exit code: see test_faults.py).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from planner.schema import Plan, Profile
from runtime.steplog import read_log
from tests.runtime.helpers import (
    make_plan,
    processes_mentioning,
    run_cli,
    run_torchrun,
    structure_profile,
    write_plan,
)

pytestmark = pytest.mark.slow

GPT = "examples.gpt:tiny"  # embed, blocks.0-3, head (tied to embed)
RESNET = "examples.resnet:tiny"  # stem, 6 BatchNorm blocks, fc; cross-entropy loss
TIED = "tests.runtime.tied_model:tiny"  # 6 linear layers, two weights tied across stages


@pytest.fixture(scope="module")
def profiles() -> dict[str, Profile]:
    return {spec: structure_profile(spec) for spec in (GPT, RESNET, TIED)}


CASES = {
    "gpipe": (GPT, [(0, 3), (3, 6)], dict(schedule="gpipe", optimizer="sgd")),
    # the tied embedding (stage 0) and LM head (stage 1) sit on different ranks
    "1f1b": (GPT, [(0, 2), (2, 6)], dict(schedule="1f1b", optimizer="sgd-momentum")),
    # 6 stages on 2 ranks (v=3) of an example model
    "interleaved": (
        GPT,
        [(i, i + 1) for i in range(6)],
        dict(schedule="interleaved-1f1b", optimizer="sgd", pipeline_degree=2),
    ),
    # rank 0 runs stages 0, 2, 4 and rank 1 stages 1, 3, 5: layers 0 and 2 share a weight on
    # one rank, layers 1 and 4 share one across the two ranks
    "interleaved-tied": (
        TIED,
        [(i, i + 1) for i in range(6)],
        dict(schedule="interleaved-1f1b", optimizer="sgd-momentum", pipeline_degree=2),
    ),
    "recompute": (RESNET, [(0, 4), (4, 8)], dict(schedule="1f1b", optimizer="sgd-momentum", recompute=True)),
    "data-parallel": (GPT, [(0, 6)], dict(schedule="gpipe", optimizer="sgd", data_parallel=2)),
}


#: cases run with another entry point of the same layers: the interleaved schedule with targets
#: (examples.charlm is examples.gpt:tiny trained on a corpus with a loss(output, target))
RUN_AS = {"interleaved": "examples.charlm:gpt"}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_training_matches_the_unsplit_model(case: str, profiles, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec, stages, options = CASES[case]
    plan = make_plan(profiles[spec], stages, **options)  # type: ignore[arg-type]
    assert plan.world_size == 2
    plan_file = write_plan(plan, tmp_path / "plan.json")
    report_file = tmp_path / "report.json"
    log_file = tmp_path / "steps.jsonl"
    worker_flags = ["--plan", str(plan_file), "--model", RUN_AS.get(case, spec), "--steps", "3", "--lr", "0.05",
                    "--check", "--report", str(report_file), "--timeout", "30"]  # fmt: skip
    if case in RUN_AS:  # and a per-step log without clipping: every rank still joins the norm
        worker_flags += ["--log-file", str(log_file)]
    if case == "gpipe":
        # the entry module directly under torchrun, as on a cluster without pipeplan run
        proc, elapsed = run_torchrun(2, worker_flags)
    else:
        proc, elapsed = run_cli(["run", *worker_flags])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert elapsed < 60
    report = json.loads(report_file.read_text())
    check = report["check"]
    assert check["passed"] and check["max_loss_rel_diff"] <= 1e-5 and check["max_param_rel_diff"] <= 1e-5, check
    if case in RUN_AS:
        rows = read_log(log_file)
        assert [r["loss"] for r in rows] == pytest.approx(check["losses_pipelined"], rel=1e-6)
        assert all(r["grad_norm"] > 0 for r in rows)
    assert check["params_compared"] > 0
    assert len(report["steps"]) == 3 and all(s["measured_ms"] > 0 for s in report["steps"])
    # the loss moved: the optimizer really stepped
    assert check["losses_reference"][0] != check["losses_reference"][-1]
    assert check["losses_pipelined"] == pytest.approx(check["losses_reference"], rel=1e-5)
    assert [s["index"] for s in report["stages"]] == list(range(len(stages)))
    assert all(s["forward_ms"] and s["backward_ms"] for s in report["stages"])
    assert report["schedule"] == plan.schedule and report["data_parallel_degree"] == plan.data_parallel_degree
    assert "check PASSED" in proc.stdout
    # the report is the schema's document, with where the time went (what calibrate reads)
    from planner.schema import load_document

    doc = load_document("report", str(report_file))
    assert doc.plan == plan and doc.shared_clock
    assert len(doc.rank_steps) == 2 * 3 and all(r.schedule_ms > 0 for r in doc.rank_steps)
    timed = {(t.stage, t.replica, t.step) for t in doc.timeline}
    replicas = plan.data_parallel_degree
    assert timed == {(s, d, step) for s in range(len(stages)) for d in range(replicas) for step in (1, 2)}
    for row in doc.timeline:  # each action starts after the step began and they do not overlap on a stage
        assert all(x >= 0 for x in row.forward_start_ms) and all(x > 0 for x in row.forward_ms)
        assert all(b >= f for f, b in zip(row.forward_start_ms, row.backward_start_ms, strict=True))


def test_split_points_travel_with_the_plan(tmp_path: Path) -> None:
    """A profile made with --split-points gives a plan that records them; the runtime cuts
    the model there (not at every block) and trains exactly."""
    prof = structure_profile(GPT, ["blocks.2"])
    assert prof.layer_names() == ["embed", "blocks.2"]
    plan = make_plan(prof, [(0, 1), (1, 2)], schedule="1f1b")
    assert plan.split_points == ["blocks.2"]
    plan_file = write_plan(plan, tmp_path / "plan.json")
    report_file = tmp_path / "report.json"
    proc, _ = run_cli(["run", "--plan", str(plan_file), "--model", GPT, "--steps", "2", "--check",
                       "--report", str(report_file), "--timeout", "30"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(report_file.read_text())["check"]["passed"]


def test_a_failed_check_says_so_once(profiles, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A tolerance no float32 run meets (1e-12): the check fails, and its error line (losses,
    gradients, parameters) is printed once, with exit code 1."""
    plan_file = write_plan(make_plan(profiles[GPT], [(0, 3), (3, 6)], optimizer="adam"), tmp_path / "plan.json")
    proc, _ = run_cli(["run", "--plan", str(plan_file), "--model", GPT, "--steps", "3", "--lr", "0.05",
                       "--check", "--tolerance", "1e-12", "--timeout", "30"])  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "--check failed" in line]
    assert len(errors) == 1 and errors[0].startswith("error: --check failed"), proc.stderr
    assert "(gradients, worst " in errors[0] and "(parameters, worst " in errors[0], errors[0]
    assert "Traceback" not in proc.stderr


def test_mismatched_plan_is_refused_before_launch(profiles, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plan = make_plan(profiles[RESNET], [(0, 4), (4, 8)])
    plan_file = write_plan(plan, tmp_path / "plan.json")
    proc, elapsed = run_cli(["run", "--plan", str(plan_file), "--model", GPT, "--steps", "1"])
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "does not match the model" in proc.stderr
    assert "the plan is for 8 layers but the model splits into 6" in proc.stderr
    assert "layer 0 is 'stem' in the plan but 'embed' in the model" in proc.stderr
    assert elapsed < 30


def test_wrong_process_count_is_refused(profiles, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plan_file = write_plan(make_plan(profiles[GPT], [(0, 3), (3, 6)]), tmp_path / "plan.json")
    proc, _ = run_cli(["run", "--plan", str(plan_file), "--model", GPT, "--nproc-per-node", "1"])
    assert proc.returncode == 1 and "the plan needs 2 processes" in proc.stderr, proc.stderr


def _unique_model_file(tmp_path: Path) -> tuple[str, str]:
    """A model file whose path marks this test's processes."""
    path = tmp_path / f"gpt_{uuid.uuid4().hex[:12]}.py"
    path.write_text("from examples.gpt import tiny\n")
    return f"{path}:tiny", path.name


@pytest.mark.parametrize(
    ("mode", "expect"),
    [
        ("raise", "rank 1 (stage 1) raised RuntimeError: injected fault on rank 1 at step 1 (during step 1)"),
        ("hang", "rank 1 (stage 1) stopped responding during step 1"),
    ],
)
def test_failing_rank_ends_the_job(mode: str, expect: str, profiles, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec, marker = _unique_model_file(tmp_path)
    plan_file = write_plan(make_plan(profiles[GPT], [(0, 3), (3, 6)]), tmp_path / "plan.json")
    proc, elapsed = run_cli(
        ["run", "--plan", str(plan_file), "--model", spec, "--steps", "3", "--timeout", "5",
         "--inject-fault", f"1:1:{mode}"]
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expect in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 60
    assert processes_mentioning(marker) == []


def test_partial_recompute_checkpoints_the_first_layers_and_trains_exactly(tmp_path: Path) -> None:
    """Megatron's ``--recompute-method block`` per stage: stage 0 checkpoints its first 2 of 3
    layers, stage 1 its first 1 of 3, each layer under its own checkpoint; dropout 0.1 is on, so
    a re-run layer must draw the forward's masks for --check to pass.  The report marks them."""
    spec = "tests.runtime.gpt_dropout:tiny"  # examples.gpt:tiny with dropout
    full = make_plan(structure_profile(spec), [(0, 3), (3, 6)], schedule="1f1b", optimizer="sgd", recompute=True)
    counts = (2, 1)
    stages = [st.model_copy(update={"recompute_layers": n}) for st, n in zip(full.stages, counts, strict=True)]
    plan = full.model_copy(update={"stages": stages})
    plan_file = write_plan(plan, tmp_path / "plan.json")
    assert [st.checkpointed_layers for st in Plan.model_validate_json(plan_file.read_text()).stages] == list(counts)
    report_file = tmp_path / "report.json"
    proc, _ = run_cli(["run", "--plan", str(plan_file), "--model", spec, "--steps", "3", "--lr", "0.05",
                       "--check", "--report", str(report_file), "--timeout", "30"])  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = json.loads(report_file.read_text())["check"]
    assert check["passed"] and check["max_loss_rel_diff"] <= 1e-5 and check["max_param_rel_diff"] <= 1e-5, check
    assert check["losses_reference"][0] != check["losses_reference"][-1]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:2] in (["0", "0"], ["1", "1"])]
    assert [row[4] for row in rows] == [str(n) for n in counts], proc.stdout  # the rc column: layers checkpointed
