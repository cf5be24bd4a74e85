"""What-if sweeps (planner.sweep and ``pipeplan sweep``)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.cli import main
from planner.errors import InputError
from planner.schema import Cluster, PlanOptions, SweepSpec, TrainingSetup, parse_document
from planner.sweep import sweep
from tests.planner.helpers import brute_force_all, random_profile

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), layers=st.integers(3, 8), memory=st.sampled_from(["128MiB", "256MiB", "1GiB"]))
def test_best_throughput_never_falls_as_devices_are_added(seed: int, layers: int, memory: str) -> None:
    profile = random_profile(seed, layers)
    spec = SweepSpec(devices=[1, 2, 3, 4, 6, 8], memories=[memory], time_limit_s=0.3)
    result = sweep(profile, TrainingSetup(global_batch_size=8, optimizer="sgd"), spec)
    tputs = [p.throughput_samples_per_s or 0.0 for p in sorted(result.points, key=lambda p: p.devices)]
    assert all(b >= a * (1 - 1e-9) for a, b in itertools.pairwise(tputs)), tputs
    for p in result.points:
        if p.plan is not None:
            assert p.plan.cluster.num_devices == p.devices
            assert all(s.memory_bytes <= s.memory_limit_bytes for s in p.plan.stages)
            assert p.step_time_ms == p.plan.predicted.step_time_ms


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pareto_front_matches_brute_force(seed: int) -> None:
    """Each point's step time is the brute-force optimum (small instances are exact), and the
    front is the set of points that no point with fewer or as many devices dominates."""
    profile = random_profile(seed, 5)
    training = TrainingSetup(global_batch_size=4, optimizer="sgd")
    spec = SweepSpec(devices=[1, 2, 3, 4], memories=["300MiB", "2GiB"], time_limit_s=2.0)
    result = sweep(profile, training, spec, options=PlanOptions(zero_stage=0))  # the brute force's space
    for kind in {p.device_kind for p in result.points}:
        pts = [p for p in result.points if p.device_kind == kind]
        best = {}
        for p in pts:
            memory = p.device_kind
            cl = Cluster.model_validate({"devices": p.devices, "memory": memory.replace(" ", "")})
            best[p.devices] = brute_force_all(profile, cl, training)
            if best[p.devices] == math.inf:
                assert p.status == "infeasible"
            else:
                assert p.step_time_ms is not None
                assert math.isclose(p.step_time_ms, best[p.devices], rel_tol=1e-9)
        for p in pts:
            dominated = any(
                q is not p and q.devices <= p.devices and best[q.devices] <= best[p.devices]
                and (q.devices < p.devices or best[q.devices] < best[p.devices])
                for q in pts
            )
            assert p.pareto == (best[p.devices] < math.inf and not dominated), (kind, p.devices, best)


def test_fewest_devices_for_a_target_and_infeasible_kinds() -> None:
    profile = random_profile(3, 6)
    training = TrainingSetup(global_batch_size=8, optimizer="sgd")
    one = sweep(profile, training, SweepSpec(devices=[1], memories=["4GiB"], time_limit_s=0.5))
    target = one.points[0].throughput_samples_per_s * 1.5  # type: ignore[operator]
    spec = SweepSpec(devices=[1, 2, 4], memories=["1MiB", "4GiB"], target_samples_per_s=target, time_limit_s=0.5)
    result = sweep(profile, training, spec)
    tiny = [p for p in result.points if p.device_kind == "1.00 MiB"]
    assert all(p.status == "infeasible" and "memory" in p.message for p in tiny)
    assert result.fewest_devices_for_target["1.00 MiB"] is None
    big = sorted((p for p in result.points if p.device_kind == "4.00 GiB"), key=lambda p: p.devices)
    reach = [p.devices for p in big if (p.throughput_samples_per_s or 0) >= target]
    assert result.fewest_devices_for_target["4.00 GiB"] == reach[0]
    assert reach[0] > 1


def test_spec_limits() -> None:
    with pytest.raises(InputError, match="more than 32"):
        parse_document("sweep", {"devices": list(range(1, 20)), "memories": ["1GiB", "2GiB"]})
    with pytest.raises(InputError, match="not both"):
        parse_document("sweep", {"devices": [1], "memories": ["1GiB"], "device_types": ["a100-80g"]})


def test_cli_table_json_and_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = ROOT / "examples" / "profiles" / "tiny.json"
    out, chart = tmp_path / "sweep.json", tmp_path / "sweep.png"
    code = main(["sweep", str(profile), "--devices", "1,2,4", "--memory", "16GiB", "--batch-size", "8",
                 "--time-limit", "0.3", "--target-samples-per-s", "1", "-o", str(out), "--chart", str(chart)])
    text = capsys.readouterr().out
    assert code == 0
    assert "fewest devices of 16.00 GiB reaching 1 samples/s: 1" in text
    data = json.loads(out.read_text())
    assert [p["devices"] for p in data["points"]] == [1, 2, 4]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "8,x"], "cannot read 'x' in --devices"),
        (["--devices", "8", "--memory", "1GiB", "--device-type", "a100-80g"], "not both"),
        (["--devices", "0"], "devices"),
    ],
)
def test_cli_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sweep", *argv])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and message in err, err


def test_options_apply_to_every_point() -> None:
    profile = random_profile(5, 6)
    result = sweep(profile, TrainingSetup(global_batch_size=8), SweepSpec(devices=[2, 4], memories=["8GiB"]),
                   options=PlanOptions(schedule="gpipe"))
    assert {p.plan.schedule for p in result.points if p.plan} == {"gpipe"}
