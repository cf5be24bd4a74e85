"""Every schedule runs through torch's schedule runtime and trains exactly as the unsplit model.

End to end, as a user does it: ``pipeplan profile`` -> ``pipeplan plan --schedule X`` ->
``pipeplan run --check`` (2 or 4 CPU ranks, gloo, SGD, tolerance 1e-5), on the zoo GPT
(embedding and LM head tied: on two ranks in the loop placement, on rank 0 in the V) and on a
plain ``nn.Sequential``.  The run executes the plan's action list (``Plan.actions``) and the
report's timeline holds every micro-batch's forward and backward (I + W for a split backward).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.schema import SCHEDULES
from tests.runtime.helpers import run_cli

pytestmark = pytest.mark.slow

GPT = "examples.gpt:tiny"
SEQ = "tests.runtime.seq_model:tiny"
#: chunks per rank each schedule needs
CHUNKS = {"interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for spec in (GPT, SEQ):
        path = tmp_path_factory.mktemp("profiles") / "profile.json"
        proc, _ = run_cli(["profile", "--model", spec, "--microbatch-sizes", "1", "--repeats", "1", "--warmup", "0",
                           "--threads", "1", "-q", "-o", str(path)], timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        out[spec] = path
    return out


#: every schedule on the zoo GPT (tied weights across ranks, or on one rank in the V placement);
#: the plain Sequential, which has no tied weights, for one schedule of each kind at K = 2 (a
#: fill-drain, a split-backward interleaved, a V) and for three at K = 4
CASES = (
    [(GPT, s, 2) for s in SCHEDULES]
    + [(SEQ, s, 2) for s in ("gpipe", "interleaved-zb", "dualpipev")]
    + [(SEQ, s, 4) for s in ("zb-h1", "zbv", "planned")]
)


@pytest.mark.parametrize(("spec", "schedule", "k"), CASES, ids=[f"{s.split(':')[0].split('.')[-1]}-{x}-K{k}" for s, x, k in CASES])
def test_schedule_runs_and_matches_the_unsplit_model(spec: str, schedule: str, k: int, profiles, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    m = 2 * k  # dualpipev's M >= 2K; a multiple of K for the interleaved schedules
    plan_file = tmp_path / "plan.json"
    proc, _ = run_cli(["plan", str(profiles[spec]), "--devices", str(k), "--device-type", "cpu", "--batch-size", str(m),
                       "--optimizer", "sgd", "--schedule", schedule, "--pipeline-degree", str(k), "--microbatches", str(m),
                       "--data-parallel", "1", "--time-limit", "5", "-o", str(plan_file),
                       *(["--virtual-stages", "2"] if schedule.startswith("interleaved") else [])], timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(plan_file.read_text())
    assert plan["schedule"] == schedule and plan["pipeline_degree"] == k and plan["virtual_stages"] == CHUNKS.get(schedule, 1)
    report_file = tmp_path / "report.json"
    proc, _ = run_cli(["run", "--plan", str(plan_file), "--model", spec, "--steps", "2", "--lr", "0.05", "--check",
                       "--report", str(report_file)], timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check PASSED" in proc.stdout
    report = json.loads(report_file.read_text())
    assert report["check"]["passed"] and report["check"]["max_param_rel_diff"] <= 1e-5
    assert report["schedule"] == schedule
    # every stage of the plan ran on its planned rank (V: rank r holds stages r and 2K-1-r)
    ranks = {r["rank"]: sorted(r["stages"]) for r in report["ranks"]}
    v = CHUNKS.get(schedule, 1)
    if schedule in ("zbv", "dualpipev"):
        assert ranks == {r: [r, 2 * k - 1 - r] for r in range(k)}
    else:
        assert ranks == {r: [r + k * c for c in range(v)] for r in range(k)}
    timed = [t for t in report["timeline"] if t["step"] == 1]
    assert sorted(t["stage"] for t in timed) == list(range(k * v))
    assert all(len(t["backward_ms"]) == m and min(t["backward_ms"]) > 0 for t in timed)
