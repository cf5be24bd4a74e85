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

    OMP_NUM_THREADS=1 python benchmarks/profiler.py [--size tiny|small] [--batch 8]
        [--device cpu|cuda] [--threads 1] [--clock wall|cpu] [--repeats 7] [--rounds 5]
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
        entry.loss(model(*inputs)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if r >= warmup:
            times.append((now() - t0) * 1e3)
    return statistics.median(times)


def layer_totals(p: Any, k: int) -> list[float]:
    return [layer.forward_ms[k] + layer.backward_ms[k] for layer in p.layers]


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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
