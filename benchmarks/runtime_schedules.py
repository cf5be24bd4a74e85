"""Runtime benchmark of the zero-bubble schedules: measured step times on 2 gloo ranks.

A model whose two stages each take >= 20 ms a forward (eight 1024-wide Linear + Tanh blocks,
micro-batch 48, one intra-op thread per rank) is profiled here, then run by ``pipeplan run``
on the same even split and the same M with ``1f1b``, ``zb-h1`` and ``planned`` (M = 2 and 4 by
default).  Per run: the predicted step (the plan's, from the profile's measured I and W) and the
measured one (median over the steps after the warm-up step, slowest rank); then per schedule
measured speed-up over 1f1b against the predicted speed-up, and measured ÷ predicted.

Expectation (issue 15): the measured speed-up within 10 % of the predicted one.

    OMP_NUM_THREADS=1 python benchmarks/runtime_schedules.py [--steps 6] [--microbatches 2,4]
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
sys.path.insert(0, str(ROOT))

WIDTH, BLOCKS, MICROBATCH = 1024, 8, 48
SCHEDULES = ("1f1b", "zb-h1", "planned")


def model():  # type: ignore[no-untyped-def]
    """The benchmark model (``pipeplan run --model benchmarks/runtime_schedules.py:model``)."""
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(BLOCKS):
            layers.append(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()))
        return nn.Sequential(*layers), (torch.randn(MICROBATCH, WIDTH),)


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pipeplan", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"pipeplan {' '.join(args[:2])} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first is warm-up")
    parser.add_argument("--microbatches", default="2,4", help="the values of M to run")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                        help="profile clock (default cpu: thread CPU time, steady on a busy machine)")  # fmt: skip
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args()

    from planner.cost import Layout, estimate
    from planner.schema import load_document, parse_document

    spec = f"{Path(__file__).resolve()}:model"
    work = Path(tempfile.mkdtemp(prefix="pipeplan-zb-bench-"))
    prof_file = work / "profile.json"
    _cli("profile", "--model", spec, "--microbatch-sizes", str(MICROBATCH), "--threads", "1", "--clock", args.clock, "--repeats", "7",
         "-q", "-o", str(prof_file))  # fmt: skip
    profile = load_document("profile", prof_file)
    n = len(profile.layers)
    stages = [(0, n // 2), (n // 2, n)]
    fwd = [sum(la.forward_ms[0] for la in profile.layers[a:b]) for a, b in stages]
    print(f"model: {BLOCKS} x Linear({WIDTH}) + Tanh, micro-batch {MICROBATCH}; stages {stages}, "
          f"forward {fwd[0]:.1f} / {fwd[1]:.1f} ms per micro-batch (profiled)")  # fmt: skip
    cluster = parse_document("cluster", {"devices": 2, "device_type": "cpu", "intra_node": "loopback"})
    rows = []
    for m in (int(x) for x in args.microbatches.split(",")):
        training = parse_document("training", {"global_batch_size": MICROBATCH * m, "optimizer": "sgd"})
        for schedule in SCHEDULES:
            plan = estimate(
                profile, cluster, training,
                Layout(
                    stages,
                    num_microbatches=m,
                    schedule=schedule,
                ),
            )  # type: ignore[arg-type]
            plan_file = work / f"plan-{schedule}-{m}.json"
            plan_file.write_text(plan.model_dump_json(indent=2))
            report_file = work / f"report-{schedule}-{m}.json"
            _cli("run", "--plan", str(plan_file), "--model", spec, "--steps", str(args.steps), "--report", str(report_file))
            report = json.loads(report_file.read_text())
            rows.append({"M": m, "schedule": schedule, "predicted_ms": report["predicted_step_ms"],
                         "measured_ms": report["measured_step_ms"], "actions": plan.actions})  # fmt: skip
            print(f"  ran {schedule} M={m}: measured {report['measured_step_ms']:.1f} ms, predicted {report['predicted_step_ms']:.1f} ms", flush=True)
    print()
    print("| M | schedule | predicted ms | measured ms | measured ÷ predicted | predicted speed-up vs 1f1b | measured speed-up vs 1f1b | within 10 % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = next(b for b in rows if b["M"] == r["M"] and b["schedule"] == "1f1b")
        pred_up = base["predicted_ms"] / r["predicted_ms"]
        meas_up = base["measured_ms"] / r["measured_ms"]
        ok = abs(meas_up / pred_up - 1) <= 0.10
        r.update(predicted_speedup=pred_up, measured_speedup=meas_up, within_10pct=ok)
        print(f"| {r['M']} | {r['schedule']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
              f"{r['measured_ms'] / r['predicted_ms']:.2f} | {pred_up:.3f} | {meas_up:.3f} | {'yes' if ok else 'no'} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
