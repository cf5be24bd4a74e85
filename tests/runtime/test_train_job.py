"""A real training job end to end: the zoo GPT on a character corpus (``examples.charlm``),
with targets, bf16 autocast, gradient clipping and a warm-up + cosine schedule, on 2 gloo
ranks (K = 2) and on 4 (D = 2 x K = 2, each replica reading its own rows), against the
unsplit model in bf16; and the data errors that must end a job at once.
"""

from __future__ import annotations

import itertools
import json
import uuid
from pathlib import Path

import pytest

from planner.schema import Profile
from runtime.steplog import read_log
from runtime.training import DEFAULT_TOLERANCES, TrainOptions
from tests.runtime.helpers import (
    make_plan,
    processes_mentioning,
    run_cli,
    structure_profile,
    write_plan,
)

SPEC = "examples.charlm:gpt"
SHARDED = "examples.charlm:gpt_sharded"
# SGD with momentum: the bf16 tolerance is one bf16 rounding step of what SGD computes; Adam
# moves the attention key biases, whose true gradient is zero, by about lr on rounding noise,
# which grows with bf16's (see the README)
KNOBS = ["--steps", "6", "--lr", "0.5", "--lr-schedule", "cosine", "--warmup-steps", "2",
         "--clip-grad-norm", "1.0", "--dtype", "bf16", "--check", "--timeout", "60"]  # fmt: skip


@pytest.fixture(scope="module")
def profile() -> Profile:
    return structure_profile(SPEC)  # the same layers as examples.gpt:tiny (and gpt_sharded)


def _losses_fall(rows: list[dict]) -> None:  # type: ignore[type-arg]
    losses = [r["loss"] for r in rows]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(b < a for a, b in itertools.pairwise(losses[1:])), losses  # after the warm-up step


