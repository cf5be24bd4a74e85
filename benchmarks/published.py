"""Published GPU measurements against pipeplan's cost model, run as a user would run them.

    python benchmarks/published.py                          # defaults, then fitted on Megatron Table 1
    python benchmarks/published.py --fit korthikanti_2022_table5

Every CSV in ``../shared/published/`` (beside the checkout; ``--data DIR`` elsewhere) is read;
each row is a configuration that really ran.  For each: ``synth`` describes the model (what
``pipeplan synth transformer`` writes) and ``estimate`` prices the configuration the paper ran
(what ``pipeplan estimate`` does), with the cluster preset's defaults.  Per row the table gives
the predicted and measured step, the error, and the predicted peak memory per GPU; then the
mean absolute percentage error (MAPE) per source:

1. with the defaults (no constant passed: the device model's published defaults);
2. with at most two constants per device type (the device model's GEMM efficiency and memory
   efficiency) fitted on ONE source, and reported on the others (held out).

Sources (each CSV's header says more):

* ``megatron_sc21_table1.csv``: Narayanan et al., SC'21, Table 1 (A100-80GB, 8 per node, 8 HDR
  InfiniBand per node).  TFLOP/s per GPU, turned into a step time with the paper's own FLOP
  formula (96·B·s·l·h²·(1 + s/6h + V/16lh), full recompute).  Micro-batch size and
  interleaving are not in the table: micro-batch 1 and 2 (or 3) chunks per rank where the
  layers per rank divide (``benchmarks/megatron.py`` makes the same assumption);
* ``korthikanti_2022_table5.csv``: Korthikanti et al. 2022, Table 5, seconds per iteration,
  full recompute against sequence parallelism + selective recompute (A100-80GB);
* ``llama3_405b_table4.csv``: Llama 3 405B on H100.  Not priced yet: grouped-query attention,
  the SwiGLU MLP and context parallelism are open issues (synth writes neither), so its rows
  are listed as skipped with the reason.

"Fits" is the predicted peak against the 80 GiB the GPUs have (every row ran, so every row
must fit); the planner's own limit keeps a 10 % margin below it.  Ranking: for each model with
several configurations in one source, whether the predicted order of their step times is the
measured one (Spearman's rho over them).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.megatron import megatron_ranges
from planner.cost import Layout, estimate
from planner.cost.compute import DeviceConstants, default_constants
from planner.schema import Cluster, Plan, TrainingSetup
from profiler.synth import synth_transformer

GiB = 2**30
VOCAB = 51200
SEQ = 2048
DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "published"


@dataclass(frozen=True)
class Case:
    """One published configuration that ran, and its measured step."""

    source: str
    model: str
    label: str
    layers: int
    hidden: int
    heads: int
    t: int
    p: int
    v: int
    gpus: int
    batch: int
    micro: int
    #: "full" (every layer checkpointed, no sequence parallelism) or "seq+sel"
    recompute: str
    measured_s: float
    device_type: str = "a100-80g"

    @property
    def d(self) -> int:
        return self.gpus // (self.t * self.p)


def _rows(path: Path) -> list[dict[str, str]]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))


def paper_flops(layers: int, hidden: int, batch: int) -> float:
    """FLOPs of one step with full recompute (Narayanan et al. SC'21, eq. 3)."""
    s, h, n, v = SEQ, hidden, layers, VOCAB
    return 96 * batch * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))


def megatron_cases(path: Path) -> list[Case]:
    out = []
    for r in _rows(path):
        layers, p = int(r["layers"]), int(r["pipeline_parallel"])
        per = layers // p
        v = 1 if p == 1 else (2 if per % 2 == 0 else (3 if per % 3 == 0 else 1))
        gpus, batch, hidden = int(r["gpus"]), int(r["global_batch"]), int(r["hidden"])
        step = paper_flops(layers, hidden, batch) / (float(r["tflops_per_gpu"]) * 1e12 * gpus)
        out.append(Case(path.stem, f"{r['params_b']}B", "full", layers, hidden, int(r["heads"]),
                        int(r["tensor_parallel"]), p, v, gpus, batch, 1, "full", step))
    return out


