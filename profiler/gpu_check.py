"""GPU check of the profiler (the profiler's half of ``scripts/gpu_check.sh``).

On a CUDA machine it runs, in order:

1. the CUDA-marked profiler tests (``pytest tests/profiler -m cuda``): CUDA-event timing,
   per-layer ``max_memory_allocated`` against the saved-tensor hook bytes, synth with
   dropout against a CUDA measurement (1-byte masks);
2. a float32 and a bfloat16 profile of every example model on ``cuda:0``, printing the
   hook bytes against the peak for each layer and flagging a layer whose forward peak is
   below 80 % of what it saves for backward (the hooks would be over-counting);
3. the accuracy benchmark on CUDA (``benchmarks/profiler.py --device cuda``).

Exit 0 when all passed, 1 otherwise; 0 with a message when there is no CUDA.

    python -m profiler.gpu_check
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("examples.gpt:small", "examples.resnet:small", "examples.amoebanet:small")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("profiler gpu check: no CUDA device visible, nothing to check")
        return 0
    from profiler.loading import load_entrypoint
    from profiler.measure import profile

    failures = 0
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/profiler", "-m", "cuda", "-q"], cwd=ROOT)
    if proc.returncode != 0:
        failures += 1
        print("profiler gpu check: CUDA tests FAILED")
    for spec in MODELS:
        for dtype in ("float32", "bfloat16"):
            entry = load_entrypoint(spec)
            prof = profile(
                entry.model,
                entry.example_inputs,
                microbatch_sizes=(1, 4),
                device="cuda",
                dtype=dtype,
                loss_fn=entry.loss_fn,
                progress=False,
                name=spec,
            )
            print(f"{spec} {dtype}: {'layer':<16}{'hook bytes':>14}{'peak bytes':>14}{'peak/hook':>10}")
            for layer in prof.layers:
                hook = layer.activation_bytes[-1]
                peak = (layer.peak_memory_bytes or [0])[-1]
                ratio = peak / hook if hook else float("nan")
                flag = "  <-- peak below hooks" if hook > 1 << 20 and peak < 0.8 * hook else ""
                failures += bool(flag)
                print(f"{'':>{len(spec) + len(dtype) + 3}}{layer.name:<16}{hook:>14}{peak:>14}{ratio:>10.2f}{flag}")
    bench = subprocess.run(
        [sys.executable, "benchmarks/profiler.py", "--device", "cuda", "--size", "small", "--batch", "8"], cwd=ROOT
    )
    failures += bench.returncode != 0
    print("profiler gpu check:", "passed" if not failures else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
