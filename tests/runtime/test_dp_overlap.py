"""The data-parallel gradient reduction of ``pipeplan run``: torch DDP, bucketed and overlapped
with each stage's last backward, where :func:`runtime.mesh.gradient_reduction` allows it; the
runtime's flat all-reduce after the schedule elsewhere, named in the report with its reason.

End to end on 2 (or 4) gloo ranks: ``examples.gpt:tiny`` with D = 2 passes ``--check`` with SGD
and Adam, and the report's bucket note shows the buckets of the later layers launched before
the first layer's gradients were ready (the reduction ran during the backward).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from planner.schema import Profile
from runtime.mesh import MeshSpec, gradient_reduction
from tests.runtime.helpers import make_plan, run_cli, structure_profile, write_plan

GPT = "examples.gpt:tiny"  # embed, blocks.0-3, head (tied to embed); 874 kB of parameters
TIED = "tests.runtime.tied_model:tiny"  # 6 linear layers: 2 uses 0's weight, 4 uses 1's


# ---- which path, without launching


@pytest.mark.parametrize(
    ("spec", "path", "why"),
    [
        (MeshSpec(data_parallel_degree=1), "none", ""),
        (MeshSpec(data_parallel_degree=2), "ddp", ""),
        (MeshSpec(pipeline_degree=2, data_parallel_degree=2, zero_stage=1, schedule="interleaved-1f1b"), "ddp", ""),
        (MeshSpec(data_parallel_degree=2, zero_stage=3), "fsdp2", "FSDP2"),
        (MeshSpec(data_parallel_degree=2, tensor_parallel_degree=2), "all-reduce", "DTensor"),
        (MeshSpec(pipeline_degree=2, data_parallel_degree=2, schedule="zb-h1"), "all-reduce", "zb-h1 splits the backward"),
        (MeshSpec(pipeline_degree=2, data_parallel_degree=2, schedule="planned"), "all-reduce", "torch.autograd.grad"),
    ],
)
def test_the_path_of_each_combination(spec: MeshSpec, path: str, why: str) -> None:
    got = gradient_reduction(spec)
    assert got.path == path
    assert why in got.why and (got.why == "") == (path in ("none", "ddp"))


def test_exposed_and_hidden_time_of_a_step() -> None:
    """Busy: the union of the buckets' flights; exposed: after the last launch (the backward's
    last gradient) until the last completion."""
    from runtime._ddp import BucketEvent, step_reduction

    events = [
        BucketEvent(0, ("blocks.3",), 100, launched=1.000, done=1.004),
        BucketEvent(1, ("blocks.1",), 100, launched=1.003, done=1.006),  # overlaps bucket 0
        BucketEvent(2, ("embed",), 100, launched=1.010, done=1.013),
    ]
    red = step_reduction(events)
    assert red.buckets == 3
    assert red.busy_ms == pytest.approx(9.0)  # 1.000..1.006 and 1.010..1.013
    assert red.exposed_ms == pytest.approx(3.0) and red.hidden_ms == pytest.approx(6.0)
    assert step_reduction([]).busy_ms == 0.0
    # a reduction done before the last gradient is ready is all hidden
    late = [BucketEvent(0, ("a",), 1, launched=1.0, done=1.002), BucketEvent(1, ("b",), 1, launched=1.005, done=1.005)]
    assert step_reduction(late).exposed_ms == 0.0


def test_the_private_ddp_api_is_there_and_named_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from runtime import _ddp

    _ddp.check_private_api()
    monkeypatch.delattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model")
    with pytest.raises(RuntimeError, match="_set_params_and_buffers_to_ignore_for_model"):
        _ddp.check_private_api()


def test_the_collectives_note_sets_the_exposed_reduction_beside_the_plans() -> None:
    from runtime.report import collective_times, collectives_note

    base = make_plan(structure_profile(GPT), [(0, 6)], microbatches=2, data_parallel=2)
    plan = base.model_copy(update={
        "predicted": base.predicted.model_copy(update={"allreduce_ms": 4.0}),
        "training": base.training.model_copy(update={"gradient_overlap": 0.75}),
    })  # fmt: skip

    def step(exposed: float, hidden: float) -> dict[str, float]:
        return {"data_parallel_ms": exposed + hidden, "data_parallel_exposed_ms": exposed,
                "data_parallel_hidden_ms": hidden, "data_parallel_buckets": 4}  # fmt: skip

    times = collective_times(plan, [[step(9, 9), step(1, 3), step(1, 3)], [step(9, 9), step(2, 1), step(2, 1)]])
    assert times is not None and times.data_parallel is not None
    assert times.data_parallel.measured_ms == 4.0 and times.data_parallel.calls == 4
    assert times.data_parallel.parts_ms == {"exposed": 1.0, "hidden": 3.0}
    note = collectives_note(plan, times)
    assert "data-parallel gradient reduction (DDP, 4 bucket(s) during the last backwards): measured 4.00 ms, " in note
    assert "exposed 1.00 ms after the backward's last gradient, hidden 3.00 ms behind the backward" in note
    assert "predicted 4.00 ms, exposed 1.00 ms (the plan's gradient_overlap 0.75)" in note
    assert "flat all-reduce" not in note


# ---- end to end


@pytest.fixture(scope="module")
def profile() -> Profile:
    return structure_profile(GPT)


def _run(plan: Any, tmp_path: Path, *args: str, model: str = GPT, tensors: int = 52) -> dict[str, Any]:
    plan_file = write_plan(plan, tmp_path / "plan.json")
    report = tmp_path / "report.json"
    proc, _ = run_cli(
        ["run", "--plan", str(plan_file), "--model", model, "--steps", "3", "--check", "--tolerance", "1e-5",
         "--report", str(report), "--timeout", "90", *args],
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check PASSED" in proc.stdout
    data: dict[str, Any] = json.loads(report.read_text())
    assert data["check"]["passed"] and data["check"]["params_compared"] == tensors
    return data


def _note(report: dict[str, Any], start: str) -> str:
    return next(n for n in report["notes"] if n.startswith(start))


def _buckets(report: dict[str, Any], rank: int) -> tuple[list[tuple[int, list[str], float, float]], float]:
    """Rank ``rank``'s buckets of the last step from the report's bucket note: ``(index, layers,
    launched ms, done ms)`` in launch order, and when its last backward ended."""
    note = _note(report, "data-parallel buckets of the last step")
    part = next(p for p in note.split(": ", 1)[1].split(" | ") if p.startswith(f"rank {rank}: "))
    rows = [
        (int(i), layers.split(", "), float(a), float(b))
        for i, layers, a, b in re.findall(r"#(\d+) \[([^\]]*)\] \d+ B launched ([0-9.]+) done ([0-9.]+)", part)
    ]
    found = re.search(r"backward ended ([0-9.]+)", part)
    assert rows and found, part
    return rows, float(found.group(1))


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", "0.1"), ("adam", "0.001")])
def test_d2_reduces_in_buckets_during_the_backward(profile: Profile, tmp_path: Path, optimizer: str, lr: str) -> None:
    plan = make_plan(profile, [(0, 6)], schedule="1f1b", microbatches=2, data_parallel=2, optimizer=optimizer)
    report = _run(plan, tmp_path, "--lr", lr, "--dp-bucket-mb", "0.2")
    mesh = _note(report, "mesh: ")
    assert "data-parallel gradients: torch DDP over the 2 replicas of each stage (52 tensor(s)), bucketed (0.2 MiB" in mesh
    assert "flat all-reduce" not in mesh
    for rank in (0, 1):
        rows, backward_end = _buckets(report, rank)
        assert len(rows) >= 3, rows  # 874 kB in 0.2 MiB buckets
        embed = next(r for r in rows if "embed" in r[1])  # the first layer's gradients (the tied weight too)
        later = rows[0]
        # the later layers' bucket left while the backward still had the first layer to do
        assert "embed" not in later[1] and "blocks.3" in later[1], rows
        assert later[2] < embed[2] <= backward_end, rows
        assert embed is rows[-1]
    dp = report["collectives"]["data_parallel"]
    assert dp["calls"] >= 3 and dp["measured_ms"] > 0
    assert set(dp["parts_ms"]) == {"exposed", "hidden"}
    assert dp["measured_ms"] == pytest.approx(dp["parts_ms"]["exposed"] + dp["parts_ms"]["hidden"], rel=0.5)
    # DDP reduced everything: the flat all-reduce after the schedule carried nothing
    assert {r["allreduce_bytes"] for r in report["ranks"]} == {0}
    assert "data-parallel gradient reduction (DDP, " in _note(report, "collectives per step: ")


@pytest.mark.slow
def test_a_split_backward_schedule_keeps_the_flat_all_reduce_and_says_why(profile: Profile, tmp_path: Path) -> None:
    plan = make_plan(profile, [(0, 3), (3, 6)], schedule="zb-h1", microbatches=2, data_parallel=2, devices=4)
    report = _run(plan, tmp_path, "--lr", "0.1")
    mesh = _note(report, "mesh: ")
    assert "data-parallel gradients: the runtime's flat all-reduce after the schedule (schedule zb-h1 splits" in mesh
    assert not any(n.startswith("data-parallel buckets") for n in report["notes"])
    assert "data-parallel flat all-reduce: measured" in _note(report, "collectives per step: ")
    assert all(r["allreduce_bytes"] > 0 for r in report["ranks"])


@pytest.mark.slow
def test_a_weight_two_stages_of_a_rank_share_is_left_to_the_flat_all_reduce(tmp_path: Path) -> None:
    """Interleaved, K = 2 x D = 2: rank 0 runs stages 0, 2, 4, and layers 0 and 2 share a weight
    (one tensor in two DDP modules would be averaged twice): it stays with the flat all-reduce;
    layers 1 and 4 share one across the pipeline ranks: DDP averages it, then the tied sum."""
    plan = make_plan(structure_profile(TIED), [(i, i + 1) for i in range(6)], schedule="interleaved-1f1b",
                     optimizer="sgd-momentum", pipeline_degree=2, data_parallel=2, devices=4)  # fmt: skip
    report = _run(plan, tmp_path, "--lr", "0.05", "--dp-bucket-mb", "0.001", model=TIED, tensors=10)
    mesh = _note(report, "mesh: ")
    # rank 0: its biases and layer 1's weight (4); rank 1: layers 1, 3, 5 (6); not layer 0's weight
    assert "data-parallel gradients: torch DDP over the 2 replicas of each stage (10 tensor(s))" in mesh
    assert "left to the runtime's reductions after the schedule: 1 tensor(s) held by two stages of one rank (flat" in mesh
    assert sorted(r["allreduce_bytes"] for r in report["ranks"]) == [0, 0, 16 * 16 * 4, 16 * 16 * 4]


@pytest.mark.slow
def test_a_weight_left_without_a_gradient_stops_the_run_naming_the_layer(profile: Profile, tmp_path: Path) -> None:
    """DDP would never reduce its bucket (and fail the next step obscurely): a layer skipped from
    step 1 on (--inject-fault) stops the job naming it and the way out."""
    plan = make_plan(profile, [(0, 6)], schedule="1f1b", microbatches=2, data_parallel=2)
    plan_file = write_plan(plan, tmp_path / "plan.json")
    proc, _ = run_cli(["run", "--plan", str(plan_file), "--model", GPT, "--steps", "3", "--timeout", "60",
                       "--inject-fault", "0:1:skip-layer"], timeout=240)  # fmt: skip
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "a weight of layer(s) blocks.0 got no gradient in step 1's backward" in out, out[-3000:]
    assert "--dp-reduction flat" in out
