"""``pipeplan run`` on the whole mesh: tensor parallelism, ZeRO 1 and 3 under the pipeline, and
checkpoints that resume under another plan, each end to end (profile -> ``pipeplan plan`` with
the axes forced -> ``pipeplan run --check`` on gloo) against the unsplit model at 1e-5 (SGD).

One profile of ``examples.gpt:tiny`` serves every case (module fixture); each case is one
launch of 2 or 4 ranks for 2 steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.helpers import run_cli

MODEL = "examples.gpt:tiny"
TOL = "1e-5"


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeplan.cli import main

    path = tmp_path_factory.mktemp("mesh-run") / "profile.json"
    code = main(["profile", "--model", MODEL, "--microbatch-sizes", "1,2", "--time-budget", "2", "-q", "-o", str(path)])
    assert code == 0
    return path


def _plan(profile: Path, out: Path, *, devices: int, stages: int, batch: int, extra: list[str]) -> dict[str, Any]:
    """``pipeplan plan`` with the mesh axes forced (in this process: no torch needed)."""
    from pipeplan.cli import main

    code = main([
        "plan", str(profile), "--devices", str(devices), "--devices-per-node", str(devices), "--device-type", "cpu",
        "--interconnect", "loopback", "--batch-size", str(batch), "--microbatches", "2", "--stages", str(stages),
        "--no-recompute", "--no-sequence-parallel", "-o", str(out), *extra,
    ])  # fmt: skip
    assert code == 0
    plan: dict[str, Any] = json.loads(out.read_text())
    return plan


def _run(
    plan: Path, tmp_path: Path, *args: str, model: str = MODEL, lr: str = "0.1", timeout: float = 240
) -> dict[str, Any]:
    report = tmp_path / f"report-{plan.stem}.json"
    proc, _ = run_cli(
        ["run", "--plan", str(plan), "--model", model, "--lr", lr, "--tolerance", TOL, "--report", str(report),
         "--timeout", "90", *args],
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check PASSED" in proc.stdout or "--check" not in args
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def _checked(report: dict[str, Any]) -> None:
    check = report["check"]
    assert check["passed"] and check["params_compared"] == 52
    assert check["max_param_rel_diff"] <= float(TOL) and check["max_loss_rel_diff"] <= float(TOL)


def _mesh_note(report: dict[str, Any]) -> str:
    return next(n for n in report["notes"] if n.startswith("mesh: "))


# (devices, stages, global batch, plan flags, what the run's mesh note must say)
CASES = {
    "T2-K2": (4, 2, 4, ["--tensor-parallel", "2", "--data-parallel", "1", "--zero", "0", "--optimizer", "sgd",
                        "--schedule", "1f1b"], "tensor parallelism T = 2 on 4 layer(s)"),
    "D2-zero1-K2": (4, 2, 8, ["--tensor-parallel", "1", "--data-parallel", "2", "--zero", "1", "--optimizer", "sgd",
                              "--schedule", "1f1b"], "ZeRO 1: optimizer state sharded over the 2 replicas (ZeroRedundancyOptimizer)"),
    # a split-backward schedule: FSDP2 must keep the gathered parameters until the weight gradients
    "D2-zero3-K2-zbh1": (4, 2, 8, ["--tensor-parallel", "1", "--data-parallel", "2", "--zero", "3", "--optimizer",
                                   "sgd", "--schedule", "zb-h1"], "reshard after forward: no"),
    "T2": (2, 1, 4, ["--tensor-parallel", "2", "--data-parallel", "1", "--zero", "0", "--optimizer", "sgd",
                     "--schedule", "1f1b"], "tensor parallelism T = 2 on 4 layer(s)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_mesh_plan_matches_the_unsplit_model(case: str, profile: Path, tmp_path: Path) -> None:
    devices, stages, batch, flags, says = CASES[case]
    path = tmp_path / f"{case}.json"
    plan = _plan(profile, path, devices=devices, stages=stages, batch=batch, extra=flags)
    t = int(flags[flags.index("--tensor-parallel") + 1])
    d = int(flags[flags.index("--data-parallel") + 1])
    zero = int(flags[flags.index("--zero") + 1])
    # the planner kept the forced axes
    assert (plan["pipeline_degree"], plan["data_parallel_degree"]) == (stages, d)
    assert (plan["tensor_parallel_degree"], plan["zero_stage"]) == (t, zero)
    report = _run(path, tmp_path, "--steps", "2", "--check")
    _checked(report)
    assert report["world_size"] == stages * d * t
    from runtime.report import parse_rss_note

    # every rank's resident set: before the model, at the first step, its peak in training
    rss = parse_rss_note(report["notes"])
    assert [r.rank for r in rss] == list(range(stages * d * t))
    assert all(r.peak_in_training and r.peak_bytes >= (r.first_step_bytes or 0) > (r.before_model_bytes or 0) > 0 for r in rss)
    assert says in _mesh_note(report)
    if t > 1:  # the tied embedding and head are priced replicated and run whole; nothing priced
        # as sharded runs whole
        assert "run whole on every tensor-parallel rank: embed, head" in _mesh_note(report)
        assert "priced as" not in _mesh_note(report)
    _collectives_beside_the_plan(report, plan, t=t, d=d, zero=zero, k=stages)
    if d > 1 and zero < 2 and t == 1:  # DDP reduced every gradient (the tied weight too, before its sum over "pp")
        assert "data-parallel gradients: torch DDP over the 2 replicas of each stage" in _mesh_note(report)
        assert {r["allreduce_bytes"] for r in report["ranks"]} == {0}
    if zero == 3:  # FSDP2 averaged the sharded gradients: the flat all-reduce carried the tied weight only
        embed = 256 * 64 * 4
        assert {r["allreduce_bytes"] for r in report["ranks"]} == {embed}


def _collectives_beside_the_plan(report: dict[str, Any], plan: dict[str, Any], *, t: int, d: int, zero: int, k: int) -> None:
    """Each axis the plan has is in the report's collectives (note and field): measured above
    zero, beside the plan's own prediction; the axes it does not have are absent."""
    import re

    note = next(n for n in report["notes"] if n.startswith("collectives per step: "))
    axes = {  # field of report["collectives"]: (the note's label, the plan's Predicted field, present)
        "tensor_parallel": ("tensor-parallel collectives", "tensor_parallel_ms", t > 1),
        # ZeRO 0/1 with T = 1: DDP's buckets (runtime.mesh.gradient_reduction); else the flat all-reduce
        "data_parallel": (
            "data-parallel gradient reduction (DDP" if zero < 2 and t == 1 else "data-parallel flat all-reduce",
            "allreduce_ms",
            d > 1,
        ),
        "fsdp": ("FSDP2 all-gathers and reduce-scatters", "zero_ms", zero >= 2 and d > 1),
        "pipeline_transfers": ("pipeline transfers", "pipeline_transfer_ms", k > 1),
    }
    for axis, (label, field, present) in axes.items():
        got = report["collectives"][axis]
        if not present:
            assert got is None and label not in note, axis
            continue
        assert got["measured_ms"] > 0.0, f"{axis} was not timed: runtime/_comm_timing.py must follow torch"
        assert got["predicted_ms"] == plan["predicted"][field], axis
        if axis != "data_parallel" or (zero < 2 and t == 1):
            assert got["calls"] > 0, axis
        found = re.search(re.escape(label) + r"[^;]*?: measured ([0-9.]+) ms.*?predicted ([0-9.]+) ms", note)
        assert found, (axis, note)
        assert found.groups() == (f"{got['measured_ms']:.2f}", f"{plan['predicted'][field]:.2f}"), axis
    if zero >= 2:  # what FSDP2 did: the collectives per step on the slowest rank, split in the note
        assert "all-gathers" in note and report["collectives"]["fsdp"]["parts_ms"]["all_gather"] > 0.0
    if k > 1:
        assert "waiting on receives" in note and "a receive waits for the peer's compute" in note


