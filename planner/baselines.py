"""What other tools would do, evaluated with the same cost model.

1. ``uniform``: the same number of layers per stage (the default of most pipeline
   runtimes, e.g. ``torch.distributed.pipelining`` split points every L/K layers);
2. ``parameters``: stages balanced by parameter bytes (DeepSpeed
   ``PipelineModule(partition_method="parameters")``: the min-max contiguous partition);
3. ``time``: stages balanced by forward + backward time with the block-partition
   heuristic of torchgpipe's ``balance_by_time`` (Bárány and Grinberg, "Block partitions
   of sequences", 2015: move elements from the heaviest block toward the lightest until
   ``max <= min + 1`` on values normalised to [0, 1]);
4. ``gpipe-4k``: the GPipe paper's rule M = 4K micro-batches with the time-balanced split,
   GPipe schedule.

Unless the options fix them, baselines use every device as one pipeline (D = 1,
K = min(devices, layers)), the 1F1B schedule (``gpipe-4k``: GPipe), no recompute and
micro-batches of one sample (M = global batch / D, the smallest bubble and activations).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.cost import Layout, estimate, layer_costs, plan_fits
from planner.errors import PipeplanError
from planner.schedules import ScheduleError, check_schedule_shape
from planner.schema import (
    SCHEDULE_CHUNKS,
    Cluster,
    Plan,
    PlanOptions,
    Profile,
    Schedule,
    TrainingSetup,
)
from planner.search.space import Config
from planner.units import format_bytes

BASELINE_NAMES = ("uniform", "parameters", "time", "gpipe-4k")


@dataclass(frozen=True)
class BaselineResult:
    """A baseline's plan, or ``None`` with the reason in ``note``."""

    name: str
    plan: Plan | None
    note: str


