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
   efficiency) fitted on ONE source, and reported on the others (held out); only the constants
   the source's rows determine are fitted, by ``pipeplan calibrate``'s rule (:func:`fit`).  The sources are
   A100 runs; the Llama rows (H100) take the fit's ratio to the A100 defaults, applied to the
   H100 defaults.

Sources (each CSV's header says more):

* ``megatron_sc21_table1.csv``: Narayanan et al., SC'21, Table 1 (A100-80GB, 8 per node, 8 HDR
  InfiniBand per node).  TFLOP/s per GPU, turned into a step time with the paper's own FLOP
  formula (96·B·s·l·h²·(1 + s/6h + V/16lh), full recompute).  Micro-batch size and
  interleaving are not in the table: micro-batch 1 and 2 (or 3) chunks per rank where the
  layers per rank divide (``benchmarks/megatron.py`` makes the same assumption);
* ``korthikanti_2022_table5.csv``: Korthikanti et al. 2022, Table 5, seconds per iteration,
  full recompute against sequence parallelism + selective recompute (A100-80GB);
* ``llama3_405b_table4.csv``: Dubey et al. (Llama Team), "The Llama 3 Herd of Models", arXiv
  2407.21783, Table 4: Llama 3 405B pre-training on H100-80GB, BF16 model TFLOP/s per GPU.  Its
  own table (3.), priced as the others: synth writes the model from
  ``examples/configs/llama3.1-405b`` (GQA, SwiGLU, RMSNorm; what ``pipeplan synth transformer
  --hf-config`` writes) and ``estimate`` prices Meta's configuration (§3.3.2 of the paper):
  T 8 with sequence parallelism, C as given (all-gather K/V), K 16, D as given; assumptions:
  micro-batch 1 (not in the table), so M = batch_per_dp; interleaved 1F1B with v = 8 chunks of
  one layer per rank (the paper: "the first model chunk on the first stage has only the
  embedding, and the last model chunk on the last stage has only output projection and loss",
  i.e. the 128 layers, embedding + 126 blocks + head, in 16 x 8 chunks of one); ZeRO-1 (Meta's
  FSDP shards the optimizer state and the gradients over the data-parallel replicas; the cost
  model's ZeRO-2 prices a gradient reduce-scatter every micro-batch, so ZeRO-1, whose
  collectives run once per step, is the nearest stage it prices); recompute: none
  if the plan fits the planner's limit, else the least number r of blocks per rank (each
  rank's first r chunks) checkpointed that fits.  TFLOP/s predicted = model FLOPs per step /
  (step x GPUs), model FLOPs = 6·N·tokens (N: every weight a token multiplies, the embedding
  table excluded) + attention 12·l·s·(a·d) per token (QK^T and AV, forward + backward, all
  s x s scores: PaLM's MFU convention, and the attention term of Megatron's formula above; a
  line under the table gives the errors with causal attention's half instead).  The error is
  on TFLOP/s (measured / predicted step - 1).  With ``--plan-limit S`` > 0 (default 10), the
  planner (``solve``) plans the same GPUs, batch and sequence, once with every axis free and
  once with T and C fixed to Meta's, and the table gives its step against the estimate of
  Meta's configuration and its CPU time (a time-limited search: the plan depends on the
  machine's speed; the tables above do not).

"Fits" is the predicted peak against the 80 GiB the GPUs have (every row ran, so every row
must fit): what the device holds (``StagePlan.device_bytes``), the allocator's peak plus its
fragmentation and the CUDA context (the preset's ``cuda_context_bytes`` and
``allocator_fragmentation``); the planner's own limit keeps a 10 % margin below it.  Ranking: for each model with
several configurations in one source, whether the predicted order of their step times is the
measured one (Spearman's rho over them).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.megatron import megatron_ranges
from planner.calibrate import STAGE_NOISE
from planner.calibrate_device import NAMES, identifiable_constants
from planner.cost import Layout, estimate, plan_fits
from planner.cost.compute import DeviceConstants, default_constants
from planner.schema import Cluster, Plan, PlanOptions, Profile, TrainingSetup
from planner.solver import solve
from profiler.decoder import DecoderSpec
from profiler.hf_spec import read_config, spec_from_config
from profiler.synth import synth_decoder, synth_transformer

GiB = 2**30
VOCAB = 51200
SEQ = 2048
DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "published"
#: Llama 3.1 405B's Hugging Face config (the same architecture as the Llama 3 405B of Table 4)
LLAMA_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "configs" / "llama3.1-405b"
LLAMA_SOURCE = "llama3_405b_table4"
#: interleaved chunks per pipeline rank: 8 chunks of one layer on 16 ranks (the paper's first
#: chunk holds only the embedding, its last only the head: Dubey et al. 2024, §3.3.2)
LLAMA_VIRTUAL = 8
#: FSDP shards the optimizer state (and gradients) over the data-parallel replicas (§3.3.2):
#: ZeRO-1 here, the nearest stage whose collectives the cost model runs once per step
LLAMA_ZERO = 1


def training_of(batch: int, *, fused: bool = True) -> TrainingSetup:
    """The training every source ran: Adam in bfloat16 with float32 master weights, its step in
    fused kernels.  Megatron-LM (the SC'21 and Korthikanti rows) steps with Transformer Engine's
    FusedAdam, apex's as the fallback (``megatron/core/optimizer/__init__.py``); torchtitan, Meta's
    open training stack, defaults to ``optimizer.implementation = "fused"`` (its job config).
    ``fused=False``: torch's foreach kernels, whose step holds a float32 copy of the parameters."""
    return TrainingSetup(global_batch_size=batch, optimizer="adam", dtype="bfloat16", fused_optimizer=fused)


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
#: sources with a table of their own (read in :func:`main`)
OWN_TABLE = frozenset({LLAMA_SOURCE})


def plan_of(case: Case, constants: DeviceConstants | None, *, fused: bool = True) -> Plan:
    """``pipeplan synth`` + ``pipeplan estimate`` of the configuration the paper ran."""
    profile = synth_transformer(
        layers=case.layers, hidden=case.hidden, heads=case.heads, seq=SEQ, vocab=VOCAB,
        device_type=case.device_type, dtype="bfloat16", microbatch_sizes=tuple(sorted({1, case.micro})),
        name=f"gpt-{case.model}", attention="materialized", constants=constants,
    )
    cluster = Cluster.model_validate({"devices": case.gpus, "device_type": case.device_type})
    training = training_of(case.batch, fused=fused)
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


def run(cases: Sequence[Case], constants: DeviceConstants | None, *, fused: bool = True) -> list[Result]:
    out = []
    for c in cases:
        plan = plan_of(c, constants, fused=fused)
        peak = max(s.device_bytes for s in plan.stages)
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


@dataclass(frozen=True)
class Fit:
    """The constants fitted on one source, which of them the rows determine, and why one is kept."""

    constants: DeviceConstants
    fitted: tuple[str, ...]
    why_kept: str


def fit(cases: Sequence[Case], device_type: str) -> Fit:
    """The constants of ``device_type`` that minimise the cases' mean |log error|, fitting only
    those the cases determine: the rule ``pipeplan calibrate`` applies
    (:func:`planner.calibrate_device.identifiable_constants`, each row's sensitivity to each
    constant at the defaults, under calibrate's noise of 3 % per observation).  A published table
    whose rows all mix GEMM and memory-bound time in about the same proportion determines only
    the GEMM efficiency; fitting the other to it as well fits the noise (fitted on Korthikanti's
    eight rows, memory efficiency went to 0.48 and the held-out Megatron rows to 12.4 %).
    Coordinate descent on a multiplicative grid, a few rounds: the cost model is monotone in each."""
    base = default_constants(device_type)
    start = (base.gemm_efficiency, base.memory_efficiency)

    def logs(values: tuple[float, float]) -> list[float]:
        res = run(cases, DeviceConstants(gemm_efficiency=values[0], memory_efficiency=values[1]))
        return [math.log(r.predicted_s / r.case.measured_s) for r in res]

    r0 = logs(start)
    h = 1e-3
    columns = []
    for i in range(2):
        moved = tuple(v * math.exp(-h) if j == i else v for j, v in enumerate(start))
        columns.append([(a - b) / -h for a, b in zip(logs((moved[0], moved[1])), r0, strict=True)])
    jac = np.array(columns, dtype=np.float64).T
    active, why = identifiable_constants(jac, STAGE_NOISE)
    values = list(start)

    def loss(v: Sequence[float]) -> float:
        return statistics.fmean(abs(x) for x in logs((v[0], v[1])))

    best = loss(values)
    for step in (1.2, 1.06, 1.015):
        for _ in range(8):
            moved_any = False
            for i in active:
                for factor in (step, 1 / step):
                    cand = list(values)
                    cand[i] = min(cand[i] * factor, 1.0)
                    value = loss(cand)
                    if value < best - 1e-12:
                        best, values, moved_any = value, cand, True
            if not moved_any:
                break
    return Fit(DeviceConstants(gemm_efficiency=values[0], memory_efficiency=values[1]),
               tuple(NAMES[i] for i in active), why)


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


# --------------------------------------------------------------------------- Llama 3 405B, Table 4


@dataclass(frozen=True)
class LlamaCase:
    """One row of Llama 3's Table 4 (Dubey et al. 2024): Meta's mesh and its measured TFLOP/s."""

    source: str
    gpus: int
    t: int
    c: int
    p: int
    d: int
    seq: int
    #: sequences per data-parallel replica per step (= micro-batches: micro-batch 1 assumed)
    batch_per_dp: int
    measured_tflops: float
    device_type: str = "h100-80g"

    @property
    def label(self) -> str:
        return f"T{self.t} C{self.c} P{self.p} D{self.d} s{self.seq // 1024}K M{self.batch_per_dp}"


def llama_cases(path: Path) -> list[LlamaCase]:
    out = []
    for r in _rows(path):
        case = LlamaCase(path.stem, int(r["gpus"]), int(r["tensor_parallel"]), int(r["context_parallel"]),
                         int(r["pipeline_parallel"]), int(r["data_parallel"]), int(r["seq_len"]),
                         int(r["batch_per_dp"]), float(r["tflops_per_gpu"]))
        if case.t * case.c * case.p * case.d != case.gpus:
            raise ValueError(f"{path.name}: T x C x P x D = {case.t * case.c * case.p * case.d} is not the row's "
                             f"{case.gpus} GPUs: check the CSV")
        out.append(case)
    return out


def llama_spec(seq: int) -> DecoderSpec:
    """Llama 3 405B on sequences of ``seq`` tokens (what ``pipeplan synth transformer --hf-config`` reads)."""
    return spec_from_config(read_config(LLAMA_CONFIG), seq=seq, name="llama3-405b")


def llama_profile(case: LlamaCase, constants: DeviceConstants | None) -> Profile:
    return synth_decoder(llama_spec(case.seq), device_type=case.device_type, dtype="bfloat16",
                         microbatch_sizes=(1,), constants=constants)


def model_flops(profile: Profile, spec: DecoderSpec, tokens: int, *, causal: bool = False) -> float:
    """Model FLOPs of a step: 6·N per token for the N weights a token multiplies (every layer's
    but the embedding table's, a lookup; the profile is in bfloat16, 2 bytes a weight), plus
    attention, 12·l·s·(a·d) per token: QK^T and AV, 2·s·a·d each forward, backward twice the
    forward, the whole s x s scores counted, as in PaLM's MFU (Chowdhery et al. 2022, appendix
    B: 6N + 12·L·H·Q·T) and in the attention term of Megatron's formula the other sources use
    (:func:`paper_flops`).  ``causal``: half the scores (what a causal kernel computes)."""
    weights = sum(x.param_bytes for x in profile.layers if x.name != "embed") / 2
    attn_dims = spec.heads * (spec.head_dim or spec.hidden // spec.heads)
    return tokens * (6 * weights + (6 if causal else 12) * spec.layers * spec.seq * attn_dims)


def llama_ranges(layers: int, p: int, v: int) -> list[tuple[int, int]]:
    """Meta's split of ``layers`` profile layers (embedding, blocks, head) into p·v equal chunks:
    the first and the last chunk hold one block fewer than the others, plus the embedding / head."""
    if layers % (p * v):
        raise ValueError(f"{layers} layers do not split evenly into {p} x {v} chunks: choose another v")
    per = layers // (p * v)
    return [(i * per, (i + 1) * per) for i in range(p * v)]


def llama_estimate(case: LlamaCase, profile: Profile, blocks: int) -> Plan:
    """``estimate`` of Meta's configuration with the first ``blocks`` layers of every rank
    checkpointed (its first chunks in order; 0: no recompute)."""
    ranges = llama_ranges(profile.num_layers, case.p, LLAMA_VIRTUAL)
    per = ranges[0][1] - ranges[0][0]
    counts = [min(per, max(0, blocks - (i // case.p) * per)) for i in range(len(ranges))]
    cluster = Cluster.model_validate({"devices": case.gpus, "device_type": case.device_type})
    training = training_of(case.d * case.batch_per_dp)
    return estimate(
        profile, cluster, training,
        Layout(
            ranges,
            num_microbatches=case.batch_per_dp,
            schedule="interleaved-1f1b" if LLAMA_VIRTUAL > 1 else "1f1b",
            recompute=[n > 0 for n in counts],
            recompute_layers=[n or None for n in counts],
            data_parallel=case.d,
            pipeline_degree=case.p,
            tensor_parallel=case.t,
            sequence_parallel=case.t > 1,
            context_parallel=case.c,
            context_attention="all-gather",
            zero_stage=LLAMA_ZERO,
        ),
    )


@dataclass(frozen=True)
class LlamaResult:
    case: LlamaCase
    flops: float
    #: the same with causal attention's half of the scores
    flops_causal: float
    predicted_s: float
    peak_bytes: int
    limit_bytes: int
    #: the peak without recompute
    peak_none_bytes: int
    #: blocks per rank checkpointed (0: none): the least that fits the planner's limit
    recompute_blocks: int
    #: the planner's plans: (what was fixed, step s, CPU s, one line on the plan)
    plans: tuple[tuple[str, float, float, str], ...] = ()

    @property
    def measured_s(self) -> float:
        return self.flops / (self.case.measured_tflops * 1e12 * self.case.gpus)

    @property
    def predicted_tflops(self) -> float:
        return self.flops / (self.predicted_s * self.case.gpus) / 1e12

    @property
    def error(self) -> float:
        """Of TFLOP/s per GPU: predicted / measured - 1."""
        return self.predicted_tflops / self.case.measured_tflops - 1

    @property
    def error_causal(self) -> float:
        """The error with causal attention FLOPs (half the scores) in both figures' FLOP count."""
        return self.flops_causal / (self.predicted_s * self.case.gpus * self.case.measured_tflops * 1e12) - 1

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= 80 * GiB


def least_recompute(case: LlamaCase, profile: Profile) -> tuple[int, Plan, Plan]:
    """The fewest blocks per rank to checkpoint for Meta's configuration to fit the planner's
    limit (bisection: memory falls as blocks grow), its plan, and the plan without recompute;
    every block when none fits."""
    plan = none = llama_estimate(case, profile, 0)
    if plan_fits(plan):
        return 0, plan, none
    lo, hi = 1, profile.num_layers // case.p
    best = llama_estimate(case, profile, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = llama_estimate(case, profile, mid)
        if plan_fits(candidate):
            best, hi = candidate, mid
        else:
            lo = mid + 1
    return hi, best, none


def describe(plan: Plan) -> str:
    recomputing = sum(s.recompute for s in plan.stages)
    mesh = f"T{plan.tensor_parallel_degree}{'+SP' if plan.sequence_parallel else ''} C{plan.context_parallel_degree}"
    return (f"{mesh} P{plan.pipeline_degree} D{plan.data_parallel_degree} M{plan.num_microbatches} "
            f"{plan.schedule} v{len(plan.stages) // plan.pipeline_degree} ZeRO-{plan.zero_stage} "
            f"recompute {recomputing}/{len(plan.stages)} stages, peak "
            f"{max(s.memory_bytes for s in plan.stages) / GiB:.1f} GiB")


def llama_plans(case: LlamaCase, profile: Profile, limit_s: float) -> tuple[tuple[str, float, float, str], ...]:
    """The planner on the row's GPUs, batch and sequence: every axis free, then T and C fixed."""
    cluster = Cluster.model_validate({"devices": case.gpus, "device_type": case.device_type})
    training = training_of(case.d * case.batch_per_dp)
    out = []
    for fixed, extra in (("free", {}), (f"T={case.t} C={case.c}", {"tensor_parallel": case.t,
                                                                    "context_parallel": case.c})):
        start = time.process_time()
        plan = solve(profile, cluster, training, PlanOptions(time_limit_s=limit_s, **extra))
        out.append((fixed, plan.predicted.step_time_ms / 1e3, time.process_time() - start, describe(plan)))
    return tuple(out)


def llama_run(cases: Sequence[LlamaCase], constants: DeviceConstants | None, plan_limit_s: float) -> list[LlamaResult]:
    out = []
    for c in cases:
        profile = llama_profile(c, constants)
        blocks, plan, none = least_recompute(c, profile)
        spec, tokens = llama_spec(c.seq), c.d * c.batch_per_dp * c.seq
        out.append(LlamaResult(
            c, model_flops(profile, spec, tokens), model_flops(profile, spec, tokens, causal=True),
            plan.predicted.step_time_ms / 1e3, max(s.device_bytes for s in plan.stages),
            min(s.memory_limit_bytes for s in plan.stages), max(s.memory_bytes for s in none.stages), blocks,
            llama_plans(c, profile, plan_limit_s) if plan_limit_s > 0 else (),
        ))
    return out


def llama_table(results: Sequence[LlamaResult], title: str) -> None:
    print(title)
    head = (f"{'GPUs':>6} {'config':<27} {'no-rec GiB':>10} {'recompute':>9} {'meas s':>7} {'pred s':>7} "
            f"{'meas TF':>7} {'pred TF':>7} {'error':>7} {'peak GiB':>8} {'fits':>4}")
    print(head)
    print("-" * len(head))
    for r in results:
        rec = "none" if r.recompute_blocks == 0 else f"{r.recompute_blocks}/rank"
        print(f"{r.case.gpus:>6} {r.case.label:<27} {r.peak_none_bytes / GiB:>10.1f} {rec:>9} {r.measured_s:>7.2f} "
              f"{r.predicted_s:>7.2f} {r.case.measured_tflops:>7.0f} {r.predicted_tflops:>7.1f} {r.error:>+7.1%} "
              f"{r.peak_bytes / GiB:>8.1f} {'yes' if r.fits else 'NO':>4}")
    if results:
        print(f"  error: of TFLOP/s per GPU; no-rec GiB: the peak without recompute; recompute: blocks checkpointed "
              f"per rank, the least that fits the planner's limit ({results[0].limit_bytes / GiB:.1f} GiB)")
        print("  with causal attention FLOPs (half the scores) instead, the errors are "
              + ", ".join(f"{r.error_causal:+.1%}" for r in results))


def planner_table(results: Sequence[LlamaResult], limit_s: float) -> None:
    print(f"\n   the planner on the same GPUs, batch and sequence (solve, time limit {limit_s:g} s), against the "
          "estimate of Meta's configuration")
    head = f"{'GPUs':>6} {'seq':>6} {'fixed':<11} {'plan s':>7} {'vs Meta':>7} {'CPU s':>6}  plan"
    print(head)
    print("-" * (len(head) + 60))
    for r in results:
        for fixed, step, cpu, text in r.plans:
            print(f"{r.case.gpus:>6} {r.case.seq:>6} {fixed:<11} {step:>7.2f} {step / r.predicted_s:>6.2f}x "
                  f"{cpu:>6.1f}  {text}")


def llama_summary(results: Sequence[LlamaResult], label: str, held_out: bool = False) -> None:
    if not results:
        return
    errors = [abs(r.error) for r in results]
    misfits = sum(not r.fits for r in results)
    print(f"  {label:<9} {LLAMA_SOURCE:<24} MAPE {statistics.fmean(errors):6.1%}  worst {max(errors):6.1%}  "
          f"predicted not to fit: {misfits} of {len(results)}{' (held out)' if held_out else ''}  (TFLOP/s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of the published CSVs")
    ap.add_argument("--fit", default="megatron_sc21_table1", help="the source the two constants are fitted on")
    ap.add_argument("--plan-limit", type=float, default=10.0,
                    help="the planner's time limit per Llama row and search, s (0: no planner comparison)")
    args = ap.parse_args()
    if args.plan_limit < 0:
        print(f"error: --plan-limit must be >= 0 seconds, got {args.plan_limit}", file=sys.stderr)
        return 1
    if not args.data.is_dir():
        print(f"error: no folder {args.data}: give --data DIR with the published CSVs", file=sys.stderr)
        return 1
    cases: list[Case] = []
    llama_path: Path | None = None
    for path in sorted(args.data.glob("*.csv")):
        if path.stem in READERS:
            cases += READERS[path.stem](path)
        elif path.stem in OWN_TABLE:
            llama_path = path
        else:
            print(f"skipped {path.name}: no reader for this source")
    if args.fit not in {c.source for c in cases}:
        print(f"error: --fit {args.fit!r} is not a source read here: choose one of "
              f"{', '.join(sorted({c.source for c in cases}))}", file=sys.stderr)
        return 1
    defaults = run(cases, None)
    table(defaults, "\n1. defaults (no constant passed)")
    found = fit([c for c in cases if c.source == args.fit], "a100-80g")
    constants = found.constants
    base = default_constants("a100-80g")
    fitted = run(cases, constants)
    kept = [n for n in NAMES if n not in found.fitted]
    table(fitted, f"\n2. a100-80g constants fitted on {args.fit}: gemm_efficiency {constants.gemm_efficiency:.3f} "
                  f"(default {base.gemm_efficiency:.3f}), memory_efficiency {constants.memory_efficiency:.3f} "
                  f"(default {base.memory_efficiency:.3f})"
                  + (f"\n   fitted: {', '.join(found.fitted) or 'nothing'}; {kept[0]} kept at its default: {found.why_kept}"
                     if kept else ""))
    llama_default: list[LlamaResult] = []
    llama_fitted: list[LlamaResult] = []
    if llama_path is not None:
        llama = llama_cases(llama_path)
        h100 = default_constants("h100-80g")
        carried = DeviceConstants(
            gemm_efficiency=min(1.0, h100.gemm_efficiency * constants.gemm_efficiency / base.gemm_efficiency),
            memory_efficiency=min(1.0, h100.memory_efficiency * constants.memory_efficiency / base.memory_efficiency),
        )
        llama_default = llama_run(llama, None, args.plan_limit)
        llama_table(llama_default, "\n3. Llama 3 405B, Table 4 (H100-80GB), defaults: Meta's configuration "
                                   f"(interleaved 1F1B v{LLAMA_VIRTUAL}, ZeRO-{LLAMA_ZERO}, micro-batch 1)")
        llama_fitted = llama_run(llama, carried, 0)
        llama_table(llama_fitted, f"\n   h100-80g constants from the fit on {args.fit} (its ratio to the a100 "
                                  f"defaults): gemm_efficiency {carried.gemm_efficiency:.3f} (default "
                                  f"{h100.gemm_efficiency:.3f}), memory_efficiency {carried.memory_efficiency:.3f} "
                                  f"(default {h100.memory_efficiency:.3f})")
        if args.plan_limit > 0:
            planner_table(llama_default, args.plan_limit)
    foreach = run(cases, None, fused=False)
    print("\nsummary")
    summary(defaults, "defaults")
    print(f"  (with torch's foreach optimizer kernels instead of the fused ones the sources ran, "
          f"{sum(not r.fits for r in foreach)} of {len(foreach)} of these rows would be predicted not to fit)")
    llama_summary(llama_default, "defaults")
    summary(fitted, "fitted", args.fit)
    llama_summary(llama_fitted, "fitted", held_out=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
