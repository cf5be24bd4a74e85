"""Helpers of the walkthrough notebook: GPipe's Table 2 and the paper's 6B Transformer.

Torch-free; used by ``walkthrough.ipynb`` and by ``tests/test_notebook.py`` (which recomputes
the same numbers without running the notebook).

GPipe (Huang et al., NeurIPS 2019), Table 2: training throughput with K partitions and M
micro-batches, normalized to K=2, M=1.  With the whole batch as one micro-batch (M=1) only
one partition works at a time, so K=2, M=1 runs at about one device's speed; with M
micro-batches the ideal speed-up over one device is K*M / (M + K - 1) (the bubble is
(K-1)/(M+K-1) of the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from planner.cost import Layout, estimate, layer_costs
from planner.schema import Cluster, Plan, Profile, TrainingSetup
from profiler.synth import synth_transformer

#: GPipe Table 2, M = 32 row: normalized throughput at K = 2, 4, 8
PAPER_M32 = {
    "Transformer": {2: 1.8, 4: 3.4, 8: 6.3},
    "AmoebaNet-D": {2: 1.21, 4: 1.84, 8: 3.48},
}
KS = (2, 4, 8)
MS = (1, 4, 32)


def table2_profile() -> Profile:
    """A 48-block Transformer (hidden 2048, FFN 8192, 32 heads, 1024 tokens), bf16 on A100-40G.

    The paper's Table 2 Transformer has uniform layers of this kind; the device only sets the
    time scale, which the normalization removes.
    """
    return synth_transformer(
        layers=48,
        hidden=2048,
        ffn=8192,
        heads=32,
        seq=1024,
        vocab=32000,
        device_type="a100-40g",
        dtype="bfloat16",
        microbatch_sizes=(1, 2, 4, 8, 16, 32),
        name="transformer-48 (GPipe Table 2 shape)",
        # one flat efficiency at every micro-batch size: the table isolates the bubble (the device
        # model would also slow the small micro-batches of large M, which GPipe's TPUs did less)
        mfu=0.5,
    )


def balanced_stages(profile: Profile, k: int, microbatch_size: int) -> list[tuple[int, int]]:
    """Contiguous split into ``k`` stages minimizing the slowest stage's forward+backward time.

    The classic linear-partition dynamic program (GPipe balances its partitions by estimated
    cost too); exact, O(k n^2), instant for the n ~ 50 layers used here.
    """
    c = layer_costs(profile, microbatch_size)
    n = c.num_layers
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} layers into {k} stages: choose 1 <= k <= {n}")

    def cost(a: int, b: int) -> float:
        return (c.prefix_forward[b] - c.prefix_forward[a]) + (c.prefix_backward[b] - c.prefix_backward[a])

    inf = float("inf")
    # best[j][i]: slowest stage of the best split of layers [0, i) into j stages
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for a in range(j - 1, i):
                v = max(best[j - 1][a], cost(a, i))
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, a
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    bounds.reverse()
    return list(pairwise(bounds))


@dataclass(frozen=True)
class Table2:
    global_batch_size: int
    #: (K, M) -> the plan the cost model evaluated
    plans: dict[tuple[int, int], Plan]

    def step_ms(self, k: int, m: int) -> float:
        return self.plans[(k, m)].predicted.step_time_ms

    def normalized(self, k: int, m: int) -> float:
        """Throughput at (K, M) over throughput at K=2, M=1 (the paper's normalization)."""
        return self.step_ms(2, 1) / self.step_ms(k, m)

    def rows(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for m in MS:
            row: dict[str, object] = {"M": m}
            for k in KS:
                row[f"K={k}"] = round(self.normalized(k, m), 2)
                row[f"ideal K={k}"] = round(ideal_speedup(k, m), 2)
            out.append(row)
        return out


def ideal_speedup(k: int, m: int) -> float:
    """K*M/(M+K-1): K devices with GPipe's bubble, over one device."""
    return k * m / (m + k - 1)


def table2(
    profile: Profile | None = None,
    *,
    global_batch_size: int = 32,
    ks: Sequence[int] = KS,
    ms: Sequence[int] = MS,
) -> Table2:
    """Evaluate GPipe (with re-materialization, as in the paper) for every (K, M)."""
    profile = profile or table2_profile()
    training = TrainingSetup(global_batch_size=global_batch_size, optimizer="adam-mixed")
    plans: dict[tuple[int, int], Plan] = {}
    for k in sorted({2, *ks}):
        cluster = Cluster.model_validate({"devices": k, "device_type": "a100-40g"})
        for m in sorted({1, *ms}):
            stages = balanced_stages(profile, k, global_batch_size // m)
            plans[(k, m)] = estimate(
                profile, cluster, training,
                Layout(
                    stages,
                    num_microbatches=m,
                    schedule="gpipe",
                    recompute=True,
                ),
            )
    return Table2(global_batch_size=global_batch_size, plans=plans)


def six_billion_profile() -> Profile:
    """GPipe's 128-layer, 6-billion-parameter Transformer, as a decoder-only synth profile.

    The paper's model has 64 encoder and 64 decoder layers (hidden 1024, 16k-wide FFN);
    decoder layers also carry cross-attention.  A decoder-only stack of 128 blocks with a
    20480-wide FFN matches its 6.0B parameters.  fp32 weights, as on the paper's TPUs.
    """
    return synth_transformer(
        layers=128,
        hidden=1024,
        ffn=20480,
        heads=16,
        seq=256,
        vocab=32000,
        device_type="a100-40g",
        dtype="float32",
        microbatch_sizes=(1, 2, 4, 8, 16),
        name="transformer-128l-6b (GPipe)",
    )


def num_params(profile: Profile) -> float:
    """Parameters of a synth profile (its parameter bytes over the dtype's size)."""
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[profile.measured_on.dtype]
    return sum(layer.param_bytes for layer in profile.layers) / dtype_bytes
