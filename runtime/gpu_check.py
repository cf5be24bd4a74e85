"""GPU check of the executor (the runtime half of ``scripts/gpu_check.sh``).

What it covers, on whatever CUDA devices are visible:

* profile ``examples.gpt:tiny`` on ``cuda:0`` (float32) and make plans from that profile;
* with one GPU: a K = 1, D = 1 plan run by ``pipeplan run --backend nccl --check`` (NCCL
  process group, the stage on CUDA, ``max_memory_allocated`` against the predicted peak,
  pipelined vs unsplit on the same GPU); a single GPU cannot host two NCCL ranks, so the
  K = 2 pipeline on one GPU is NOT covered here (the CPU/gloo tests cover K = 2);
* with two or more GPUs: additionally a K = 2 1F1B plan over NCCL, one GPU per rank.

Exit 0 when every run passed, 1 otherwise, 0 with a message when there is no CUDA.

    python -m runtime.gpu_check [--report-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "examples.gpt:tiny"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="executor GPU check (NCCL)")
    parser.add_argument("--report-dir", help="keep the run reports here")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("runtime gpu check: no CUDA device visible, nothing to check")
        return 0
    from planner.cost import Layout, estimate
    from planner.schema import parse_document
    from profiler import profile
    from profiler.loading import load_entrypoint

    gpus = torch.cuda.device_count()
    entry = load_entrypoint(MODEL)
    prof = profile(entry.model, entry.example_inputs, microbatch_sizes=(1, 2, 4), device="cuda", progress=False, name=MODEL)
    n = prof.num_layers
    training = parse_document("training", {"global_batch_size": 16, "optimizer": "sgd"})
    plans = {
        "K1-nccl": estimate(
            prof, parse_document("cluster", {"devices": 1, "memory": "16GiB"}), training,
            Layout(
                [(0, n)],
                num_microbatches=4,
                schedule="gpipe",
            ),
        )
    }
    if gpus >= 2:
        cluster = parse_document("cluster", {"devices": 2, "memory": "16GiB"})
        plans["K2-1f1b-nccl"] = estimate(
            prof, cluster, training,
            Layout(
                [(0, n // 2), (n // 2, n)],
                num_microbatches=4,
                schedule="1f1b",
            ),
        )
    out_dir = Path(args.report_dir or tempfile.mkdtemp(prefix="pipeplan-gpu-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    failures = 0
    for name, plan in plans.items():
        plan_file = out_dir / f"{name}.plan.json"
        report_file = out_dir / f"{name}.report.json"
        plan_file.write_text(plan.model_dump_json(indent=2))
        cmd = [sys.executable, "-m", "pipeplan", "run", "--plan", str(plan_file), "--model", MODEL, "--steps", "4",
               "--lr", "0.05", "--backend", "nccl", "--check", "--report", str(report_file), "--timeout", "120"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=540)
        print(proc.stdout)
        ok = proc.returncode == 0 and report_file.exists()
        if ok:
            report = json.loads(report_file.read_text())
            ok = (
                report["backend"] == "nccl"
                and report["device"] == "cuda"
                and all(s["peak_memory_bytes"] for s in report["stages"])
                and report["check"]["passed"]
            )
        if not ok:
            failures += 1
            print(f"runtime gpu check {name}: FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}")
        else:
            print(f"runtime gpu check {name}: passed")
    if gpus < 2:
        print("note: one GPU: the K = 2 pipeline over NCCL was not run (needs one GPU per rank)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