def test_the_private_dtensor_api_is_where_the_timing_expects_it() -> None:
    """runtime/_dtensor_timing.py wraps torch.distributed.tensor._redistribute.redistribute_local_tensor
    where three modules call it; when torch moves it this fails, naming what moved."""
    import importlib

    from runtime._dtensor_timing import (
        CALLERS,
        NAME,
        CollectiveClock,
        check_available,
        timed_redistributions,
    )

    check_available()
    before = [getattr(importlib.import_module(m), NAME) for m in CALLERS]
    with timed_redistributions(CollectiveClock()):
        assert all(getattr(importlib.import_module(m), NAME) is not b for m, b in zip(CALLERS, before, strict=True))
    assert [getattr(importlib.import_module(m), NAME) for m in CALLERS] == before  # restored


def test_the_runtime_reads_the_profiles_tensor_parallel_kinds(profile: Path) -> None:
    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.mesh import profiled_kinds

    entry = load_entrypoint(MODEL)
    split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
    layers = json.loads(profile.read_text())["layers"]
    assert profiled_kinds(split) == [layer.get("tensor_parallel", "replicated") for layer in layers]
    assert profiled_kinds(split)[:2] == ["replicated", "block"]  # the embedding is tied to the head


def test_tensor_parallel_on_a_model_without_a_rule_is_refused_before_launch(tmp_path: Path) -> None:
    """A T = 2 plan of a model the runtime has no sharding rule for, and a T = 3 plan of the GPT,
    whose widths 3 does not divide: refused by ``pipeplan run`` before any rank starts, naming
    the layers."""
    from tests.runtime.helpers import make_plan, structure_profile, write_plan

    seq = "tests/runtime/seq_model.py:tiny"
    plan = make_plan(structure_profile(seq), [(0, 8), (8, 16)], microbatches=2)
    path = write_plan(plan.model_copy(update={"tensor_parallel_degree": 2}), tmp_path / "seq.json")
    proc, _ = run_cli(["run", "--plan", str(path), "--model", seq, "--steps", "1"], timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "error: the runtime cannot execute this plan's mesh" in proc.stderr
    assert "no layer of this model has a sharding rule" in proc.stderr and "'0'..'15'" in proc.stderr

    gpt = make_plan(structure_profile(MODEL), [(0, 3), (3, 6)], microbatches=2)
    path = write_plan(gpt.model_copy(update={"tensor_parallel_degree": 3}), tmp_path / "gpt.json")
    proc, _ = run_cli(["run", "--plan", str(path), "--model", MODEL, "--steps", "1"], timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "layer 1 'blocks.0': blocks.0.attn.proj has 64 input features, not divisible by T=3" in proc.stderr


def test_checkpoint_resumes_under_another_plan(profile: Path, tmp_path: Path) -> None:
    """Plan A (K = 2, D = 1) trains steps 0..3 and saves; plan B (K = 1, D = 2, ZeRO 1) resumes at
    step 4 and trains to step 7.  B's --check trains the unsplit model from the same seed for all
    8 steps and compares B's losses (steps 4..7) and final parameters with it at 1e-5, so the
    saved state, its resharding on load and the continuation are all checked.  SGD with momentum:
    the optimizer state travels too (from whole tensors to ZeRO 1 shards).  The model reads an
    iterable of batches (tests/runtime/gpt_stream.py, the tiny GPT's layers): the resumed run
    skips the 4 batches the checkpoint trained on (measured: without the skip, or without the
    momentum state, the parameters differ by 3e-2 and 4e-1)."""
    model, lr = "tests/runtime/gpt_stream.py:tiny", "0.003"  # lr: losses stay well above 0 for 8 steps
    ck = tmp_path / "ck"
    flags = ["--optimizer", "sgd-momentum", "--schedule", "1f1b", "--tensor-parallel", "1"]
    a = _plan(profile, tmp_path / "a.json", devices=2, stages=2, batch=4, extra=[*flags, "--data-parallel", "1"])
    b = _plan(profile, tmp_path / "b.json", devices=2, stages=1, batch=4,
              extra=[*flags, "--data-parallel", "2", "--zero", "1"])  # fmt: skip
    assert (a["pipeline_degree"], a["data_parallel_degree"]) == (2, 1)
    assert (b["pipeline_degree"], b["data_parallel_degree"], b["zero_stage"]) == (1, 2, 1)
    first = _run(tmp_path / "a.json", tmp_path, "--steps", "4", "--checkpoint", str(ck), "--every", "2", model=model, lr=lr)
    assert first["steps"][-1]["loss"] > 1.0
    assert (ck / "latest").read_text().strip() == "step-000004"
    assert (ck / "step-000002" / "pipeplan.json").exists()
    # a save killed midway (shards, no pipeplan.json, not named by latest) is never resumed from
    half = ck / "step-000006"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")

    report = _run(tmp_path / "b.json", tmp_path, "--steps", "8", "--resume", str(ck), "--check", model=model, lr=lr)
    _checked(report)
    assert "iterable" in " ".join(report["notes"])
    assert len(report["steps"]) == 4  # steps 4..7
    assert len(report["check"]["losses_reference"]) == 4
    assert any(n.startswith("check after --resume") for n in report["notes"])


def test_a_checkpoint_of_another_model_is_refused_before_training(tmp_path: Path) -> None:
    from runtime.checkpoint import FORMAT, step_dir
    from tests.runtime.helpers import make_plan, structure_profile, write_plan

    # a complete checkpoint's info file, as a GPT run writes it (the refusal reads no tensor)
    ck = tmp_path / "ck"
    path = step_dir(ck, 2)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    info = {"format": FORMAT, "model": MODEL, "sha256": "e" * 64, "step": 2, "plan": "K=2", "optimizer": "sgd"}
    (path / "pipeplan.json").write_text(json.dumps(info))
    (ck / "latest").write_text(path.name + "\n")
    seq = "tests/runtime/seq_model.py:tiny"
    plan = write_plan(make_plan(structure_profile(seq), [(0, 8), (8, 16)], microbatches=2), tmp_path / "p.json")
    proc, _ = run_cli(["run", "--plan", str(plan), "--model", seq, "--steps", "4", "--resume", str(ck)], timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert f"is of model '{MODEL}'" in proc.stderr and "resume from a checkpoint of this model" in proc.stderr