def korthikanti_cases(path: Path) -> list[Case]:
    return [
        Case(path.stem, r["model"], r["recompute"], int(r["layers"]), int(r["hidden"]), int(r["heads"]),
             int(r["tensor_parallel"]), int(r["pipeline_parallel"]), int(r["interleave"]), int(r["gpus"]),
             int(r["global_batch"]), int(r["microbatch"]), r["recompute"], float(r["seconds_per_iteration"]))
        for r in _rows(path)
    ]


#: each source's reader; a CSV without one is listed as skipped, with the reason
READERS: dict[str, Callable[[Path], list[Case]]] = {
    "megatron_sc21_table1": megatron_cases,
    "korthikanti_2022_table5": korthikanti_cases,
}
SKIPPED = {
    "llama3_405b_table4": "needs grouped-query attention, a SwiGLU MLP (synth) and context parallelism (open issues)",
}


def plan_of(case: Case, constants: DeviceConstants | None) -> Plan:
    """``pipeplan synth`` + ``pipeplan estimate`` of the configuration the paper ran."""
    profile = synth_transformer(
        layers=case.layers, hidden=case.hidden, heads=case.heads, seq=SEQ, vocab=VOCAB,
        device_type=case.device_type, dtype="bfloat16", microbatch_sizes=tuple(sorted({1, case.micro})),
        name=f"gpt-{case.model}", attention="materialized", constants=constants,
    )
    cluster = Cluster.model_validate({"devices": case.gpus, "device_type": case.device_type})
    training = TrainingSetup(global_batch_size=case.batch, optimizer="adam", dtype="bfloat16")
    sel = case.recompute == "seq+sel"
    return estimate(
        profile, cluster, training,
        Layout(
            megatron_ranges(case.layers, case.p, case.v),
            num_microbatches=case.batch // (case.d * case.micro),
            schedule="interleaved-1f1b" if case.v > 1 else "1f1b",
            recompute=not sel,
            data_parallel=case.d,
            pipeline_degree=case.p,
            tensor_parallel=case.t,
            sequence_parallel=sel and case.t > 1,
            selective_recompute=sel,
        ),
    )


@dataclass(frozen=True)
class Result:
    case: Case
    predicted_s: float
    peak_bytes: int
    limit_bytes: int

    @property
    def error(self) -> float:
        return self.predicted_s / self.case.measured_s - 1

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= 80 * GiB


def run(cases: Sequence[Case], constants: DeviceConstants | None) -> list[Result]:
    out = []
    for c in cases:
        plan = plan_of(c, constants)
        peak = max(s.memory_bytes for s in plan.stages)
        out.append(Result(c, plan.predicted.step_time_ms / 1e3, peak, min(s.memory_limit_bytes for s in plan.stages)))
    return out


def mape(results: Sequence[Result]) -> float:
    return statistics.fmean(abs(r.error) for r in results) if results else math.nan


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rho (no ties expected)."""
    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = pos
        return r

    n = len(xs)
    if n < 2:
        return math.nan
    rx, ry = ranks(xs), ranks(ys)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def ranking(results: Sequence[Result]) -> list[tuple[str, float]]:
    """Per (source, model) with several configurations: Spearman's rho of predicted vs measured."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.case.source, r.case.model), []).append(r)
    return [
        (f"{src} {model}", spearman([r.predicted_s for r in rs], [r.case.measured_s for r in rs]))
        for (src, model), rs in groups.items() if len(rs) > 1
    ]