def _run(plan_file: Path, spec: str, tmp_path: Path) -> tuple[dict, list[dict]]:  # type: ignore[type-arg]
    report_file, log_file = tmp_path / "report.json", tmp_path / "log.csv"
    proc, _ = run_cli(["run", "--plan", str(plan_file), "--model", spec, *KNOBS, "--report", str(report_file),
                             "--log-file", str(log_file)], timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check PASSED" in proc.stdout and f"per-step log written to {log_file}" in proc.stdout
    return json.loads(report_file.read_text()), read_log(log_file)


@pytest.mark.slow
def test_two_ranks_train_the_corpus_gpt_in_bf16_like_the_unsplit_model(profile: Profile, tmp_path: Path) -> None:
    plan = make_plan(profile, [(0, 3), (3, 6)], optimizer="sgd-momentum", microbatch_size=4, microbatches=4, dtype="bf16")
    report, rows = _run(write_plan(plan, tmp_path / "plan.json"), SPEC, tmp_path)
    check = report["check"]
    assert check["passed"] and check["tolerance"] == DEFAULT_TOLERANCES["bfloat16"]
    assert check["max_loss_rel_diff"] <= check["tolerance"] and check["max_param_rel_diff"] <= check["tolerance"]
    assert check["losses_pipelined"] == pytest.approx(check["losses_reference"], rel=check["tolerance"])
    # the log: one line per step, the schedule's learning rates, the clipped norm, the falling loss
    assert [r["step"] for r in rows] == list(range(6))
    opts = TrainOptions(optimizer="sgd-momentum", lr=0.5, steps=6, lr_schedule="cosine", warmup_steps=2)
    assert [r["lr"] for r in rows] == pytest.approx([opts.lr_at(s) for s in range(6)])
    assert all(r["grad_norm"] > 0 and r["step_ms"] > 0 and r["samples_per_s"] > 0 for r in rows)
    assert [r["loss"] for r in rows] == pytest.approx(check["losses_pipelined"], rel=1e-6)
    _losses_fall(rows)
    notes = " ".join(report["notes"])
    assert "bfloat16 autocast with float32 master weights" in notes and "clipped to global norm 1" in notes
    assert "read by rank(s) 0, 1 (the first stage's inputs, the last stage's targets" in notes


@pytest.mark.slow
def test_data_parallel_pipelines_read_their_own_rows_and_match_the_unsplit_model(profile: Profile, tmp_path: Path) -> None:
    plan = make_plan(profile, [(0, 3), (3, 6)], optimizer="sgd-momentum", microbatch_size=2, microbatches=4,
                     data_parallel=2, devices=4, dtype="bf16")  # fmt: skip
    assert plan.world_size == 4 and plan.data_parallel_degree == 2
    report, rows = _run(write_plan(plan, tmp_path / "plan.json"), SHARDED, tmp_path)
    check = report["check"]
    assert check["passed"] and check["max_loss_rel_diff"] <= check["tolerance"], check
    _losses_fall(rows)
    assert any("each of the 2 replica(s) reads its own 8 rows" in n for n in report["notes"])


_ENDS_EARLY = """
import os
import torch
from examples.charlm import gpt, CharWindows, next_char_loss
from torch.utils.data import DataLoader

def f():
    model, inputs, loss, _ = gpt()
    def batches():
        for x, y in DataLoader(CharWindows(), batch_size=16):
            with open({log!r}, "a") as out:
                out.write(os.environ.get("RANK", "launcher") + "\\n")
            yield x, y
            return  # one batch only
    return model, inputs, loss, batches()
"""


@pytest.mark.slow
def test_data_that_ends_early_stops_every_rank_at_that_step_and_middle_stages_read_nothing(
    profile: Profile, tmp_path: Path
) -> None:
    reads = tmp_path / "reads.txt"
    model_file = tmp_path / f"ends_early_{uuid.uuid4().hex[:8]}.py"
    model_file.write_text(_ENDS_EARLY.replace("{log!r}", repr(str(reads))))
    spec = f"{model_file}:f"
    plan = make_plan(profile, [(0, 2), (2, 4), (4, 6)], microbatch_size=4, microbatches=4, devices=3)
    plan_file = write_plan(plan, tmp_path / "plan.json")
    proc, elapsed = run_cli(["run", "--plan", str(plan_file), "--model", spec, "--steps", "3", "--timeout", "20"], timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ended after 1 batches, at step 1 of --steps 3" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and elapsed < 60
    # the launcher's own copy, then the first stage (inputs) and the last (targets); not rank 1
    assert sorted(reads.read_text().split()) == ["0", "2", "launcher"]
    assert not processes_mentioning(model_file.name)


def test_a_loader_too_short_for_the_steps_is_refused_before_any_rank_starts(
    profile: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeplan.cli import main

    model_file = tmp_path / "short.py"
    model_file.write_text(
        "from torch.utils.data import DataLoader\n"
        "from examples.charlm import gpt, CharWindows\n"
        "def f():\n"
        "    model, inputs, loss, _ = gpt()\n"
        "    return model, inputs, loss, DataLoader(CharWindows(), batch_size=16, drop_last=True)\n"
    )
    plan_file = write_plan(make_plan(profile, [(0, 3), (3, 6)], microbatch_size=4, microbatches=4), tmp_path / "p.json")
    # in this process: the launcher refuses before starting any rank
    assert main(["run", "--plan", str(plan_file), "--model", f"{model_file}:f", "--steps", "50"]) == 1
    err = capsys.readouterr().err
    assert "has 11 batches but --steps 50 needs 50" in err and "Traceback" not in err


def test_a_run_in_another_dtype_than_the_plan_is_refused(
    profile: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeplan.cli import main

    plan_file = write_plan(make_plan(profile, [(0, 3), (3, 6)]), tmp_path / "plan.json")
    assert main(["run", "--plan", str(plan_file), "--model", SPEC, "--dtype", "bf16", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "--dtype bfloat16 does not match the dtype the plan was made for, float32" in err
    assert "make the plan with --dtype bfloat16" in err and "Traceback" not in err
