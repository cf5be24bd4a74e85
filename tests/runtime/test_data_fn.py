"""FUNC's data function: the ranks and the --check reference train on its batches.

``examples.gpt:tiny_with_data`` is ``examples.gpt:tiny`` (same layers, same weights) plus a
deterministic toy token stream as ``data_fn(step, batch_size)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from examples.gpt import GPTConfig
from planner.errors import InputError
from profiler.loading import Entrypoint, load_entrypoint
from runtime.training import batch_fingerprint, global_batch, synthetic_batch, train_reference
from tests.runtime.helpers import make_plan, run_cli, structure_profile, write_plan

SPEC = "examples.gpt:tiny_with_data"


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _ramp(step: int, batch_size: int) -> Tensor:
    rows = torch.arange(step * batch_size, (step + 1) * batch_size, dtype=torch.float32)
    return torch.stack([rows / 10, (rows % 3) - 1, torch.ones(batch_size)], dim=1)


def test_global_batch_uses_the_data_function_and_ignores_the_seed() -> None:
    example = (torch.zeros(2, 3),)
    (a,) = global_batch(example, 6, seed=1, step=4, data_fn=_ramp)
    (b,) = global_batch(example, 6, seed=2, step=4, data_fn=_ramp)
    assert torch.equal(a, _ramp(4, 6)) and torch.equal(a, b)
    (synthetic,) = global_batch(example, 6, seed=1, step=4)
    assert torch.equal(synthetic, synthetic_batch(example, 6, seed=1, step=4)[0])
    assert not torch.equal(synthetic, a)


def test_global_batch_checks_every_step() -> None:
    def short_at_step_2(step: int, batch_size: int) -> Tensor:
        return _ramp(step, batch_size - (step == 2))

    example = (torch.zeros(2, 3),)
    global_batch(example, 6, seed=0, step=1, data_fn=short_at_step_2)
    with pytest.raises(InputError, match=r"step=2, batch_size=6.*shape \(5, 3\).*expected shape \(6, 3\)"):
        global_batch(example, 6, seed=0, step=2, data_fn=short_at_step_2)


def test_reference_trains_on_the_data_functions_batches() -> None:
    """The reference asks for each step's global batch once and trains on exactly that."""
    calls: list[tuple[int, int]] = []

    def recording(step: int, batch_size: int) -> Tensor:
        calls.append((step, batch_size))
        return _ramp(step, batch_size)

    def loss(out: Tensor) -> Tensor:
        return out.pow(2).mean()

    example = (torch.zeros(2, 3),)
    kw: dict[str, object] = dict(steps=3, global_batch_size=8, microbatch_size=2, optimizer="sgd", lr=0.1, seed=0)
    ref = train_reference(_linear(), example, loss, data_fn=recording, **kw)  # type: ignore[arg-type]
    assert calls == [(0, 8), (1, 8), (2, 8)]
    # by hand: full-batch steps on the same batches (a per-sample mean loss accumulates exactly)
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step in range(3):
        value = loss(model(_ramp(step, 8)))
        value.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        expected.append(float(value.detach()))
    assert ref.losses == pytest.approx(expected, rel=1e-6)
    synthetic = train_reference(_linear(), example, loss, **kw)  # type: ignore[arg-type]
    assert synthetic.losses[0] != pytest.approx(ref.losses[0], rel=1e-3)


@pytest.fixture(scope="module")
def tiny_with_data() -> Entrypoint:
    return load_entrypoint(SPEC)


@settings(max_examples=25, deadline=None)
@given(step=st.integers(0, 10_000), batch_size=st.integers(1, 16))
def test_token_stream_fits_the_model_at_any_step(tiny_with_data: Entrypoint, step: int, batch_size: int) -> None:
    entry = tiny_with_data
    (ids,) = entry.batch(step, batch_size)
    assert ids.shape == (batch_size, entry.example_inputs[0].shape[1]) and ids.dtype == torch.long
    vocab = GPTConfig().vocab
    assert 0 <= int(ids.min()) and int(ids.max()) < vocab
    # deterministic in (step, batch_size), and consecutive steps differ
    assert batch_fingerprint(entry.batch(step, batch_size)) == batch_fingerprint((ids,))
    if step > 0:
        (prev,) = entry.batch(step - 1, batch_size)
        assert not torch.equal(prev, ids)


