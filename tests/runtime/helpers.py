"""Plans for the example models, made with the real splitter and cost model (no measuring)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from planner.cost import Layout, estimate
from planner.schema import LayerProfile, MeasuredOn, Plan, Profile, parse_document

ROOT = Path(__file__).resolve().parents[2]


def structure_profile(spec: str, split_points: Sequence[str] = ()) -> Profile:
    """A profile with the model's real layer names and parameter bytes and made-up times."""
    from profiler.loading import load_entrypoint
    from profiler.split import split_model

    entry = load_entrypoint(spec)
    split = split_model(entry.model, entry.example_inputs, split_points=list(split_points) or None, keywords=entry.keywords)
    layers = [
        LayerProfile(
            name=n,
            param_bytes=b,
            forward_ms=[1.0],
            backward_ms=[2.0],
            activation_bytes=[4096],
            output_bytes=[4096],
        )
        for n, b in zip(split.names, split.param_bytes(), strict=True)
    ]
    return Profile(
        model=spec, measured_on=MeasuredOn(device="cpu"), microbatch_sizes=[1], layers=layers, split_points=list(split_points)
    )


def make_plan(
    profile: Profile,
    stages: Sequence[tuple[int, int]],
    *,
    schedule: str = "1f1b",
    microbatches: int = 4,
    data_parallel: int = 1,
    recompute: bool = False,
    optimizer: str = "sgd",
    microbatch_size: int = 2,
    pipeline_degree: int | None = None,
    dtype: str | None = None,
    devices: int = 2,
) -> Plan:
    cluster = parse_document("cluster", {"devices": devices, "device_type": "cpu", "intra_node": "loopback"})
    training = parse_document(
        "training",
        {"global_batch_size": microbatch_size * microbatches * data_parallel, "optimizer": optimizer, "dtype": dtype},
    )
    return estimate(
        profile, cluster, training,
        Layout(
            list(stages),
            num_microbatches=microbatches,
            schedule=schedule,
            recompute=recompute,
            data_parallel=data_parallel,
            pipeline_degree=pipeline_degree,
        ),
    )


def fake_profile_file(spec: str, path: Path, *, microbatch_sizes: Sequence[int] = (1, 2, 4, 8)) -> Path:
    """``pipeplan profile --model SPEC --fake --dtype float32 --device-type cpu -o PATH``, in this
    process (the fake-tensor profile marks mixture-of-experts layers and attention operations)."""
    from profiler.fake import fake_profile
    from profiler.loading import load_entrypoint

    prof = fake_profile(lambda: load_entrypoint(spec), device_type="cpu", microbatch_sizes=microbatch_sizes,
                        dtype="float32", name=spec)  # fmt: skip
    path.write_text(prof.model_dump_json(), encoding="utf-8")
    return path


def plan_t2(profile: Path, path: Path) -> Path:
    """``pipeplan plan`` of ``profile`` on 2 CPU devices of one node at T = 2 (one stage, 2
    micro-batches of a batch of 4, no recompute, no sequence parallelism, ZeRO 0, the default
    optimizer), written to ``path``: the plan the T = 2 run tests of real models train."""
    from pipeplan.cli import main

    assert main([
        "plan", str(profile), "--devices", "2", "--devices-per-node", "2", "--device-type", "cpu",
        "--interconnect", "loopback", "--batch-size", "4", "--microbatches", "2", "--stages", "1",
        "--no-recompute", "--no-sequence-parallel", "--tensor-parallel", "2", "--data-parallel", "1",
        "--zero", "0", "-o", str(path),
    ]) == 0  # fmt: skip
    return path


def write_plan(plan: Plan, path: Path) -> Path:
    path.write_text(plan.model_dump_json(indent=2), encoding="utf-8")
    return path


def run_cli(args: Sequence[str], *, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m pipeplan ARGS`` from the repository root, one intra-op thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeplan", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def processes_mentioning(marker: str) -> list[str]:
    """Command lines of live (non-zombie) processes whose arguments contain ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(f"{entry.name}: {cmd}")
    return found


def run_torchrun(nproc: int, worker_args: Sequence[str], *, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    """``torchrun --standalone --nproc-per-node N -m runtime.worker ARGS`` from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "runtime.worker", *worker_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip
    return proc, time.monotonic() - t0
