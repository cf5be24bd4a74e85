"""Mesh runtime benchmark: measured vs predicted step time and memory of mesh plans, on CPU.

For plans with tensor parallelism or ZeRO, and for a two-agent (two "hosts") run, on gloo
ranks with one intra-op thread each, every plan made by ``pipeplan plan`` with the axes forced,
from a profile measured here in the same run with the same thread count:

* measured / predicted step time (the report's median over the steps after the warm-up step);
* for the plans with D > 1, the data-parallel gradient reduction: its measured time (the slowest
  rank's, median after the first step), the part exposed after the backward's last gradient and
  the part hidden behind the backward, against the plan's prediction (``allreduce_ms``, exposed:
  ``allreduce_ms x (1 - gradient_overlap)``); ``D=2 DDP`` runs torch DDP's buckets (``--bucket-mb``),
  ``D=2 flat`` the same plan with ``--dp-reduction flat`` (the runtime's all-reduce after the
  schedule), to compare;
* per rank, its peak resident set in training (the report's "resident set per rank" note; CPU
  has no allocator figure) over the plan's predicted memory of its stage, three ways: the whole
  process; its peak less the process just before it built the model (the interpreter and
  torch); its peak less the process at the first step (activations, gradients and optimizer
  state: not the weights).

Ranks beyond the machine's cores share them: a 4-rank plan on 2 cores runs about twice as
slow as predicted (the plan prices one device per rank).  This prints whatever it measures.

    OMP_NUM_THREADS=1 python benchmarks/runtime_mesh.py [--model examples.gpt:small] [--steps 4]
    OMP_NUM_THREADS=1 python benchmarks/runtime_mesh.py --only "D=2 DDP,D=2 flat"   # the reduction alone
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name: (devices, stages K, D, T, ZeRO, micro-batches M, global batch, two agents, sequence parallelism)
Row = tuple[int, int, int, int, int, int, int, bool, bool]
ROWS: dict[str, Row] = {
    "D=2 DDP": (2, 1, 2, 1, 0, 4, 16, False, False),
    "D=2 flat": (2, 1, 2, 1, 0, 4, 16, False, False),
    "T=2 x K=2": (4, 2, 1, 2, 0, 4, 8, False, False),
    "D=2 ZeRO-1 x K=2": (4, 2, 2, 1, 1, 4, 16, False, False),
    "D=2 ZeRO-3 x K=2": (4, 2, 2, 1, 3, 4, 16, False, False),
    "T=2": (2, 1, 1, 2, 0, 4, 8, False, False),
    "T=2+SP": (2, 1, 1, 2, 0, 4, 8, False, True),
    "D=2 T=2 ZeRO-1": (4, 1, 2, 2, 1, 4, 16, False, False),
    "D=2 T=2 ZeRO-3": (4, 1, 2, 2, 3, 4, 16, False, False),
    "K=2 on two agents": (2, 2, 1, 1, 0, 4, 8, True, False),
}
#: the report's per-axis figures (``RunReport.collectives``), in the order printed
AXES = ("tensor_parallel", "data_parallel", "fsdp", "pipeline_transfers")
MIB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _plan(profile: Path, out: Path, row: Row) -> dict[str, Any]:
    devices, k, d, t, zero, m, batch, two_agents, sp = row
    per_node = devices // 2 if two_agents else devices
    cmd = [sys.executable, "-m", "pipeplan", "plan", str(profile), "--devices", str(devices),
           "--devices-per-node", str(per_node), "--device-type", "cpu", "--interconnect", "loopback",
           "--batch-size", str(batch), "--microbatches", str(m), "--stages", str(k), "--no-recompute",
           "--sequence-parallel" if sp else "--no-sequence-parallel", "--tensor-parallel", str(t), "--data-parallel", str(d), "--zero", str(zero),
           "--optimizer", "sgd", "--schedule", "1f1b", "-o", str(out)]  # fmt: skip
    if two_agents:
        cmd += ["--inter-node", "loopback"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"pipeplan plan failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    plan: dict[str, Any] = json.loads(out.read_text())
    got = (plan["pipeline_degree"], plan["data_parallel_degree"], plan["tensor_parallel_degree"], plan["zero_stage"])
    if got != (k, d, t, zero):
        raise RuntimeError(f"the planner did not keep the forced axes: K, D, T, ZeRO = {got}, asked {(k, d, t, zero)}")
    return plan


def _run(
    plan_file: Path, report_file: Path, *, model: str, steps: int, two_agents: bool, extra: tuple[str, ...] = ()
) -> tuple[dict[str, Any] | None, str]:
    cmd = [sys.executable, "-m", "pipeplan", "run", "--plan", str(plan_file), "--model", model, "--lr", "0.01",
           "--steps", str(steps), "--report", str(report_file), "--timeout", "120", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not two_agents:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return None, proc.stdout[-1500:] + proc.stderr[-1500:]
    else:
        port = _free_port()
        agent = [*cmd, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank"]
        agents = [
            subprocess.Popen(
                [*agent, str(r)],
                cwd=ROOT,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            for r in (0, 1)
        ]
        failed = ""
        for r, p in enumerate(agents):
            try:
                out, err = p.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate()
            if p.returncode != 0:
                failed += f"agent {r}: exit {p.returncode}\n{out[-1500:]}{err[-1500:]}"
        if failed:
            return None, failed
    return json.loads(report_file.read_text()), ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="examples.gpt:small")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    parser.add_argument("--profile-time", type=float, default=20, help="seconds the profiler may spend")
    parser.add_argument("--only", help="comma-separated row names to run (default: all)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument(
        "--bucket-mb", type=float, default=4.0, help="DDP's bucket size for the D > 1 rows (MiB; default 4)"
    )
    args = parser.parse_args()

    from runtime.report import parse_rss_note

    load_before = os.getloadavg()
    wall0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp, "profile.json")
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pipeplan", "profile", "--model", args.model, "--microbatch-sizes", "1,2,4",
             "--threads", "1", "--time-budget", str(args.profile_time), "-q", "-o", str(profile)],
            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if proc.returncode != 0:
            print(f"profile failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            return 1
        layers = json.loads(profile.read_text())["layers"]
        print(f"profiled {args.model}: {len(layers)} layers in {time.perf_counter() - t0:.1f} s (1 thread)", flush=True)
        names = list(ROWS) if not args.only else [n.strip() for n in args.only.split(",")]
        for name in names:
            spec = ROWS[name]
            plan_file = Path(tmp, "plan.json")
            report_file = Path(tmp, "report.json")
            report_file.unlink(missing_ok=True)
            plan = _plan(profile, plan_file, spec)
            t0 = time.perf_counter()
            extra = ("--dp-bucket-mb", repr(args.bucket_mb))
            if name.endswith(" flat"):
                extra += ("--dp-reduction", "flat")
            report, err = _run(plan_file, report_file, model=args.model, steps=args.steps, two_agents=spec[7],
                               extra=extra)  # fmt: skip
            if report is None:
                print(f"  {name}: FAILED\n{err}", flush=True)
                continue
            k, d, t = plan["pipeline_degree"], plan["data_parallel_degree"], plan["tensor_parallel_degree"]
            mem = {s["index"]: s["memory_bytes"] for s in plan["stages"]}
            ranks: list[dict[str, Any]] = []
            for rss in parse_rss_note(report["notes"]):
                predicted = sum(mem[s] for s in rss.stages)

                def over(base: int | None, peak: int = rss.peak_bytes, predicted: int = predicted) -> float | None:
                    return None if base is None or not predicted else (peak - base) / predicted

                ranks.append(
                    {
                        "rank": rss.rank,
                        "stages": list(rss.stages),
                        "peak_rss_mib": rss.peak_bytes / MIB,
                        "peak_in_training": rss.peak_in_training,
                        "first_step_mib": None if rss.first_step_bytes is None else rss.first_step_bytes / MIB,
                        "before_model_mib": None if rss.before_model_bytes is None else rss.before_model_bytes / MIB,
                        "predicted_mib": predicted / MIB,
                        "peak_over_predicted": over(0),
                        "growth_over_predicted": over(rss.before_model_bytes),
                        "training_growth_over_predicted": over(rss.first_step_bytes),
                    }
                )
            rows.append(
                {
                    "plan": name,
                    "world": report["world_size"],
                    "mesh": f"K={k} D={d} T={t} ZeRO {plan['zero_stage']}",
                    "stages": ",".join(f"{s['start']}:{s['stop']}" for s in plan["stages"]),
                    "microbatches": plan["num_microbatches"],
                    "microbatch_size": plan["microbatch_size"],
                    "predicted_ms": report["predicted_step_ms"],
                    "measured_ms": report["measured_step_ms"],
                    "measured_over_predicted": report["ratio"],
                    "step_ms": [s["measured_ms"] for s in report["steps"]],
                    # per stage: measured / predicted forward and backward (median per micro-batch)
                    "stage_ratios": [(s["forward_ratio"], s["backward_ratio"]) for s in report["stages"]],
                    "ranks": ranks,
                    "collectives": next((n for n in report["notes"] if n.startswith("collectives per step")), None),
                    "axes": {a: (report.get("collectives") or {}).get(a) for a in AXES},
                    "gradient_overlap": plan["training"]["gradient_overlap"],
                    "dp_path": _dp_path(report["notes"]),
                    "wall_s": time.perf_counter() - t0,
                }
            )
            print(
                f"  ran {name}: {report['measured_step_ms']:.1f} ms (predicted {report['predicted_step_ms']:.1f}) "
                f"in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )

    print()
    print(
        f"{args.model}, sgd, gloo, 1 thread per rank, 1f1b, median of steps 2..{args.steps}; {os.cpu_count()} CPUs, "
        f"load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load_before)} before, "
        f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())} after; {time.perf_counter() - wall0:.0f} s in all"
    )
    header = (
        f"{'plan':<18} {'ranks':>5} {'stages':<10} {'MxB':>5} {'pred ms':>8} {'meas ms':>8} {'meas/pred':>9} {'stage F,B ratios':<18} "
        "per rank: peak RSS in training / predicted memory of its stage = (peak, peak - RSS before the model, "
        "peak - RSS at the first step) / predicted"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        memory = "  ".join(
            f"r{x['rank']}: {x['peak_rss_mib']:.0f}/{x['predicted_mib']:.0f} MiB = "
            + "/".join(
                "-" if x[key] is None else f"{x[key]:.2f}"
                for key in ("peak_over_predicted", "growth_over_predicted", "training_growth_over_predicted")
            )
            for x in r["ranks"]
        )
        fb = " ".join(f"{f or 0:.1f},{b or 0:.1f}" for f, b in r["stage_ratios"])
        ratio = "-" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.2f}"
        print(
            f"{r['plan']:<18} {r['world']:>5} {r['stages']:<10} {r['microbatches']:>2}x{r['microbatch_size']:<2} "
            f"{r['predicted_ms']:>8.1f} {r['measured_ms'] or 0:>8.1f} {ratio:>9} {fb:<18} {memory}"
        )
    print()
    print("per axis, per step (the slowest rank, median after the first step): measured / predicted ms "
          "(pipeline transfers: waits included, an upper bound of the link time)")
    print(f"{'plan':<18} " + " ".join(f"{a:>26}" for a in AXES))
    for r in rows:
        cells = []
        for a in AXES:
            x = r["axes"].get(a)
            if x is None:
                cells.append(f"{'-':>26}")
            else:
                pred = "-" if x.get("predicted_ms") is None else f"{x['predicted_ms']:.1f}"
                cells.append(f"{x['measured_ms']:>12.1f} / {pred:<11}")
        print(f"{r['plan']:<18} " + " ".join(cells))
    _reduction_table(rows, args.bucket_mb)
    for key, what in (
        ("growth_over_predicted", "peak - RSS before the model"),
        ("training_growth_over_predicted", "peak - RSS at the first step"),
    ):
        vals = [x[key] for r in rows for x in r["ranks"] if x[key] is not None]
        if vals:
            print(f"median over all ranks of ({what}) / predicted memory: {statistics.median(vals):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _dp_path(notes: list[str]) -> str:
    """Which path reduced the data-parallel gradients, from the report's mesh note."""
    mesh = next((n for n in notes if n.startswith("mesh: ")), "")
    if "data-parallel gradients: torch DDP" in mesh:
        return "torch DDP (bucketed, overlapped)"
    if "data-parallel gradients: the runtime's flat all-reduce" in mesh:
        return "flat all-reduce after the schedule"
    return "-"


