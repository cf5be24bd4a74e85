"""Runtime benchmark: measured vs predicted step time, and pipeline speed-up, on CPU.

For a few plans of an example model, on 2 gloo ranks with one intra-op thread each:

* measured / predicted step time (prediction from a profile measured here, same threads);
* measured speed-up over one process running the whole model (same global batch,
  same micro-batches) divided by the ideal: K*M/(M+K-1) for a pipeline of K stages and M
  micro-batches, D for D data-parallel replicas.

Goals (issue 5): |measured/predicted - 1| <= 15 %, speed-up efficiency >= 0.8.  Numbers
depend on the machine; this prints whatever it measures.

    OMP_NUM_THREADS=1 python benchmarks/runtime.py [--model examples.gpt:small] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="examples.gpt:small")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first is warm-up")
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--repeat", type=int, default=1, help="run every plan this many times, keep the fastest")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args()

    import torch

    from planner.cost import Layout, estimate
    from planner.schema import Plan, Profile, parse_document
    from profiler import profile
    from profiler.loading import load_entrypoint

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    entry = load_entrypoint(args.model)
    t0 = time.perf_counter()
    prof: Profile = profile(
        entry.model,
        entry.example_inputs,
        microbatch_sizes=(1, 2, 4, 8),
        num_threads=1,
        repeats=5,
        progress=False,
        name=args.model,
        loss_fn=entry.loss_fn,
    )
    print(f"profiled {args.model}: {prof.num_layers} layers in {time.perf_counter() - t0:.1f} s (1 thread)")
    cluster = parse_document("cluster", {"devices": 2, "device_type": "cpu", "intra_node": "loopback"})
    training = parse_document("training", {"global_batch_size": args.batch, "optimizer": "sgd"})
    n = prof.num_layers

    def best_two_stage(schedule: str, m: int, recompute: bool = False) -> Plan:
        plans = [
            estimate(
                prof, cluster, training,
                Layout(
                    [(0, c), (c, n)],
                    num_microbatches=m,
                    schedule=schedule,
                    recompute=recompute,
                ),
            )  # type: ignore[arg-type]
            for c in range(1, n)
        ]
        return min(plans, key=lambda p: p.predicted.step_time_ms)

    def best_interleaved(m: int) -> Plan:
        best: Plan | None = None
        for a in range(1, n - 2):
            for b in range(a + 1, n - 1):
                for c in range(b + 1, n):
                    p = estimate(
                        prof, cluster, training,
                        Layout(
                            [(0, a), (a, b), (b, c), (c, n)],
                            num_microbatches=m,
                            schedule="interleaved-1f1b",
                            pipeline_degree=2,
                        ),
                    )  # fmt: skip
                    if best is None or p.predicted.step_time_ms < best.predicted.step_time_ms:
                        best = p
        assert best is not None
        return best

    runs: list[tuple[str, Plan, float]] = []
    for m in (4, 8):
        single = estimate(
            prof, cluster, training,
            Layout(
                [(0, n)],
                num_microbatches=m,
                schedule="gpipe",
            ),
        )
        runs.append((f"1 process, M={m}", single, 1.0))
        for schedule in ("gpipe", "1f1b"):
            plan = best_two_stage(schedule, m)
            runs.append((f"{schedule} K=2 M={m}", plan, 2 * m / (m + 1)))
    runs.append(("1f1b K=2 M=8 recompute", best_two_stage("1f1b", 8, recompute=True), 2 * 8 / 9))
    runs.append(("interleaved K=2 v=2 M=8", best_interleaved(8), 2 * 8 / 9))
    runs.append(("data-parallel D=2 M=4", estimate(
        prof, cluster, training,
        Layout(
            [(0, n)],
            num_microbatches=4,
            schedule="gpipe",
            data_parallel=2,
        ),
    ), 2.0))

    rows: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for name, plan, _ideal in runs:
                plan_file = Path(tmp, "plan.json")
                report_file = Path(tmp, "report.json")
                plan_file.write_text(plan.model_dump_json())
                cmd = [sys.executable, "-m", "pipeplan", "run", "--plan", str(plan_file), "--model", args.model,
                       "--steps", str(args.steps), "--report", str(report_file), "--timeout", "300"]  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    print(f"{name}: FAILED\n{proc.stderr[-2000:]}")
                    continue
                report = json.loads(report_file.read_text())
                if name not in best or report["measured_step_ms"] < best[name]["measured_step_ms"]:
                    best[name] = report
                print(f"  ran {name}: {report['measured_step_ms']:.1f} ms", flush=True)
    single_ms = {
        plan.num_microbatches: best[name]["measured_step_ms"]
        for name, plan, _ in runs
        if plan.world_size == 1 and name in best
    }
    for name, plan, ideal in runs:
        if name not in best:
            continue
        report = best[name]
        measured = report["measured_step_ms"]
        # data parallel: against one process running the same micro-batches (M x D of them)
        base = single_ms.get(plan.num_microbatches * plan.data_parallel_degree)
        speedup = base / measured if base else None
        busy = [b for b in report["rank_busy_fraction"] if b is not None]
        rows.append(
            {
                "plan": name,
                "stages": ",".join(f"{s.start}:{s.stop}" for s in plan.stages),
                "microbatch_size": plan.microbatch_size,
                "predicted_ms": plan.predicted.step_time_ms,
                "measured_ms": measured,
                "measured_over_predicted": measured / plan.predicted.step_time_ms,
                "speedup": speedup,
                "ideal_speedup": ideal,
                "efficiency": speedup / ideal if speedup else None,
                "compute_share": busy,
                "stage_ratios": [
                    (round(s["forward_ratio"] or 0, 2), round(s["backward_ratio"] or 0, 2)) for s in report["stages"]
                ],
            }
        )

    print()
    print(
        f"{args.model}, global batch {args.batch}, sgd, gloo, 1 thread per rank, median of steps 2..{args.steps}, "
        f"best of {args.repeat}; "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after "
        "(other processes on the machine slow the ranks down and skew both ratios)"
    )
    header = (
        f"{'plan':<26} {'stages':<18} {'B':>2} {'pred ms':>9} {'meas ms':>9} {'meas/pred':>9} "
        f"{'speed-up':>8} {'ideal':>6} {'effic.':>6}  compute share per rank"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        ef = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        print(
            f"{r['plan']:<26} {r['stages'][:18]:<18} {r['microbatch_size']:>2} {r['predicted_ms']:>9.1f} "
            f"{r['measured_ms']:>9.1f} {r['measured_over_predicted']:>9.2f} {sp:>8} {r['ideal_speedup']:>6.2f} {ef:>6}  "
            + " ".join(f"{b:.0%}" for b in r["compute_share"])
        )
    within = sum(1 for r in rows if abs(r["measured_over_predicted"] - 1) <= 0.15)
    eff = [r for r in rows if r["efficiency"] is not None and r["ideal_speedup"] > 1]
    print(
        f"\n|measured/predicted - 1| <= 15 %: {within}/{len(rows)} plans; "
        f"speed-up efficiency >= 0.8: {sum(1 for r in eff if r['efficiency'] >= 0.8)}/{len(eff)} plans"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
