"""DeepSeek-V3 on 2,048 H800s: its published layout against pipeplan's plan, predicted.

    python benchmarks/deepseek.py                  # fake-tensor profile from the config, then both
    python benchmarks/deepseek.py --time-limit 20

Source: DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437 (2024):

* the cluster (sec. 3.1): 2,048 H800 GPUs, 8 per node on NVLink and NVSwitch, InfiniBand across
  nodes; sec. 3.2.2: NVLink 160 GB/s and IB 50 GB/s achieved (the ``h800-80g`` preset);
* the layout (sec. 3.2): 16-way pipeline parallelism with DualPipe (two chunks per rank, the
  ``dualpipev`` schedule here), 64-way expert parallelism across 8 nodes, ZeRO-1 data
  parallelism, no tensor parallelism;
* the batch (sec. 4.2): 15,360 sequences of 4,096 tokens (the batch size after its ramp-up);
* the measured cost (sec. 1): "180K H800 GPU hours" per trillion tokens, i.e. a step of
  15,360 x 4,096 tokens on 2,048 GPUs takes 19.9 s.

The model comes from ``examples/configs/deepseek-v3`` through the fake-tensor profile
(``pipeplan profile --fake --hf-config``, balanced routing), priced on the H800 in bf16.
DeepSeek trained its GEMMs in FP8 (sec. 3.3), which the cost model does not price: the predicted
step of the published layout is expected above the measured one by up to the GEMMs' share.  Micro-batch 1
is assumed (the report does not say); the published layout's chunks are balanced by time and
each rank recomputes the fewest of its blocks that fit (the report recomputes RMSNorm and
MLA's up-projections only, sec. 3.3.1, which the profile cannot express).

Printed: the published layout's predicted step and memory, the measured step, and the planner's
plans on the same GPUs and batch (every axis free, then E = 64 fixed), each ÷ the published
layout's predicted step.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.cost import Layout, estimate, plan_fits
from planner.schema import Cluster, Plan, PlanOptions, Profile, TrainingSetup
from planner.solver import solve

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "configs" / "deepseek-v3"
GPUS = 2048
SEQ = 4096
BATCH = 15360
PIPELINE = 16
EXPERTS = 64
CHUNKS = 2  # DualPipe: two chunks per rank
#: sec. 1: 180K H800 GPU hours per trillion tokens
GPU_HOURS_PER_TRILLION = 180e3
GiB = 2**30


def measured_step_s() -> float:
    return BATCH * SEQ * GPU_HOURS_PER_TRILLION * 3600 / 1e12 / GPUS


def profile_of(path: Path | None) -> Profile:
    if path is not None and path.exists():
        return Profile.model_validate_json(path.read_text())
    from profiler.fake import fake_profile
    from profiler.hf_config import hf_entrypoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = fake_profile(lambda: hf_entrypoint(str(CONFIG), seq=SEQ), device_type="h800-80g",
                            microbatch_sizes=(1,), dtype="bfloat16", name="deepseek-v3")
    if path is not None:
        path.write_text(prof.model_dump_json())
    return prof


def balanced_ranges(profile: Profile, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous ranges of the layers with the least largest forward + backward time."""
    work = [x.forward_ms[0] + x.backward_ms[0] for x in profile.layers]
    n = len(work)

    def cut(budget: float) -> list[tuple[int, int]] | None:
        out, a = [], 0
        for c in range(chunks):
            b, total = a, 0.0
            room = n - (chunks - c - 1)  # leave a layer for each later chunk
            while b < room and (b == a or total + work[b] <= budget) and (c < chunks - 1 or b < n):
                total += work[b]
                b += 1
            if c == chunks - 1 and b < n:
                return None
            out.append((a, b))
            a = b
        return out if a == n else None

    lo, hi = max(work), sum(work)
    for _ in range(60):
        mid = (lo + hi) / 2
        if cut(mid) is None:
            lo = mid
        else:
            hi = mid
    ranges = cut(hi)
    assert ranges is not None
    return ranges


def published(profile: Profile, cluster: Cluster, training: TrainingSetup) -> tuple[Plan, int]:
    """The published layout with the fewest blocks per chunk checkpointed that fit (and that count)."""
    ranges = balanced_ranges(profile, PIPELINE * CHUNKS)
    d = GPUS // PIPELINE

    def priced(blocks: int) -> Plan:
        counts = [min(blocks, b - a) for a, b in ranges]
        return estimate(profile, cluster, training, Layout(
            ranges, num_microbatches=BATCH // d, schedule="dualpipev",
            recompute=[c > 0 for c in counts], recompute_layers=[c or None for c in counts],
            data_parallel=d, pipeline_degree=PIPELINE, expert_parallel=EXPERTS, zero_stage=1,
        ))

    longest = max(b - a for a, b in ranges)
    for blocks in range(longest + 1):
        plan = priced(blocks)
        if plan_fits(plan):
            return plan, blocks
    return priced(longest), longest


def describe(plan: Plan) -> str:
    recomputing = sum(s.recompute for s in plan.stages)
    return (f"T{plan.tensor_parallel_degree} E{plan.expert_parallel_degree} P{plan.pipeline_degree} "
            f"D{plan.data_parallel_degree} M{plan.num_microbatches} {plan.schedule} "
            f"v{len(plan.stages) // plan.pipeline_degree} ZeRO-{plan.zero_stage} recompute {recomputing}/"
            f"{len(plan.stages)} chunks, peak {max(s.memory_bytes for s in plan.stages) / GiB:.1f} GiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="plan time limit (s)")
    ap.add_argument("--profile", type=Path, help="read (or write) the fake-tensor profile here")
    args = ap.parse_args()
    start = time.perf_counter()
    profile = profile_of(args.profile)
    print(f"DeepSeek-V3 fake-tensor profile: {profile.num_layers} layers, "
          f"{sum(x.param_bytes for x in profile.layers) / 2 / 1e9:.0f}B parameters, "
          f"{time.perf_counter() - start:.1f} s")
    cluster = Cluster.model_validate({"devices": GPUS, "device_type": "h800-80g"})
    training = TrainingSetup(global_batch_size=BATCH, optimizer="adam", dtype="bfloat16")
    theirs, blocks = published(profile, cluster, training)
    step = theirs.predicted.step_time_ms / 1e3
    print(f"measured (180K GPU hours per trillion tokens): {measured_step_s():.1f} s a step")
    print(f"published layout, predicted: {step:.1f} s ({step / measured_step_s() - 1:+.0%} against measured; "
          f"{'fits' if plan_fits(theirs) else 'does NOT fit'}, {blocks} block(s) per chunk checkpointed): "
          f"{describe(theirs)}")
    print(f"{'planner':>22} | {'step s':>7} {'÷ published':>11} {'cpu s':>6} | plan")
    for label, extra in (("free", {}), (f"E={EXPERTS} fixed", {"expert_parallel": EXPERTS})):
        cpu = time.process_time()
        try:
            plan = solve(profile, cluster, training, PlanOptions(time_limit_s=args.time_limit, **extra))
        except Exception as err:  # a benchmark prints what failed and goes on
            print(f"{label:>22} | failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        s = plan.predicted.step_time_ms / 1e3
        print(f"{label:>22} | {s:7.1f} {s / step:10.2f}x {time.process_time() - cpu:6.1f} | {describe(plan)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