def uniform_split(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` ranges whose sizes differ by at most one (larger ones first)."""
    base, extra = divmod(num_layers, parts)
    out, a = [], 0
    for i in range(parts):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def minmax_split(weights: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Contiguous partition minimising the heaviest part (binary search + greedy), non-empty parts."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def cut(t: float) -> list[tuple[int, int]] | None:
        out, a = [], 0
        for s in range(parts):
            hi = n if s == parts - 1 else n - (parts - s - 1)
            b = a + 1
            if prefix[b] - prefix[a] > t:
                return None
            while b < hi and prefix[b + 1] - prefix[a] <= t:
                b += 1
            if s == parts - 1 and b != n:
                return None
            out.append((a, b))
            a = b
        return out

    lo, hi = max(weights, default=0.0), prefix[-1]
    if cut(lo) is not None:
        result = cut(lo)
        assert result is not None
        return result
    for _ in range(100):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        if cut(mid) is None:
            lo = mid
        else:
            hi = mid
    result = cut(hi)
    assert result is not None
    return result


def block_partition(weights: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """torchgpipe's ``blockpartition.solve`` heuristic (Bárány and Grinberg), reimplemented.

    Start from equal-count blocks; while the heaviest block exceeds the lightest by more than
    one normalised element, move one element at a time along the chain from the heaviest
    block toward the nearest lightest block.  Not optimal in general.
    """
    n = len(weights)
    lo, hi = min(weights), max(weights)
    norm = [(w - lo) / (hi - lo) if hi > lo else 0.0 for w in weights]
    bounds = [r[0] for r in uniform_split(n, parts)] + [n]

    def size(i: int) -> float:
        return sum(norm[bounds[i] : bounds[i + 1]])

    for _ in range(4 * n * parts):
        sizes = [size(i) for i in range(parts)]
        big = max(sizes)
        p = sizes.index(big)
        small = min(sizes)
        if big <= small + 1:
            break
        q = min((i for i in range(parts) if sizes[i] == small), key=lambda i: (abs(i - p), i))
        moved = False
        while q != p:
            h = q + 1 if p > q else q - 1
            if bounds[h + 1] - bounds[h] <= 1:
                break
            if p > q:
                bounds[q + 1] += 1  # first element of block h joins block q
            else:
                bounds[q] -= 1  # last element of block h joins block q
            moved = True
            q = h
        if not moved:
            break
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _smallest_divisor_at_least(x: int, low: int, *, ok: Callable[[int], bool] = lambda m: True) -> int | None:
    for m in range(max(1, low), x + 1):
        if x % m == 0 and ok(m):
            return m
    return None


def _runs(schedule: Schedule, k: int, v: int) -> Callable[[int], bool]:
    """Whether the schedule runs with M micro-batches on K ranks of v chunks."""

    def ok(m: int) -> bool:
        try:
            check_schedule_shape(schedule, k, m, v)
        except ScheduleError:
            return False
        return True

    return ok


def baseline_splits(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions | None = None,
    *,
    num_microbatches: int | None = None,
) -> list[tuple[Config, list[tuple[int, int]]]]:
    """The configuration and ranges of each baseline (in :data:`BASELINE_NAMES` order).

    A baseline whose configuration is impossible (say no micro-batch count fits the batch)
    is left out.
    """
    return [(cfg, ranges) for _, cfg, ranges, _ in _baseline_specs(profile, cluster, training, options, num_microbatches)
            if cfg is not None and ranges is not None]


def _baseline_specs(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions | None,
    num_microbatches: int | None,
) -> list[tuple[str, Config | None, list[tuple[int, int]] | None, str]]:
    options = options or PlanOptions()
    n_layers, g = profile.num_layers, training.global_batch_size
    d = options.data_parallel or 1
    if g % d:
        d = 1
    schedule: Schedule = options.schedule or "1f1b"
    v = options.virtual_stages or (1 if SCHEDULE_CHUNKS[schedule] == "1" else 2)
    if isinstance(options.stages, int):
        k = options.stages
    elif isinstance(options.stages, list):
        k = len(options.stages) // v
    else:
        k = max(1, min(cluster.num_devices // d, n_layers // v))
    parts = k * v
    m_fixed = num_microbatches or options.num_microbatches
    m = m_fixed or (g // d if _runs(schedule, k, v)(g // d) else None)
    sched4: Schedule = options.schedule or "gpipe"
    v4 = v if SCHEDULE_CHUNKS[sched4] != "1" else 1
    # the GPipe rule keeps M = 4K unless the user fixed M
    m4 = options.num_microbatches or _smallest_divisor_at_least(g // d, 4 * k, ok=_runs(sched4, k, v4)) or m
    out: list[tuple[str, Config | None, list[tuple[int, int]] | None, str]] = []
    if parts > n_layers or m is None:
        why = (
            f"{parts} stages for {n_layers} layers" if parts > n_layers else f"no micro-batch count divides {g // d}"
        )
        return [(name, None, None, why) for name in BASELINE_NAMES]
    b = g // (d * m)
    costs = layer_costs(profile, b)
    times = [f + bw for f, bw in zip(costs.forward_ms, costs.backward_ms, strict=True)]
    params = [float(x) for x in costs.param_bytes]
    cfg = Config(d, k, m, schedule, v)
    out.append(("uniform", cfg, uniform_split(n_layers, parts), "equal layers per stage"))
    out.append(("parameters", cfg, minmax_split(params, parts), "balanced by parameter bytes"))
    timed = block_partition(times, parts)
    out.append(("time", cfg, timed, "balanced by time (block partition)"))
    if m4 is not None:
        b4 = g // (d * m4)
        costs4 = layer_costs(profile, b4)
        times4 = [f + bw for f, bw in zip(costs4.forward_ms, costs4.backward_ms, strict=True)]
        cfg4 = Config(d, k, m4, sched4, v4)
        parts4 = cfg4.num_stages
        out.append(("gpipe-4k", cfg4, block_partition(times4, parts4), f"M={m4} (4K rule), time-balanced"))
    else:
        out.append(("gpipe-4k", None, None, f"no micro-batch count >= 4K divides {g // d}"))
    return out


def evaluate_baselines(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    *,
    num_microbatches: int | None = None,
    options: PlanOptions | None = None,
) -> list[BaselineResult]:
    """Each baseline's plan from :func:`planner.cost.estimate`, or why there is none."""
    recompute = options.recompute if options is not None and options.recompute is not None else False
    results = []
    for name, cfg, ranges, note in _baseline_specs(profile, cluster, training, options, num_microbatches):
        if cfg is None or ranges is None:
            results.append(BaselineResult(name, None, note))
            continue
        try:
            rc: bool | list[bool] = recompute
            if isinstance(rc, list) and len(rc) != len(ranges):
                rc = False
            plan = estimate(
                profile, cluster, training,
                Layout(
                    ranges,
                    num_microbatches=cfg.num_microbatches,
                    schedule=cfg.schedule,
                    recompute=rc,
                    data_parallel=cfg.data_parallel,
                    pipeline_degree=cfg.pipeline_degree,
                ),
            )
        except PipeplanError as err:
            results.append(BaselineResult(name, None, f"not applicable: {err}"))
            continue
        if not plan_fits(plan):
            worst = max(plan.stages, key=lambda s: s.memory_bytes / max(1, s.memory_limit_bytes))
            results.append(
                BaselineResult(
                    name,
                    None,
                    f"does not fit memory (stage {worst.index} needs {format_bytes(worst.memory_bytes)} "
                    f"of {format_bytes(worst.memory_limit_bytes)})",
                )
            )
            continue
        results.append(BaselineResult(name, plan, f"{note}, M={cfg.num_microbatches}, {cfg.schedule}"))
    return results


def best_baseline_ms(results: Sequence[BaselineResult]) -> float:
    """The fastest baseline's step time (inf when none fits)."""
    return min((r.plan.predicted.step_time_ms for r in results if r.plan is not None), default=math.inf)
