"""Context parallelism (C) in the runtime (runtime/context_parallel.py): with C = 2 each rank
holds two of the four chunks of every sequence (causal balance), attention all-gathers K and V,
positions are global, and ``pipeplan run --check`` matches the unsplit model on the zoo GPT
(its own softmax(q @ k^T) @ v attention, learned positions) and on Hugging Face Llama (SDPA,
rotary positions); attention that forgets the gather fails the check; refusals name the axis.

Both plans are made as a user makes them (the fake-tensor profile, ``plan --context-parallel 2``):
the zoo GPT's census holds its attention as two batched GEMMs, which the planner takes for
materialised attention (``planner.context.materialised_attention``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from planner.errors import InputError
from tests.runtime.helpers import fake_profile_file, run_cli

GPT, LLAMA = "examples.gpt:tiny", "examples.hf:llama"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def _plan_fields(**kw: int) -> SimpleNamespace:
    fields = {"context_parallel_degree": 2, "expert_parallel_degree": 1, "tensor_parallel_degree": 1,
              "data_parallel_degree": 1, "zero_stage": 0, "pipeline_degree": 1}  # fmt: skip
    return SimpleNamespace(**{**fields, **kw})


def test_each_rank_holds_chunk_c_and_2c_minus_1_minus_c() -> None:
    from runtime.context_parallel import local_positions, local_sequence

    assert local_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    both = torch.cat([local_positions(24, r, 3) for r in range(3)])
    assert sorted(both.tolist()) == list(range(24))  # every token on exactly one rank
    ids = torch.arange(32).view(2, 16)
    assert local_sequence(ids, 16, 1, 2).tolist() == [list(range(4, 12)), list(range(20, 28))]
    assert local_sequence(torch.zeros(2, 5), 16, 1, 2).shape == (2, 5)  # not a sequence: whole


def test_gpt_attention_and_positions_are_found_in_the_graph() -> None:
    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.context_sites import attention_sites, context_problems, position_aranges

    entry = load_entrypoint(GPT)
    split = split_model(entry.model, tuple(t[:, :16] for t in entry.example_inputs), keywords=entry.keywords)
    kinds = [[kind for kind, _ in attention_sites(u)] for u in split.units]
    assert kinds == [[], ["math"], ["math"], ["math"], ["math"], []]
    positions = position_aranges(split.units[0], 16)
    assert len(positions) == 1  # the learned position embedding's ids
    units, names = list(split.units), list(split.names)
    assert context_problems(units, names, _plan_fields()) == []
    problems = context_problems(units, names, _plan_fields(tensor_parallel_degree=2, zero_stage=2))
    assert any("tensor parallelism (T=2)" in p and "--tensor-parallel 1" in p for p in problems)
    assert any("ZeRO 2" in p and "--zero 0" in p for p in problems)
    (none,) = context_problems(units[-1:], names[-1:], _plan_fields())
    assert "context parallelism (C=2)" in none and "no layer of this model has an attention" in none


def test_a_sequence_2c_does_not_divide_is_refused() -> None:
    from runtime.axes import local_examples

    with pytest.raises(InputError, match=r"sequence length 30 is not divisible by 2C = 4.*--context-parallel"):
        local_examples((torch.zeros(2, 30, dtype=torch.long),), _plan_fields(), 0)
    with pytest.raises(InputError, match=r"first input shaped \[batch, sequence"):
        local_examples((torch.zeros(2),), _plan_fields(), 0)


def _cp_plan(profile: Path, tmp_path: Path) -> Path:
    plan = tmp_path / "plan.json"
    proc, _ = run_cli(["plan", str(profile), "--devices", "2", "--device-type", "cpu", "--batch-size", "8",
                       "--context-parallel", "2", "--data-parallel", "1", "--zero", "0", "--optimizer", "sgd",
                       "-o", str(plan)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(plan.read_text())["context_parallel_degree"] == 2
    return plan


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gpt")
    return _cp_plan(fake_profile_file(GPT, tmp / "profile.json"), tmp)


def _run(spec: str, plan: Path, *extra: str) -> tuple[int, str]:
    proc, _ = run_cli(["run", "--plan", str(plan), "--model", spec, "--steps", "2", "--lr", "0.05", "--check",
                       *extra], timeout=240)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_zoo_gpt_trains_with_sequences_split_like_the_unsplit_model(gpt_plan: Path) -> None:
    code, out = _run(GPT, gpt_plan)
    assert code == 0 and "check PASSED" in out, out
    assert "context parallelism C=2: each rank holds 1/2 of every sequence; 4 attention(s)" in out
    # the gradients are averaged over the data axis, which folds C in: by DDP's buckets
    assert "data-parallel gradients: torch DDP over the 2 ranks of each stage's data axis (D x C = 1 x 2)" in out


@pytest.mark.slow
def test_attention_without_the_kv_gather_fails_the_check(gpt_plan: Path) -> None:
    code, out = _run(GPT, gpt_plan, "--inject-fault", "1:1:no-kv-gather")
    assert code != 0 and "check FAILED" in out, out


@pytest.mark.slow
@needs_transformers
def test_llama_sdpa_and_rotary_positions_under_context_parallelism(tmp_path: Path) -> None:
    profile = fake_profile_file(LLAMA, tmp_path / "profile.json")
    code, out = _run(LLAMA, _cp_plan(profile, tmp_path))
    assert code == 0 and "check PASSED" in out, out


def test_context_with_expert_parallelism_is_refused_naming_both_axes() -> None:
    from runtime.experts import expert_problems

    problems = expert_problems([], [], _plan_fields(expert_parallel_degree=2, data_parallel_degree=2))
    assert any("expert parallelism (E=2) with context parallelism (C=2)" in p and "--context-parallel 1" in p
               for p in problems)  # fmt: skip


def test_pipeplan_run_refuses_before_any_rank_starts(gpt_plan: Path, tmp_path: Path) -> None:
    """The zoo GPT's C = 2 plan, hand-edited to E = 2: no rank starts, each problem is named."""
    data = json.loads(gpt_plan.read_text())
    data["expert_parallel_degree"] = 2
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    proc, _ = run_cli(["run", "--plan", str(plan), "--model", GPT, "--steps", "1"])
    assert proc.returncode != 0
    assert "expert parallelism (E=2) with context parallelism (C=2)" in proc.stderr
    assert "expert parallelism (E=2): no layer of this model is a mixture-of-experts layer" in proc.stderr
    assert "[rank" not in proc.stderr  # refused by the launcher, not by a rank
