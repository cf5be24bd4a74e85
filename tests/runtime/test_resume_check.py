"""``--check`` after ``--resume`` with Adam: the reference trains every step from the seed's
weights, so the parameters' noise allowance must count the steps before the checkpoint too
(:attr:`runtime.training.ReferenceResult.noise_before`), and a checkpoint restored wrongly must
still fail the check.

End to end: the zoo's GPT (examples.gpt:tiny) on 2 gloo ranks, Adam at the default lr: plan A
(K = 2) trains steps 0..1 and saves; plan B (K = 1 x D = 2) resumes at step 2 and trains to step
3 with ``--check``; then the same resume with one restored Adam moment doubled
(``--inject-fault R:2:bad-restore``) fails.  The zoo's GPT passes the resumed check without the
steps before the checkpoint in the allowance too (its parameters differ by less than the
tolerance); Hugging Face's GPT-2 at T = 2 needs them (nightly:
tests/runtime/test_mesh_hf_blocks.py), and the single-process tests here show the mechanism.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.training import (
    NOISE_LEVEL,
    NoiseBound,
    ReferenceResult,
    TrainOptions,
    compare,
    train_reference,
)
from tests.runtime.helpers import make_plan, run_cli, structure_profile, write_plan

MODEL = "examples.gpt:tiny"
ADAM = NoiseBound(max_move=0.1 / 0.001**0.5, eps=1e-8)


# ---- in one process


def _resumed_reference(noise_before: dict[str, torch.Tensor]) -> ReferenceResult:
    """4 steps of Adam at lr 1e-3, resumed at step 2: element 0 of ``w`` has a real gradient at
    the compared steps 2 and 3 (the same in both runs) but was noise before the checkpoint."""
    grads = {"w": torch.tensor([0.5, 0.5])}
    return ReferenceResult(
        losses=[1.0, 1.0],
        params={"w": torch.tensor([1.0, 1.0])},
        grads={2: grads, 3: grads},
        tensor_grad_norms=[{"w": 0.5 * 2**0.5}] * 4,
        lrs=[1e-3] * 4,
        noise=ADAM,
        first_step=2,
        noise_before=noise_before,
    )


def test_the_allowance_counts_the_steps_before_the_checkpoint() -> None:
    """The runs' parameters differ by 2e-3 on element 0 (moved on noise at steps 0..1): without
    the reference's record of those steps the allowance is 0 (its gradients at steps 2..3 agree)
    and the check fails; with it the element gets the whole allowance, 2 x 3.16 x 4e-3; element 1,
    resolved at every step, still fails a difference of 2e-3."""
    grads = {s: {"w": torch.tensor([0.5, 0.5])} for s in (2, 3)}
    moved = {"w": torch.tensor([1.002, 1.0])}
    blind = compare([1.0, 1.0], moved, _resumed_reference({}), grads=grads, tolerance=1e-5)
    assert not blind.passed(1e-5) and blind.max_param_rel_diff == pytest.approx(2e-3, rel=1e-3)
    ref = _resumed_reference({"w": torch.tensor([True, False])})
    seen = compare([1.0, 1.0], moved, ref, grads=grads, tolerance=1e-5)
    assert seen.passed(1e-5), seen.categories
    assert any("before the checkpoint" in c.measure for c in seen.categories)
    other = compare([1.0, 1.0], {"w": torch.tensor([1.0, 1.002])}, ref, grads=grads, tolerance=1e-5)
    assert not other.passed(1e-5) and other.worst_param == "w"


def test_a_resumed_adam_run_compares_every_steps_gradients_by_their_norms() -> None:
    """The resumed run's first step already runs on weights set apart by the optimizer's move on
    noise before the checkpoint: a turned gradient of the same norm passes there, a lost one fails."""
    grads = {s: {"w": torch.tensor([0.5, 0.5])} for s in (2, 3)}
    params = {"w": torch.tensor([1.0, 1.0])}
    ref = _resumed_reference({})
    turned = compare([1.0, 1.0], params, ref, grads={**grads, 2: {"w": torch.tensor([0.5 * 2**0.5, 0.0])}})
    assert turned.max_grad_rel_diff < 1e-3 and not any(c.name == "gradients" for c in turned.categories)
    lost = compare([1.0, 1.0], params, ref, grads={**grads, 2: {"w": None}})
    assert lost.max_grad_rel_diff == pytest.approx(1.0) and lost.worst_grad == "w (step 2)"


def test_the_reference_records_where_gradients_were_noise_before_the_checkpoint() -> None:
    """A bias the loss ignores has a zero gradient: noise at every step; the weight's gradient is
    real.  Only Adam records it, only for the steps before ``first_step``."""
    def run(optimizer: str, first_step: int) -> ReferenceResult:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return train_reference(
            model, (torch.zeros(2, 4),), lambda out: (out * torch.tensor([1.0, 0.0])).sum() ** 2,
            steps=3, global_batch_size=2, microbatch_size=1, optimizer=optimizer, lr=1e-3, seed=0,
            options=TrainOptions(optimizer=optimizer, lr=1e-3, steps=3), first_step=first_step,
        )  # fmt: skip

    ref = run("adam", 2)
    assert ref.first_step == 2 and set(ref.noise_before) == {"weight", "bias"}
    assert ref.noise_before["bias"].tolist() == [False, True]  # output 1 is ignored by the loss
    assert ref.noise_before["weight"][1].all() and not ref.noise_before["weight"][0].any()
    assert NOISE_LEVEL < 1
    assert run("adam", 0).noise_before == {} and run("sgd", 2).noise_before == {}


# ---- end to end: 2 gloo ranks


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Plan B's file and a checkpoint at step 2 written by plan A (K = 2, Adam)."""
    tmp = tmp_path_factory.mktemp("resume-check")
    profile = structure_profile(MODEL)
    a = write_plan(make_plan(profile, [(0, 3), (3, len(profile.layers))], microbatches=2, optimizer="adam"),
                   tmp / "a.json")  # fmt: skip
    b = write_plan(make_plan(profile, [(0, len(profile.layers))], microbatches=1, data_parallel=2, optimizer="adam",
                             pipeline_degree=1), tmp / "b.json")  # fmt: skip
    ck = tmp / "ck"
    proc, _ = run_cli(["run", "--plan", str(a), "--model", MODEL, "--steps", "2", "--checkpoint", str(ck),
                       "--timeout", "60"], timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (ck / "latest").read_text().strip() == "step-000002"
    return b, ck


def _resume(plan: Path, ck: Path, tmp_path: Path, *extra: str) -> tuple[Any, dict[str, Any]]:
    report = tmp_path / "report.json"
    proc, _ = run_cli(["run", "--plan", str(plan), "--model", MODEL, "--steps", "4", "--resume", str(ck), "--check",
                       "--report", str(report), "--timeout", "60", *extra], timeout=240)  # fmt: skip
    return proc, json.loads(report.read_text())


def test_adam_resumed_under_another_plan_passes_the_check(checkpointed: tuple[Path, Path], tmp_path: Path) -> None:
    """Saved under K = 2, resumed under K = 1 x D = 2: Adam's moments travel and are resharded."""
    plan, ck = checkpointed
    proc, report = _resume(plan, ck, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check PASSED" in proc.stdout, proc.stdout[-3000:]
    check = report["check"]
    assert check["passed"] and len(check["losses_reference"]) == 2, check
    assert any(n.startswith("check after --resume") for n in report["notes"])


def test_a_wrongly_restored_adam_moment_fails_the_check(checkpointed: tuple[Path, Path], tmp_path: Path) -> None:
    """Rank 0 doubles its first parameter's restored ``exp_avg``: the reference, trained from the
    seed rather than loaded from the checkpoint, sees the difference in the losses and parameters."""
    plan, ck = checkpointed
    proc, report = _resume(plan, ck, tmp_path, "--inject-fault", "0:2:bad-restore")
    check = report["check"]
    assert proc.returncode == 1 and not check["passed"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check FAILED" in proc.stdout
    # measured: 5.1e-4 in the losses (step 3), 3.2e-4 in the parameters, 30x the tolerance and more
    assert check["max_loss_rel_diff"] > 1e-4 and check["max_param_rel_diff"] > 1e-4, check