def _reduction_table(rows: list[dict[str, Any]], bucket_mb: float) -> None:
    """The data-parallel gradient reduction of the D > 1 rows: measured (all of it, exposed after
    the backward's last gradient, hidden behind the backward) against the plan's prediction."""
    dp = [r for r in rows if (r["axes"].get("data_parallel") or {}).get("predicted_ms") is not None]
    if not dp:
        return
    print()
    print(f"data-parallel gradient reduction per step (the slowest rank, median after the first step; DDP buckets of "
          f"{bucket_mb:g} MiB): measured / predicted ms; predicted exposed = allreduce_ms x (1 - gradient_overlap)")  # fmt: skip
    head = (f"{'plan':<18} {'path':<34} {'buckets':>7} {'meas all':>8} {'pred all':>8} {'ratio':>6} "
            f"{'meas exposed':>12} {'pred exposed':>12} {'ratio':>6} {'hidden':>7} {'step ms':>8}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        x = r["axes"].get("data_parallel")
        if x is None or x.get("predicted_ms") is None:
            continue
        parts = x.get("parts_ms") or {}
        exposed = parts.get("exposed", x["measured_ms"])
        pred_all = x["predicted_ms"]
        pred_exposed = pred_all * (1 - r["gradient_overlap"])

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}" if b > 0 else "-"

        print(
            f"{r['plan']:<18} {r['dp_path'][:34]:<34} {x.get('calls') or 0:>7} {x['measured_ms']:>8.2f} {pred_all:>8.2f} "
            f"{ratio(x['measured_ms'], pred_all):>6} {exposed:>12.2f} {pred_exposed:>12.2f} "
            f"{ratio(exposed, pred_exposed):>6} {parts.get('hidden', 0.0):>7.2f} {r['measured_ms'] or 0:>8.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
