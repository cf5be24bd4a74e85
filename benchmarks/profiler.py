"""Profiler accuracy benchmark.

For each example model (``examples.gpt``, ``examples.resnet``, ``examples.amoebanet``):

* **sum vs step**: the sum of the per-layer forward + backward medians of a profile,
  against the median time of a whole *unsplit* training step (forward, loss, backward) of
  the same model, measured in the same run at the same micro-batch size and thread count.
  Goal: within 10 % on CPU.
* **run-to-run spread**: ``--rounds`` profiles, alternating with the whole-step timings so
  both see the same machine load; per layer, (max - min) / median of its fwd + bwd medians
  across rounds (median and worst over layers), and the profile's own interquartile spread.
* **CUDA** (``--device cuda``): per block, the saved-tensor hook bytes against the peak of
  ``max_memory_allocated`` during its forward.

``--zoo``: the real-model zoo (``examples.hf``, ``examples.vision``), per model: the layer count
and whether every block is a layer, the wall time of ``profile`` (capture + measuring), the
measured / predicted step time of one process (a whole unsplit training step against the
profile's sum of layers, alternated as above), and of a 2-rank 1F1B pipeline (``pipeplan
run`` on gloo, median step after the warm-up against the plan's prediction; ``--no-pipeline``
skips it).

    OMP_NUM_THREADS=1 python benchmarks/profiler.py [--size tiny|small] [--batch 8]
        [--device cpu|cuda] [--threads 1] [--clock wall|cpu] [--repeats 7] [--rounds 5]
    OMP_NUM_THREADS=1 python benchmarks/profiler.py --zoo [--batch 4] [--no-pipeline]

``--fake``: the speed and memory of fake-tensor profiles (``pipeplan profile --fake
--hf-config``) of the shipped configs at sequence 8192, micro-batch sizes 1,2,4, priced for an
H100: Llama 3 70B (goal: at most 20 s) and Llama 3.1 405B (at most 60 s), both within 1.5 GiB
of resident memory (``--more``: Mixtral 8x7B and DeepSeek-V3 too).  Each model is profiled in
a fresh process; the table gives the profile's wall and CPU seconds (after imports), the whole
process's wall seconds and its maximum resident set.

    python benchmarks/profiler.py --fake [--more]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from profiler.loading import load_entrypoint
from profiler.measure import profile, resize_batch

MODELS = ("examples.gpt", "examples.resnet", "examples.amoebanet")
ZOO = (
    *(f"examples.hf:{n}" for n in ("gpt2", "llama", "qwen2", "mixtral", "bert", "t5", "vit")),
    *(f"examples.vision:{n}" for n in ("resnet", "mobilenet", "convnext", "densenet", "googlenet")),
)


def step_ms(entry: Any, batch: int, device: torch.device, *, warmup: int, repeats: int, clock: str = "wall") -> float:
    """Median time of a whole training step (forward + loss + backward), unsplit, on the
    profiler's clock."""
    now = time.thread_time if clock == "cpu" and device.type == "cpu" else time.perf_counter
    model = copy.deepcopy(entry.model).to(device).train()
    inputs = tuple(t.to(device) for t in resize_batch(entry.example_inputs, batch))
    times = []
    for r in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = now()
        entry.loss(entry.call(model, inputs)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if r >= warmup:
            times.append((now() - t0) * 1e3)
    return statistics.median(times)


def layer_totals(p: Any, k: int) -> list[float]:
    return [layer.forward_ms[k] + layer.backward_ms[k] for layer in p.layers]


def pipeline_ratio(spec: str, prof: Any, batch: int, steps: int = 5) -> tuple[float, float, str]:
    """Measured and predicted step ms of the solver's 1F1B K=2 plan (M=4) on 2 gloo ranks."""
    import json
    import subprocess
    import tempfile

    from planner.schema import parse_document
    from planner.solver import solve

    cluster = parse_document("cluster", {"devices": 2, "device_type": "cpu", "intra_node": "loopback"})
    training = parse_document("training", {"global_batch_size": 4 * batch, "optimizer": "sgd"})
    options = parse_document("options", {"stages": 2, "data_parallel": 1, "num_microbatches": 4, "schedule": "1f1b"})
    plan = solve(prof, cluster, training, options)
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        plan_file, report_file = Path(tmp, "plan.json"), Path(tmp, "report.json")
        plan_file.write_text(plan.model_dump_json())
        cmd = [sys.executable, "-m", "pipeplan", "run", "--plan", str(plan_file), "--model", spec,
               "--steps", str(steps), "--report", str(report_file), "--timeout", "300"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{spec}: pipeplan run failed: {proc.stderr[-500:]}")
        report = json.loads(report_file.read_text())
    split = ",".join(f"{s.start}:{s.stop}" for s in plan.stages)
    return float(report["measured_step_ms"]), plan.predicted.step_time_ms, split


def zoo(args: argparse.Namespace) -> int:
    """The ``--zoo`` table (see the module docstring)."""
    import warnings

    from profiler.split import CutWarning

    device = torch.device(args.device)
    rows = []
    for spec in ZOO:
        entry = load_entrypoint(spec)
        kw = dict(
            microbatch_sizes=(args.batch,),
            device=args.device,
            loss_fn=entry.loss_fn,
            warmup=args.warmup,
            repeats=args.repeats,
            num_threads=args.threads,
            progress=False,
            clock=args.clock,
            keywords=entry.keywords,
        )
        profiles, steps, wall = [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CutWarning)
                profiles.append(profile(entry.model, entry.example_inputs, **kw))
            wall.append(time.perf_counter() - t0)
            steps.append(step_ms(entry, args.batch, device, warmup=args.warmup, repeats=args.repeats, clock=args.clock))
        merged = sum(issubclass(w.category, CutWarning) for w in caught)
        p1 = profiles[0]
        predicted = statistics.median(sum(layer_totals(p, 0)) for p in profiles)
        measured = statistics.median(steps)
        row = [spec, p1.num_layers, merged, statistics.median(wall), predicted, measured, measured / predicted]
        if args.pipeline:
            meas, pred, split = pipeline_ratio(spec, p1, args.batch)
            row += [split, pred, meas, meas / pred]
        rows.append(row)
        print(f"  {spec}: done", file=sys.stderr, flush=True)
    print(
        f"zoo: micro-batch {args.batch}, {args.device}, {args.threads} thread(s), clock {args.clock}, {args.repeats} "
        f"repeats x {args.rounds} rounds (torch {torch.__version__}); host load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    head = f"{'model':<26}{'layers':>7}{'merged':>7}{'profile s':>10}{'pred ms':>9}{'meas ms':>9}{'meas/pred':>10}"
    if args.pipeline:
        head += f"  {'1F1B K=2 M=4 split':<20}{'pred ms':>9}{'meas ms':>9}{'meas/pred':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r[0]:<26}{r[1]:>7}{r[2]:>7}{r[3]:>10.1f}{r[4]:>9.2f}{r[5]:>9.2f}{r[6]:>10.2f}"
        if args.pipeline:
            line += f"  {r[7]:<20}{r[8]:>9.2f}{r[9]:>9.2f}{r[10]:>10.2f}"
        print(line)
    return 0


#: (config folder under examples/configs, goal in seconds) of the --fake table
FAKE_CASES = (("llama3-70b", 20.0), ("llama3.1-405b", 60.0))
FAKE_MORE = (("mixtral-8x7b", None), ("deepseek-v3", None))
FAKE_RSS_GOAL = 1.5 * 2**30
FAKE_SEQ = 8192
FAKE_SIZES = "1,2,4"


def fake_case(config: str, seq: int, sizes: str) -> int:
    """One fake profile in this process; prints its numbers as JSON (for :func:`fake_table`)."""
    import json
    import resource
    import warnings

    from profiler.fake import fake_profile
    from profiler.hf_config import hf_entrypoint

    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = fake_profile(
            lambda: hf_entrypoint(config, seq=seq),
            device_type="h100-80g",
            microbatch_sizes=[int(x) for x in sizes.split(",")],
            dtype="bfloat16",
        )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({
        "seconds": wall, "cpu_seconds": cpu, "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "layers": prof.num_layers, "param_bytes": sum(x.param_bytes for x in prof.layers),
    }))  # fmt: skip
    return 0


def fake_table(args: argparse.Namespace) -> int:
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cases = FAKE_CASES + (FAKE_MORE if args.more else ())
    rows = []
    for name, goal in cases:
        config = str(root / "examples" / "configs" / name)
        t0 = time.perf_counter()
        run = subprocess.run(
            [sys.executable, __file__, "--fake-case", config, "--seq", str(FAKE_SEQ), "--sizes", FAKE_SIZES],
            capture_output=True, text=True, cwd=root,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])},
        )  # fmt: skip
        process_s = time.perf_counter() - t0
        if run.returncode != 0:
            print(f"{name}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
            return 1
        r = json.loads(run.stdout.strip().splitlines()[-1])
        ok = (goal is None or r["seconds"] <= goal) and r["max_rss"] <= FAKE_RSS_GOAL
        rows.append((name, r, process_s, goal, ok))
    print(f"fake profiles, seq {FAKE_SEQ}, micro-batch sizes {FAKE_SIZES}, priced for h100-80g, bf16 "
          f"({torch.__version__}, {os.cpu_count()} CPUs)")  # fmt: skip
    print(f"{'model':<16} {'params':>9} {'layers':>6} {'profile s':>9} {'cpu s':>7} {'process s':>9} "
          f"{'max RSS':>9} {'goal':>12}")  # fmt: skip
    for name, r, process_s, goal, ok in rows:
        goal_text = (f"<= {goal:g} s" if goal else "-") + (" ok" if ok else " MISSED")
        print(f"{name:<16} {r['param_bytes'] / 2 / 1e9:>8.1f}B {r['layers']:>6} {r['seconds']:>9.1f} "
              f"{r['cpu_seconds']:>7.1f} {process_s:>9.1f} {r['max_rss'] / 2**30:>7.2f} GiB {goal_text:>12}")  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=8, help="micro-batch size compared")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="CPU timing clock (see profiler.profile)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="profiles (and step timings) per model")
    ap.add_argument("--zoo", action="store_true", help="the real-model zoo table instead (see above)")
    ap.add_argument("--fake", action="store_true", help="the fake-profile speed and memory table instead (see above)")
    ap.add_argument("--more", action="store_true", help="--fake: Mixtral 8x7B and DeepSeek-V3 too")
    ap.add_argument("--fake-case", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, default=FAKE_SEQ, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default=FAKE_SIZES, help=argparse.SUPPRESS)
    ap.add_argument("--no-pipeline", dest="pipeline", action="store_false", help="--zoo: skip the 2-rank runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.fake_case:
        return fake_case(args.fake_case, args.seq, args.sizes)
    if args.fake:
        return fake_table(args)
    if args.zoo:
        return zoo(args)
    device = torch.device(args.device)
    rows = []
    cuda_rows = []
    for name in MODELS:
        entry = load_entrypoint(f"{name}:{args.size}")
        kw = dict(
            microbatch_sizes=(args.batch,),
            device=args.device,
            loss_fn=entry.loss_fn,
            warmup=args.warmup,
            repeats=args.repeats,
            num_threads=args.threads,
            progress=False,
            clock=args.clock,
        )
        # Rounds alternate a profile and whole unsplit steps, so both see the same machine load.
        profiles = []
        steps = []
        prof_s = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            profiles.append(profile(entry.model, entry.example_inputs, **kw))
            prof_s.append(time.perf_counter() - t0)
            steps.append(step_ms(entry, args.batch, device, warmup=args.warmup, repeats=args.repeats, clock=args.clock))
        sums = [sum(layer_totals(p, 0)) for p in profiles]
        per_layer = list(zip(*(layer_totals(p, 0) for p in profiles), strict=True))
        spread = [(max(v) - min(v)) / statistics.median(v) for v in per_layer]
        p1 = profiles[0]
        a = layer_totals(p1, 0)
        iqr = [
            (layer.forward_ms_spread[0] + layer.backward_ms_spread[0]) / max(t, 1e-9)  # type: ignore[index]
            for layer, t in zip(p1.layers, a, strict=True)
        ]
        rows.append(
            (
                f"{name.split('.')[-1]}:{args.size}",
                p1.num_layers,
                statistics.median(sums),
                statistics.median(steps),
                statistics.median(sums) / statistics.median(steps),
                statistics.median(spread),
                max(spread),
                statistics.median(iqr),
                statistics.median(prof_s),
            )
        )
        if device.type == "cuda":
            for layer in p1.layers:
                if layer.peak_memory_bytes:
                    cuda_rows.append(
                        (name, layer.name, layer.activation_bytes[0], layer.peak_memory_bytes[0])
                    )
    print(
        f"profiler accuracy, micro-batch {args.batch}, {args.device}, {args.threads} thread(s), clock {args.clock}, "
        f"{args.repeats} repeats x {args.rounds} rounds (torch {torch.__version__}); "
        f"host load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    head = f"{'model':<18}{'layers':>7}{'sum layers ms':>15}{'whole step ms':>15}{'ratio':>8}{'layer spread med':>18}{'max':>8}{'IQR/med':>9}{'profile s':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r[0]:<18}{r[1]:>7}{r[2]:>15.2f}{r[3]:>15.2f}{r[4]:>8.3f}{r[5]:>18.1%}{r[6]:>8.1%}{r[7]:>9.1%}{r[8]:>11.1f}"
        )
    if cuda_rows:
        print()
        print(f"{'model':<22}{'layer':<14}{'hook bytes':>14}{'peak bytes':>14}{'peak/hook':>11}")
        for m, layer_name, hook, peak in cuda_rows:
            print(f"{m:<22}{layer_name:<14}{hook:>14}{peak:>14}{peak / max(hook, 1):>11.2f}")
    worst = max(abs(r[4] - 1) for r in rows)
    print(f"\nworst |sum/step - 1| = {worst:.1%} (goal: within 10 % on CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
