"""Expert parallelism (E) in the runtime (runtime/experts.py): the zoo's mixture-of-experts
models (Mixtral; Qwen2-MoE with a shared expert) train under ``pipeplan run --check`` with their
experts sharded over E = 2 data-parallel ranks exactly like the unsplit model, a wrong routing
fails the check, and what the runtime does not execute is refused before training.

The plans are made as a user makes them: the fake-tensor profile (``pipeplan profile --fake``, in
this process: it marks the MoE layers) then ``pipeplan plan --data-parallel 2 --expert-parallel 2``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from planner.errors import InputError
from tests.runtime.helpers import ROOT, fake_profile_file, run_cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

MIXTRAL, QWEN_MOE = "examples.hf:mixtral", "examples.hf:qwen2_moe"


def _split(spec: str):  # type: ignore[no-untyped-def]
    from profiler.loading import load_entrypoint
    from profiler.split import split_model

    entry = load_entrypoint(spec)
    return split_model(entry.model, entry.example_inputs, keywords=entry.keywords)


def _plan_fields(**kw: int) -> SimpleNamespace:
    fields = {"expert_parallel_degree": 2, "context_parallel_degree": 1, "tensor_parallel_degree": 1,
              "data_parallel_degree": 2, "zero_stage": 0, "pipeline_degree": 1}  # fmt: skip
    return SimpleNamespace(**{**fields, **kw})


@pytest.fixture(scope="module")
def qwen_split():  # type: ignore[no-untyped-def]
    return _split(QWEN_MOE)


def test_each_moe_block_is_one_site_with_its_expert_weights(qwen_split) -> None:  # type: ignore[no-untyped-def]
    from runtime.experts import find_sites

    blocks = [i for i, n in enumerate(qwen_split.names) if n.startswith("model.layers.")]
    assert len(blocks) == 4
    for i, unit in enumerate(qwen_split.units):
        sites = find_sites(unit)
        assert not isinstance(sites, str)
        if i not in blocks:
            assert sites == []
            continue
        (site,) = sites
        layer = qwen_split.names[i]
        assert site.experts == 4 and len(site.products) == 2
        # the routed experts only: the shared expert and its gate stay dense
        assert sorted(site.weights) == [f"{layer}.mlp.experts.down_proj", f"{layer}.mlp.experts.gate_up_proj"]


def test_what_the_runtime_does_not_execute_is_refused_naming_axis_and_layer(qwen_split) -> None:  # type: ignore[no-untyped-def]
    from runtime.experts import expert_problems

    units, names = list(qwen_split.units), list(qwen_split.names)
    assert expert_problems(units, names, _plan_fields()) == []
    assert expert_problems(units, names, _plan_fields(expert_parallel_degree=1, tensor_parallel_degree=2)) == []
    (odd,) = {p for p in expert_problems(units, names, _plan_fields(expert_parallel_degree=3, data_parallel_degree=3))
              if "model.layers.0" in p}  # fmt: skip
    assert "4 experts are not divisible by E=3" in odd
    problems = expert_problems(units, names, _plan_fields(tensor_parallel_degree=2, zero_stage=1))
    assert any("tensor parallelism (T=2) on layer 2 'model.layers.0'" in p and "--tensor-parallel 1" in p
               for p in problems)  # fmt: skip
    assert any("ZeRO 1" in p and "--zero 0" in p for p in problems)
    dense = _split("examples.gpt:tiny")
    (none,) = expert_problems(list(dense.units), list(dense.names), _plan_fields())
    assert "expert parallelism (E=2)" in none and "no layer of this model" in none and "--expert-parallel 1" in none


@pytest.fixture(scope="module")
def ep_plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each MoE model's E = 2 plan, made once for the module."""
    return {spec: _ep_plan(spec, tmp_path_factory.mktemp(spec.split(":")[1])) for spec in (MIXTRAL, QWEN_MOE)}


def _ep_plan(spec: str, tmp_path: Path) -> Path:
    prof, plan = fake_profile_file(spec, tmp_path / "profile.json"), tmp_path / "plan.json"
    proc, _ = run_cli(["plan", str(prof), "--devices", "2", "--device-type", "cpu", "--batch-size", "8",
                       "--data-parallel", "2", "--expert-parallel", "2", "--zero", "0", "--optimizer", "sgd",
                       "-o", str(plan)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    fields = json.loads(plan.read_text())
    assert (fields["expert_parallel_degree"], fields["data_parallel_degree"]) == (2, 2)
    return plan


def _run(spec: str, plan: Path, *extra: str) -> tuple[int, str]:
    proc, _ = run_cli(["run", "--plan", str(plan), "--model", spec, "--steps", "2", "--lr", "0.05", "--check",
                       *extra], timeout=240)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("spec", [MIXTRAL, QWEN_MOE])
def test_zoo_moe_trains_with_experts_sharded_like_the_unsplit_model(spec: str, ep_plans: dict[str, Path]) -> None:
    code, out = _run(spec, ep_plans[spec])
    assert code == 0, out
    assert "check PASSED" in out
    assert "expert parallelism E=2: 4 layers, 2 of 4 experts per rank" in out


@pytest.mark.slow
def test_tokens_sent_to_the_wrong_expert_rank_fail_the_check(ep_plans: dict[str, Path]) -> None:
    code, out = _run(QWEN_MOE, ep_plans[QWEN_MOE], "--inject-fault", "1:1:wrong-expert", "--steps", "2")
    assert code != 0 and "check FAILED" in out, out
    assert "mlp" in out.split("check FAILED", 1)[1].splitlines()[0]  # the experts' layers differ


def test_refused_before_any_rank_starts() -> None:
    """E on a model without MoE layers: the dense GPT's plan with E = 2 (hand-edited)."""
    from runtime.axes import refuse_new_axes

    dense = _split("examples.gpt:tiny")
    with pytest.raises(InputError, match=r"expert parallelism \(E=2\): no layer of this model"):
        refuse_new_axes(dense, _plan_fields())


def test_dispatch_and_combine_equal_the_local_product_even_without_tokens() -> None:
    """2 gloo ranks, 4 experts: balanced, all on one expert, none on a rank's experts, none at all."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "tests/runtime/ep_dispatch_job.py")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})  # fmt: skip
    verdicts = re.findall(r"rank \d \[[\d, ]+\]: (ok|WRONG)", proc.stdout)  # the two ranks' lines may interleave
    assert proc.returncode == 0 and len(verdicts) == 10, proc.stdout + proc.stderr
    assert set(verdicts) == {"ok"}, proc.stdout
