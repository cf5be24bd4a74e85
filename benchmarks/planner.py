"""Planner benchmark: our plan against the baselines and the lower bound, on a profile suite.

    python benchmarks/planner.py            # the suite and the scale rows
    python benchmarks/planner.py --quick    # fewer device counts
    python benchmarks/planner.py --scale-only --repeat 5
    python benchmarks/planner.py --random-scale-only --seeds 0,1,2   # the random-layer scale rows
    python benchmarks/planner.py --small-only   # the small-instance exactness row

Columns: our predicted step time divided by each baseline's (< 1 is better; "n/f" = the
baseline does not fit memory), ours divided by the lower bound (total work / devices),
solver status, proven gap, wall time and the process's CPU time (medians over --repeat
solves; on a shared machine the CPU time is the steadier figure).  Everything is measured
in this run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.baselines import BASELINE_NAMES, evaluate_baselines
from planner.errors import InfeasibleError
from planner.schema import Cluster, LayerProfile, MeasuredOn, PlanOptions, Profile, TrainingSetup
from planner.solver import solve
from profiler.synth import synth_transformer

MiB = 2**20


#: the synthesized profiles keep the flat 0.5 MFU they were made with (synth's default before the
#: device model), so that this table measures the solver on the same instances over time; the
#: device model changes the instances themselves (small micro-batches run less efficiently)
FLAT_MFU = 0.5
#: and the activations of materialised attention (synth's default became flash attention's, 2026-12-06)
ATTENTION = "materialized"

def uniform_transformer(layers: int = 48) -> Profile:
    return synth_transformer(layers=layers, hidden=2048, heads=16, seq=2048, vocab=2048, name=f"uniform-{layers}l",
                             mfu=FLAT_MFU, attention=ATTENTION)


def heavy_ends_transformer(layers: int = 48) -> Profile:
    return synth_transformer(layers=layers, hidden=2048, heads=16, seq=2048, vocab=256000, name=f"heavy-ends-{layers}l",
                             mfu=FLAT_MFU, attention=ATTENTION)


def resnet_like(stages: int = 4, blocks: int = 12) -> Profile:
    """Conv-net-like: activations halve and parameters double at each of ``stages`` stages."""
    sizes = [1, 2, 4, 8]
    out = []
    for s in range(stages):
        for i in range(blocks):
            act = 64 * MiB // (2**s)
            params = 2 * MiB * (4**s)
            f = 1.0 + 0.1 * s
            out.append(
                LayerProfile(
                    name=f"stage{s}.block{i}",
                    param_bytes=params,
                    forward_ms=[f * b for b in sizes],
                    backward_ms=[2 * f * b for b in sizes],
                    activation_bytes=[act * 3 * b for b in sizes],
                    output_bytes=[act // 2 * b for b in sizes],
                    kind="ResidualBlock",
                )
            )
    return Profile(model="resnet-like", measured_on=MeasuredOn(device="synthetic:a100-80g"), microbatch_sizes=sizes,
                   input_bytes=[3 * 224 * 224 * 4 * b for b in sizes], layers=out)


def random_layers(layers: int = 48, seed: int = 0) -> Profile:
    rng = random.Random(seed)
    sizes = [1, 2, 4, 8]
    out = []
    for i in range(layers):
        f = rng.lognormvariate(0, 0.8)
        act = int(rng.lognormvariate(0, 0.7) * 256 * MiB)
        out.append(
            LayerProfile(
                name=f"layer{i}",
                param_bytes=int(rng.lognormvariate(0, 1.0) * 200 * MiB),
                forward_ms=[f * b for b in sizes],
                backward_ms=[f * rng.uniform(1.5, 2.5) * b for b in sizes],
                activation_bytes=[act * b for b in sizes],
                output_bytes=[int(rng.uniform(4, 64) * MiB) * b for b in sizes],
            )
        )
    return Profile(model=f"random-{layers}l", measured_on=MeasuredOn(device="synthetic:a100-80g"),
                   microbatch_sizes=sizes, input_bytes=[MiB * b for b in sizes], layers=out)


def random_scale(layers: int = 1024, seed: int = 0) -> Profile:
    """A profile nobody tuned the solver for: ``layers`` independent random layers, forward
    1-10 ms (backward twice that), parameters 10-200 MiB, activations 1-64 MiB, outputs
    1-16 MiB, each uniform at micro-batch 1 and linear in the micro-batch size (seeded)."""
    rng = random.Random(seed)
    sizes = [1, 2, 4, 8]
    out = []
    for i in range(layers):
        f = rng.uniform(1, 10)
        act = int(rng.uniform(1, 64) * MiB)
        out_b = int(rng.uniform(1, 16) * MiB)
        out.append(
            LayerProfile(
                name=f"layer{i}",
                param_bytes=int(rng.uniform(10, 200) * MiB),
                forward_ms=[f * b for b in sizes],
                backward_ms=[2 * f * b for b in sizes],
                activation_bytes=[act * b for b in sizes],
                output_bytes=[out_b * b for b in sizes],
            )
        )
    return Profile(model=f"random-{layers}l-s{seed}", measured_on=MeasuredOn(device="synthetic:a100-80g"),
                   microbatch_sizes=sizes, input_bytes=[MiB * b for b in sizes], layers=out)


def noisy_small(layers: int, seed: int) -> Profile:
    """A small measured-looking profile: tiny layers whose figures carry +-40 % timer noise (a
    larger micro-batch is sometimes measured faster), as profiling a small MLP on a CPU gives."""
    rng = random.Random(seed)
    sizes = [1, 2]
    out = []
    for i in range(layers):
        f = rng.uniform(0.02, 0.1)
        act = rng.randint(1, 64) * MiB
        out.append(
            LayerProfile(
                name=f"{i}",
                param_bytes=rng.randint(0, 64) * MiB,
                forward_ms=[f * b * rng.uniform(0.6, 1.4) for b in sizes],
                backward_ms=[2 * f * b * rng.uniform(0.6, 1.4) for b in sizes],
                activation_bytes=[act * b for b in sizes],
                output_bytes=[rng.randint(0, 8) * MiB * b for b in sizes],
            )
        )
    return Profile(model=f"noisy-{layers}l", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=sizes,
                   input_bytes=[MiB * b for b in sizes], layers=out)


def small_instances(count: int, time_limit: float) -> list[str]:
    """Random small instances (L <= 16 layers, N <= 4 devices, tight and loose memory): the share
    solved to ``optimal`` (gap 0), and the wall times."""
    rng = random.Random(1)
    optimal = feasible = infeasible = 0
    walls = []
    for i in range(count):
        layers, n = rng.randint(4, 16), rng.randint(1, 4)
        memory = rng.choice(["512MiB", "1GiB", "4GiB", "16GiB"])
        cluster = Cluster.model_validate({"devices": n, "memory": memory, "intra_node": "pcie4"})
        training = TrainingSetup(global_batch_size=rng.choice([4, 8, 16]), optimizer="adam")
        t0 = time.perf_counter()
        try:
            plan = solve(noisy_small(layers, i), cluster, training, PlanOptions(time_limit_s=time_limit))
        except InfeasibleError:
            infeasible += 1
            continue
        walls.append(time.perf_counter() - t0)
        if plan.solver.status == "optimal":
            optimal += 1
        else:
            feasible += 1
    solved = optimal + feasible
    share = f"{optimal / solved:.0%}" if solved else "-"
    return [
        f"small instances: {optimal}/{solved} optimal ({share}), {infeasible} proven infeasible; "
        f"wall median {statistics.median(walls):.2f} s, max {max(walls):.2f} s" if walls else "small instances: none solved"
    ]


def homogeneous(n: int, device_type: str = "a100-80g") -> Cluster:
    return Cluster.model_validate({"devices": n, "device_type": device_type})


def heterogeneous(n: int) -> Cluster:
    """Half the devices 2x slower (A100 80 GB next to half-speed ones)."""
    half = n // 2
    speeds = [1.0] * (n - half) + [0.5] * half
    return Cluster.model_validate(
        {
            "devices": [{"name": "a100-80g", "memory_bytes": "80GiB", "speed": s} for s in speeds],
            "devices_per_node": min(8, n),
            "intra_node": "nvlink3",
            "inter_node": "ib-hdr",
        }
    )


def run_row(name: str, profile: Profile, cluster: Cluster, training: TrainingSetup, time_limit: float, repeat: int = 1) -> list[str]:
    walls = []
    cpus = []
    plan = None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            plan = solve(profile, cluster, training, PlanOptions(time_limit_s=time_limit))
        except InfeasibleError:
            return [name, str(cluster.num_devices), str(profile.num_layers), "infeasible", *[""] * (len(BASELINE_NAMES) + 5)]
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    assert plan is not None
    ours = plan.predicted.step_time_ms
    ratios = []
    for r in evaluate_baselines(profile, cluster, training):
        ratios.append("n/f" if r.plan is None else f"{ours / r.plan.predicted.step_time_ms:.3f}")
    mesh = f"D{plan.data_parallel_degree}xK{plan.pipeline_degree}" + (f"v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return [
        name,
        str(cluster.num_devices),
        str(profile.num_layers),
        f"{mesh} M{plan.num_microbatches} {plan.schedule}",
        *ratios,
        f"{ours / plan.predicted.lower_bound_ms:.3f}",
        plan.solver.status,
        f"{plan.solver.gap:.2%}",
        f"{statistics.median(walls):.2f}",
        f"{statistics.median(cpus):.2f}",
    ]


def print_table(rows: list[list[str]]) -> None:
    header = ["profile", "N", "L", "plan", *(f"÷{b}" for b in BASELINE_NAMES), "÷LB", "status", "gap", "wall s", "cpu s"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="devices {4, 16} only")
    parser.add_argument("--scale-only", action="store_true", help="only the scale rows (128x8, 1024x64, random 1024x64)")
    parser.add_argument("--repeat", type=int, default=3, help="solves per scale row (median wall time)")
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--small", type=int, default=40, help="random small instances (L <= 16, N <= 4)")
    parser.add_argument("--small-only", action="store_true", help="only the small-instance row")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the random-layer scale rows (1024 layers x 64 devices)")
    parser.add_argument("--random-scale-only", action="store_true", help="only the random-layer scale rows")
    args = parser.parse_args()
    training = TrainingSetup(global_batch_size=256, optimizer="adam-mixed")
    rows: list[list[str]] = []
    if args.small_only:
        print("\n".join(small_instances(args.small, args.time_limit)))
        return
    big_training = TrainingSetup(global_batch_size=1024, optimizer="adam-mixed")
    random_rows = [
        (f"random 1024x64 s{seed}", random_scale(1024, seed)) for seed in (int(x) for x in args.seeds.split(",") if x)
    ]
    if args.random_scale_only:
        for name, profile in random_rows:
            rows.append(run_row(name, profile, homogeneous(64), big_training, args.time_limit, args.repeat))
        print_table(rows)
        return
    if not args.scale_only:
        suite = [
            ("uniform-transformer", uniform_transformer(), homogeneous),
            ("heavy-embed-head", heavy_ends_transformer(), homogeneous),
            ("resnet-like", resnet_like(), homogeneous),
            ("random-layers", random_layers(), homogeneous),
            ("heterogeneous", uniform_transformer(), heterogeneous),
        ]
        counts = [4, 16] if args.quick else [2, 4, 8, 16, 64]
        for name, profile, make in suite:
            for n in counts:
                rows.append(run_row(name, profile, make(n), training, args.time_limit))
    rows.append(run_row("scale 128x8", uniform_transformer(126), homogeneous(8), training, args.time_limit, args.repeat))
    big = synth_transformer(layers=1022, hidden=1024, heads=16, seq=1024, vocab=32000, name="scale-1024l", mfu=FLAT_MFU, attention=ATTENTION)
    rows.append(run_row("scale 1024x64", big, homogeneous(64), big_training, args.time_limit, args.repeat))
    for name, profile in random_rows:
        rows.append(run_row(name, profile, homogeneous(64), big_training, args.time_limit, args.repeat))
    print_table(rows)
    if not args.scale_only:
        print("\n".join(small_instances(args.small, args.time_limit)))


if __name__ == "__main__":
    main()
