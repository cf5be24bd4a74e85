"""Hostile and careless files and flags for the command line: a clear ``error:`` line and exit
code 1 within a second (2 for infeasible, after the planner's search), never a traceback or a hang.

The files are the service suite's generated documents (:mod:`hostile_inputs`): profiles,
plans, clusters and training setups with NaN/Infinity, extreme integers, wrong types, deep
nesting and sizes past the limits; and run reports (``pipeplan run --report``) as ``pipeplan
calibrate`` reads them.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from api_testlib import ROOT
from hostile_inputs import document_paths, hostile_document
from hypothesis import HealthCheck, given, settings

from pipeplan.cli import main
from planner.cost import Layout, estimate
from planner.schema import Cluster, Profile, TrainingSetup

TINY = str(ROOT / "examples" / "profiles" / "tiny.json")
#: a refused file or flag is answered within this (reading it included)
REJECT_S = 1.0
#: anything else within this (the solver runs with --time-limit 0.5)
FINISH_S = 60.0


def run_cli(argv: list[str]) -> tuple[int, str, float]:
    """``pipeplan ARGV`` in this process: exit code, stderr, seconds.  An exception escaping
    ``main`` (a traceback for the user) fails the test."""
    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own usage errors
            code = int(exit_.code or 0)
    return code, err.getvalue(), time.perf_counter() - start


def check_clear(argv: list[str]) -> tuple[int, str]:
    code, err, elapsed = run_cli(argv)
    assert "Traceback" not in err, err
    assert code in (0, 1, 2), (code, err)
    if code != 0:
        assert err.startswith(("error: ", "usage: ")), err[:500]
    if code == 1:  # refused input (2 is "infeasible": the planner's answer, after it searched)
        if elapsed >= REJECT_S:
            # one slow answer on a shared machine is noise; a slow rejection is slow twice
            elapsed = min(elapsed, run_cli(argv)[2])
        assert elapsed < REJECT_S, (elapsed, err[:300])
    else:
        assert elapsed < FINISH_S
    return code, err


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
    )


def _tiny() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(TINY).read_text())
    return data


def _plan() -> dict[str, Any]:
    profile = Profile.model_validate(_tiny())
    cluster = Cluster.model_validate({"devices": 2, "memory": "16GiB"})
    plan = estimate(
        profile, cluster, TrainingSetup(global_batch_size=8),
        Layout(
            [(0, 4), (4, 8)],
            num_microbatches=4,
        ),
    )
    data: dict[str, Any] = plan.model_dump(mode="json")
    return data


PROFILE_PATHS = (
    *document_paths(_tiny()),
    ("layers", 1, "forward_ms"),
    ("layers", 2, "backward_ms", 0),
    ("layers", 3, "param_bytes"),
    ("metadata",),
)
PLAN_PATHS = (
    *document_paths(_plan(), limit=60),
    ("num_microbatches",),
    ("stages",),
    ("cluster", "devices"),
    ("predicted", "step_time_ms"),
    ("stages", 0, "forward_ms"),
)


def _report() -> dict[str, Any]:
    """A valid run report of a plan of the synthetic calibration profile."""
    from tests.planner.calib_helpers import Truth, base_profile, make_plan, synthetic_report

    base = base_profile(8)
    plan = make_plan(base, [(0, 4), (4, 8)], microbatches=4)
    report = synthetic_report(plan, base, Truth(forward=(1.5,) * 8, backward=(1.5,) * 8), steps=3)
    data: dict[str, Any] = report.model_dump(mode="json")
    return data


def _calib_profile(tmp_path: Path) -> str:
    from tests.planner.calib_helpers import base_profile

    path = tmp_path / "calib-profile.json"
    path.write_text(base_profile(8).model_dump_json())
    return str(path)


REPORT_PATHS = (
    *document_paths(_report(), limit=60),
    ("steps",),
    ("steps", 1, "measured_ms"),
    ("stages", 0, "forward_ms"),
    ("stages", 1, "start"),
    ("timeline",),
    ("timeline", 0, "forward_ms"),
    ("timeline", 1, "backward_start_ms", 0),
    ("timeline", 0, "stage"),
    ("rank_steps", 0, "allreduce_ms"),
    ("ranks", 0, "allreduce_bytes"),
    ("plan", "num_microbatches"),
    ("plan", "stages"),
    ("plan", "cluster", "devices"),
    ("plan", "profile_sha256"),
    ("schema_version",),
    ("shared_clock",),
)


@pytest.mark.slow
def test_generated_report_files(tmp_path: Path) -> None:
    """Hostile run reports fed to ``pipeplan calibrate``: refused clearly, or calibrated."""
    profile = _calib_profile(tmp_path)
    path = tmp_path / "report.json"
    out = str(tmp_path / "calibrated.json")

    @_settings(60)
    @given(raw=hostile_document(_report(), REPORT_PATHS))
    def check(raw: bytes) -> None:
        path.write_bytes(raw)
        check_clear(["calibrate", profile, str(path), "-o", out])

    check()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.update(steps=r["steps"] * 40_000), "120,000 steps is beyond what a run report holds (at most 100,000)"),
        (lambda r: r["timeline"][0].update(forward_ms=[1.0] * 1_000_000),
         "timeline[0].forward_ms has 1,000,000 entries but the plan has 4 micro-batches"),
        (lambda r: r["plan"].update(num_microbatches=10**9, global_batch_size=2 * 10**9), "micro-batches is beyond"),
        (lambda r: r["plan"]["cluster"].update(devices=10**9), "devices is beyond"),
        (lambda r: r.update(schema_version=3), "schema_version 3 is not supported; this pipeplan reads versions 2"),
        (lambda r: r["timeline"][0].update(stage=7), "timeline[0] names stage 7"),
    ],
    ids=["steps", "timeline-row", "microbatches", "devices", "version", "stage"],
)
def test_report_sizes_are_checked_before_validation(tmp_path: Path, edit: Any, message: str) -> None:
    report = _report()
    edit(report)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    # some of these files are large (120,000 steps: 17 MB): reading them takes most of the time
    code, err, elapsed = run_cli(["calibrate", _calib_profile(tmp_path), str(path), "-o", str(tmp_path / "out.json")])
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert message in err, err
    assert elapsed < 10 * REJECT_S


def test_nan_in_a_report_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(_report()).replace('"forward_ms": [', '"forward_ms": [NaN, ', 1))
    code, err = check_clear(["calibrate", _calib_profile(tmp_path), str(path), "-o", str(tmp_path / "out.json")])
    assert code == 1
    assert err.startswith(f"error: report file '{path}' holds NaN at timeline[0].forward_ms[0]"), err


@pytest.mark.slow
def test_generated_profile_files(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"

    @_settings(60)
    @given(raw=hostile_document(_tiny(), PROFILE_PATHS))
    def check(raw: bytes) -> None:
        path.write_bytes(raw)
        check_clear(["plan", str(path), "--devices", "4", "--memory", "16GiB", "--batch-size", "8", "--time-limit", "0.5"])
        check_clear(["estimate", str(path), "--stages", "0:4,4:8", "--microbatches", "4", "--devices", "2", "--memory", "16GiB"])

    check()


@pytest.mark.slow
def test_generated_plan_files(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"

    @_settings(80)
    @given(raw=hostile_document(_plan(), PLAN_PATHS))
    def check(raw: bytes) -> None:
        path.write_bytes(raw)
        check_clear(["show", str(path)])
        check_clear(["show", str(path), "--profile", TINY])

    check()


def test_generated_cluster_and_training_files(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.json"
    training = tmp_path / "training.json"
    base_cluster = {"devices": 4, "memory": "16GiB", "devices_per_node": 2, "intra_node": "nvlink4"}
    base_training = {"global_batch_size": 8, "optimizer": "adam", "memory_margin": 0.1}

    @_settings(40)
    @given(
        raw_cluster=hostile_document(base_cluster, document_paths(base_cluster)),
        raw_training=hostile_document(base_training, document_paths(base_training)),
    )
    def check(raw_cluster: bytes, raw_training: bytes) -> None:
        cluster.write_bytes(raw_cluster)
        training.write_bytes(raw_training)
        check_clear(["plan", TINY, "--cluster", str(cluster), "--batch-size", "8", "--time-limit", "0.5"])
        check_clear(["plan", TINY, "--devices", "2", "--memory", "16GiB", "--training", str(training), "--time-limit", "0.5"])

    check()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", TINY, "--devices", "20000000", "--memory", "1GiB"],
         "error: --devices 20000000: 20,000,000 devices is beyond what pipeplan plans (at most 16,384); did you mean 2,000?"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--batch-size", str(10**18)], "samples per step is beyond"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--microbatches", str(10**9)], "micro-batches per step is beyond"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--time-limit", "1e9"], "--time-limit 1e+09"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--time-limit", "nan"], "--time-limit nan: give a finite number"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--stages", "100000"], "100,000 stages is beyond"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--stages", "²"], "cannot read --stages"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--data-parallel", str(10**9)], "data-parallel replicas"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--virtual-stages", str(10**9)], "virtual stages"),
        (["plan", TINY, "--devices", "4", "--memory", "1GiB", "--devices-per-node", str(10**9)], "devices per node"),
        (["plan", TINY, "--devices", "4", "--memory", "1e400GiB"], "too large"),
        (["plan", TINY, "--devices", "4", "--memory", "2PiB"], "cannot read"),
        (["plan", TINY, "--devices", "4", "--memory", str(2**63)], "less than or equal to 4611686018427387904"),
        (["plan", TINY, "--memories", ",".join(["1GiB"] * 20_000)], "--memories 20000: 20,000 devices is beyond"),
        (["estimate", TINY, "--stages", "0:8", "--microbatches", str(10**9), "--devices", "1", "--memory", "1GiB"],
         "micro-batches per step is beyond"),
        (["estimate", TINY, "--stages", ",".join(f"{i}:{i + 1}" for i in range(70_000)), "--microbatches", "4",
          "--devices", "1", "--memory", "1GiB"], "stage ranges is beyond"),
        (["plan", "/dev/null", "--devices", "2", "--memory", "1GiB"], "is not valid JSON"),
        (["plan", "/", "--devices", "2", "--memory", "1GiB"], "is a directory"),
    ],
    ids=lambda x: x[:60] if isinstance(x, str) else None,
)
def test_absurd_flags_are_answered_at_once(argv: list[str], message: str) -> None:
    code, err = check_clear(argv)
    assert code == 1, err
    assert message in err, err


@pytest.mark.parametrize(("flags", "message"), [(["--width", str(10**9)], "--width"), (["--slot-ms", "1e-12"], "columns")])
def test_show_refuses_a_grid_too_wide(tmp_path: Path, flags: list[str], message: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan()))
    code, err = check_clear(["show", str(path), *flags])
    assert code == 1 and message in err, err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p.update(num_microbatches=10**9, global_batch_size=8 * 10**9), "micro-batches is beyond"),
        (lambda p: p["cluster"].update(devices=10**9), "devices is beyond"),
        (lambda p: p.update(pipeline_degree=10**9), "pipeline stages is beyond"),
    ],
    ids=["microbatches", "devices", "pipeline-degree"],
)
def test_plan_file_sizes_are_checked_before_validation(tmp_path: Path, edit: Any, message: str) -> None:
    plan = _plan()
    edit(plan)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    code, err = check_clear(["show", str(path)])
    assert code == 1 and message in err, err


def test_nan_in_a_profile_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "nan.json"
    path.write_text(Path(TINY).read_text().replace('"backward_ms": [', '"backward_ms": [NaN, ', 1))
    code, err = check_clear(["plan", str(path), "--devices", "2", "--memory", "16GiB"])
    assert code == 1
    assert err.startswith(f"error: profile file '{path}' holds NaN at layers[0].backward_ms[0]"), err


def _cap_memory() -> None:  # (in the child, before exec)
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_CAP, CHILD_MEMORY_CAP))


#: address space a CLI child may map (the typo below runs in about 45 MB; it once grew to 10.5 GB)
CHILD_MEMORY_CAP = 2 * 1024**3


def test_devices_typo_in_a_real_process_is_answered_at_once() -> None:
    """Was: ``plan tiny.json --devices 20000000 --memory 1GiB`` grew to 10.5 GB and ran for minutes.

    The child runs under an address-space cap, so a growth like that ends in a MemoryError (a
    traceback, not the message) instead of swapping.  Its peak resident size cannot be read back:
    ``ru_maxrss`` keeps the forked copy of this (large) test process from before the exec."""
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "pipeplan", "plan", TINY, "--devices", "20000000", "--memory", "1GiB"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, preexec_fn=_cap_memory,
    )
    elapsed = time.perf_counter() - start
    assert out.returncode == 1
    assert out.stderr.startswith("error: --devices 20000000: 20,000,000 devices is beyond what pipeplan plans"), out.stderr
    assert "Traceback" not in out.stderr
    assert elapsed < 15.0