def fit(cases: Sequence[Case], device_type: str) -> DeviceConstants:
    """The two constants of ``device_type`` that minimise the cases' mean |log error|
    (coordinate descent on a multiplicative grid, a few rounds: the cost model is monotone in each)."""
    base = default_constants(device_type)
    g, mem = base.gemm_efficiency, base.memory_efficiency

    def loss(gv: float, mv: float) -> float:
        res = run(cases, DeviceConstants(gemm_efficiency=gv, memory_efficiency=mv))
        return statistics.fmean(abs(math.log(r.predicted_s / r.case.measured_s)) for r in res)

    best = loss(g, mem)
    for step in (1.2, 1.06, 1.015):
        for _ in range(8):
            moved = False
            for cand in ((g * step, mem), (g / step, mem), (g, mem * step), (g, mem / step)):
                cg, cm = min(cand[0], 1.0), min(cand[1], 1.0)
                value = loss(cg, cm)
                if value < best - 1e-12:
                    best, g, mem, moved = value, cg, cm, True
            if not moved:
                break
    return DeviceConstants(gemm_efficiency=g, memory_efficiency=mem)


def table(results: Sequence[Result], title: str) -> None:
    print(title)
    head = (f"{'source':<24} {'model':>7} {'config':<34} {'measured s':>10} {'pred s':>8} {'error':>7} "
            f"{'peak GiB':>8} {'fits':>4}")
    print(head)
    print("-" * len(head))
    for r in results:
        c = r.case
        cfg = f"T{c.t} P{c.p} v{c.v} D{c.d} b{c.micro} B{c.batch} {c.recompute}"
        print(f"{c.source:<24} {c.model:>7} {cfg:<34} {c.measured_s:>10.3f} {r.predicted_s:>8.3f} "
              f"{r.error:>+7.1%} {r.peak_bytes / GiB:>8.1f} {'yes' if r.fits else 'NO':>4}")


def summary(results: Sequence[Result], label: str, fitted_on: str | None = None) -> None:
    sources = sorted({r.case.source for r in results})
    for src in sources:
        rs = [r for r in results if r.case.source == src]
        held = "" if fitted_on is None else (" (fitted here)" if src == fitted_on else " (held out)")
        misfits = sum(not r.fits for r in rs)
        print(f"  {label:<9} {src:<24} MAPE {mape(rs):6.1%}  worst {max(abs(r.error) for r in rs):6.1%}  "
              f"predicted not to fit: {misfits} of {len(rs)}{held}")
    for name, rho in ranking(results):
        print(f"  {label:<9} ranking {name}: Spearman {rho:+.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of the published CSVs")
    ap.add_argument("--fit", default="megatron_sc21_table1", help="the source the two constants are fitted on")
    args = ap.parse_args()
    if not args.data.is_dir():
        print(f"error: no folder {args.data}: give --data DIR with the published CSVs", file=sys.stderr)
        return 1
    cases: list[Case] = []
    for path in sorted(args.data.glob("*.csv")):
        if path.stem in READERS:
            cases += READERS[path.stem](path)
        else:
            print(f"skipped {path.name}: {SKIPPED.get(path.stem, 'no reader for this source')}")
    if args.fit not in {c.source for c in cases}:
        print(f"error: --fit {args.fit!r} is not a source read here: choose one of "
              f"{', '.join(sorted({c.source for c in cases}))}", file=sys.stderr)
        return 1
    defaults = run(cases, None)
    table(defaults, "\n1. defaults (no constant passed)")
    constants = fit([c for c in cases if c.source == args.fit], "a100-80g")
    base = default_constants("a100-80g")
    fitted = run(cases, constants)
    table(fitted, f"\n2. a100-80g constants fitted on {args.fit}: gemm_efficiency {constants.gemm_efficiency:.3f} "
                  f"(default {base.gemm_efficiency:.3f}), memory_efficiency {constants.memory_efficiency:.3f} "
                  f"(default {base.memory_efficiency:.3f})")
    print("\nsummary")
    summary(defaults, "defaults")
    summary(fitted, "fitted", args.fit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