def test_example_is_tiny_with_other_data() -> None:
    tiny, with_data = load_entrypoint("examples.gpt:tiny"), load_entrypoint(SPEC)
    assert tiny.data_fn is None and with_data.data_fn is not None
    for (n1, p1), (n2, p2) in zip(tiny.model.state_dict().items(), with_data.model.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert with_data.example_inputs[0].shape == tiny.example_inputs[0].shape


def _reference(entry_spec: str, *, data: bool, steps: int, gbs: int, mbs: int, lr: float) -> list[float]:
    entry = load_entrypoint(entry_spec)
    torch.manual_seed(0)
    fn: Callable[[int, int], object] | None = entry.data_fn if data else None
    return train_reference(
        entry.model, entry.example_inputs, entry.loss, steps=steps, global_batch_size=gbs,
        microbatch_size=mbs, optimizer="sgd", lr=lr, seed=0, data_fn=fn,
    ).losses  # fmt: skip


@pytest.mark.slow
def test_two_ranks_train_on_the_data_function_and_match_the_unsplit_model(tmp_path: Path) -> None:
    # the tied embedding (stage 0) and LM head (stage 1) sit on different ranks
    plan = make_plan(structure_profile(SPEC), [(0, 2), (2, 6)], schedule="1f1b", optimizer="sgd")
    plan_file = write_plan(plan, tmp_path / "plan.json")
    report_file = tmp_path / "report.json"
    proc, elapsed = run_cli(
        ["run", "--plan", str(plan_file), "--model", SPEC, "--steps", "3", "--lr", "0.05", "--check",
         "--report", str(report_file), "--timeout", "30"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert elapsed < 60  # no hang; a loaded 2-core machine takes 20-40 s
    report = json.loads(report_file.read_text())
    check = report["check"]
    assert check["passed"] and check["max_loss_rel_diff"] <= 1e-5 and check["max_param_rel_diff"] <= 1e-5, check
    assert any(n.startswith(f"data: the data function of {SPEC}") for n in report["notes"])
    # what the ranks trained on: the data function's batches, not the synthetic ones
    kw = dict(steps=3, gbs=plan.global_batch_size, mbs=plan.microbatch_size, lr=0.05)
    on_data = _reference(SPEC, data=True, **kw)  # type: ignore[arg-type]
    on_synthetic = _reference(SPEC, data=False, **kw)  # type: ignore[arg-type]
    assert check["losses_pipelined"] == pytest.approx(on_data, rel=1e-5)
    assert check["losses_pipelined"][0] != pytest.approx(on_synthetic[0], rel=1e-3)


@pytest.mark.slow
def test_ranks_that_disagree_on_the_data_are_refused(tmp_path: Path) -> None:
    model_file = tmp_path / "rank_dependent_data.py"
    model_file.write_text(
        "import os\n"
        "from examples.gpt import tiny_with_data\n"
        "from examples.charlm import next_char_loss\n"
        "def f():\n"
        "    model, inputs, loss, data = tiny_with_data()\n"
        "    shift = int(os.environ.get('RANK', '0'))\n"
        "    def batch(step, n):\n"
        "        ids = (data(step, n) + shift) % 256\n"
        "        return ids, ids.roll(-1, 1)\n"
        "    # a loss that takes targets: the last stage (rank 1) reads the data too\n"
        "    return model, inputs, next_char_loss, batch\n"
    )
    spec = f"{model_file}:f"
    plan_file = write_plan(make_plan(structure_profile(spec), [(0, 3), (3, 6)]), tmp_path / "plan.json")
    proc, elapsed = run_cli(["run", "--plan", str(plan_file), "--model", spec, "--steps", "2", "--timeout", "20"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "gave rank 1 a different global batch than rank 0 at step 0" in proc.stderr, proc.stderr
    assert "deterministic" in proc.stderr and "Traceback" not in proc.stderr
    assert elapsed < 60  # no hang; a loaded 2-core machine takes 20-40 s
