"""Zero-bubble and planned schedules: what they win on the planner suite, measured in one run.

    python benchmarks/schedules.py            # the suite of benchmarks/planner.py, both scale rows
    python benchmarks/schedules.py --quick    # devices {4, 16} only, no scale rows

For every row of the planner benchmark (same profiles, clusters, batch, memory limits and
time limit) the solver runs twice: once choosing among the schedules pipeplan had before
(gpipe, 1f1b, interleaved-1f1b) and once among every schedule (adding zb-h1, zb-h2, zbv,
dualpipev, interleaved-zb and planned).  The table gives both plans, the ratio of their
predicted step times (new ÷ old: below 1 is faster), both bubbles, and each solve's proven
gap and wall time.  A second table fixes one deep pipeline (D = 1, K = 8 devices, M = 8 or
16 micro-batches), where the bubble is large, and compares the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.errors import InfeasibleError
from planner.schema import Cluster, Plan, PlanOptions, Profile, TrainingSetup
from planner.solver import solve
from planner.units import format_bytes

OLD = ["gpipe", "1f1b", "interleaved-1f1b"]


def describe(plan: Plan) -> str:
    mesh = f"D{plan.data_parallel_degree}xK{plan.pipeline_degree}" + (
        f"v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    )
    return f"{mesh} M{plan.num_microbatches} {plan.schedule}"


def timed_solve(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> tuple[Plan | None, float]:
    t0 = time.perf_counter()
    try:
        plan = solve(profile, cluster, training, options)
    except InfeasibleError:
        return None, time.perf_counter() - t0
    return plan, time.perf_counter() - t0


def run_row(
    name: str, profile: Profile, cluster: Cluster, training: TrainingSetup, limit: float, *, fixed: dict | None = None
) -> list[str]:
    extra = fixed or {}
    old, t_old = timed_solve(profile, cluster, training, PlanOptions(time_limit_s=limit, schedules=OLD, **extra))  # type: ignore[arg-type]
    new, t_new = timed_solve(profile, cluster, training, PlanOptions(time_limit_s=limit, **extra))
    if old is None or new is None:
        return [name, str(cluster.num_devices), str(profile.num_layers), "infeasible" if old is None else describe(old),
                "infeasible" if new is None else describe(new), "", "", "", "", "", "", ""]
    ratio = new.predicted.step_time_ms / old.predicted.step_time_ms
    peak = max(s.memory_bytes for s in new.stages)
    return [
        name,
        str(cluster.num_devices),
        str(profile.num_layers),
        describe(old),
        describe(new),
        f"{ratio:.3f}",
        f"{old.predicted.bubble_fraction:.1%}",
        f"{new.predicted.bubble_fraction:.1%}",
        f"{old.solver.gap:.2%}",
        f"{new.solver.gap:.2%}",
        f"{t_old:.2f}/{t_new:.2f}",
        format_bytes(peak),
    ]


def print_table(rows: list[list[str]]) -> None:
    header = ["profile", "N", "L", "old plan", "new plan", "new÷old", "bubble old", "bubble new",
              "gap old", "gap new", "wall s", "peak new"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)), flush=True)


def main() -> None:
    bench = _load_planner_benchmark()  # the suite lives in benchmarks/planner.py
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="devices {4, 16} only, no scale rows")
    parser.add_argument("--time-limit", type=float, default=5.0)
    args = parser.parse_args()
    training = TrainingSetup(global_batch_size=256, optimizer="adam-mixed")
    suite = [
        ("uniform-transformer", bench.uniform_transformer(), bench.homogeneous),
        ("heavy-embed-head", bench.heavy_ends_transformer(), bench.homogeneous),
        ("resnet-like", bench.resnet_like(), bench.homogeneous),
        ("random-layers", bench.random_layers(), bench.homogeneous),
        ("heterogeneous", bench.uniform_transformer(), bench.heterogeneous),
    ]
    counts = [4, 16] if args.quick else [2, 4, 8, 16, 64]
    rows = []
    for name, profile, make in suite:
        for n in counts:
            rows.append(run_row(name, profile, make(n), training, args.time_limit))
    if not args.quick:
        rows.append(run_row("scale 128x8", bench.uniform_transformer(126), bench.homogeneous(8), training, args.time_limit))
        big = bench.synth_transformer(layers=1022, hidden=1024, heads=16, seq=1024, vocab=32000, name="scale-1024l",
                                      mfu=bench.FLAT_MFU, attention=bench.ATTENTION)
        rows.append(run_row("scale 1024x64", big, bench.homogeneous(64), TrainingSetup(global_batch_size=1024, optimizer="adam-mixed"),
                            args.time_limit))
    print_table(rows)
    deep = []
    for name, profile, make in suite:
        if name == "resnet-like":
            continue
        for m in (8, 16):
            deep.append(run_row(f"{name} M={m}", profile, make(8), training, args.time_limit,
                                fixed={"stages": 8, "data_parallel": 1, "num_microbatches": m}))
    print("\ndeep pipelines (D = 1, K = 8, M fixed):")
    print_table(deep)
    rows += deep
    ratios = [float(r[5]) for r in rows if r[5]]
    big_bubble = [float(r[5]) for r in rows if r[5] and float(r[6].rstrip("%")) > 15]
    print(
        f"\nnew÷old: median {statistics.median(ratios):.3f}, worst {max(ratios):.3f}, best {min(ratios):.3f}; "
        f"rows whose old bubble exceeds 15 %: {len(big_bubble)}"
        + (f", median {statistics.median(big_bubble):.3f}, worst {max(big_bubble):.3f}" if big_bubble else "")
    )


def _load_planner_benchmark():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_benchmark", Path(__file__).resolve().parent / "planner.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
