"""The split model: a configuration's stages, their time and memory tests, and exact evaluation.

Everything here works on :func:`planner.costmodel.layer_costs` prefix sums; the event
simulator is only run (through :func:`quick_step`) on a few finished candidates.

A *split* (:class:`Split`) of a configuration (:class:`planner.search.space.Config`) is K·v
contiguous ``[start, stop)`` layer ranges plus a recompute flag per stage and the group (rank)
of every stage.  :class:`StageModel` answers a stage's work, all-reduce and memory from prefix
sums; :func:`split_memory_ok` and :func:`quick_step` decide a split exactly as
:func:`planner.costmodel.estimate` would.  :func:`farthest` and :func:`bisect_feasible` are the
two searches every bound and split search is built on (largest passing stage end; least
passing step time).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.costmodel import (
    LayerCosts,
    allreduce_ms,
    boundary_transfer_ms,
    inflight_microbatches,
    rank_memory_bytes,
    static_bytes,
)
from planner.schema import Cluster, PlanOptions, Schedule, TrainingSetup
from planner.search.space import Config, Group
from planner.simulator import CompiledSchedule, compile_schedule, makespans

#: relative precision of the bottleneck binary searches
REL_TOL = 1e-6


@dataclass(frozen=True)
class Split:
    """Stage ranges, recompute flags, and the group (rank) index of every stage."""

    ranges: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    groups: tuple[int, ...]


class StageModel:
    """Per-stage time and memory tests of one configuration, from prefix sums."""

    def __init__(
        self,
        costs: LayerCosts,
        cfg: Config,
        training: TrainingSetup,
    ) -> None:
        self.costs = costs
        self.cfg = cfg
        self.training = training
        self.L = costs.num_layers
        self.F = costs.prefix_forward
        self.B = costs.prefix_backward
        self.PP = costs.prefix_param
        self.grad_factor = training.gradient_bytes_per_param_byte
        # prefix minimum of the stage-input bytes over starts 1..a (starts >= 1 only):
        # a lower bound of the recompute stash that shrinks as the start moves right.
        pmin = [costs.input_bytes] * (self.L + 1)
        cur = math.inf
        for a in range(1, self.L + 1):
            if a < self.L:
                cur = min(cur, costs.stage_input_bytes(a))
            pmin[a] = cur if cur < math.inf else 0.0
        self.pmin_input = pmin
        k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
        self.inflight = [inflight_microbatches(cfg.schedule, k, m, r, v) for r in range(k)]

    @staticmethod
    def inflight_of(cfg: Config, rank: int) -> int:
        return inflight_microbatches(cfg.schedule, cfg.pipeline_degree, cfg.num_microbatches, rank, cfg.virtual_stages)

    # ------------------------------------------------------------------ time

    def work_ms(self, a: int, b: int, rc: bool, speed: float) -> float:
        """Forward + backward (+ recompute) of one micro-batch on stage [a, b)."""
        f = self.F[b] - self.F[a]
        return (2 * f if rc else f) / speed + (self.B[b] - self.B[a]) / speed

    def allreduce(self, a: int, b: int, group: Group) -> float:
        grad = (self.PP[b] - self.PP[a]) * self.grad_factor
        link = group.link
        return allreduce_ms(grad, self.cfg.data_parallel, link.bandwidth_bytes_per_s, link.latency_s)

    # ------------------------------------------------------------------ memory

    def memory(self, a: int, b: int, rc: bool, rank: int) -> float:
        return rank_memory_bytes(self.costs, [(a, b)], [rc], self.training, inflight=self.inflight[rank])

    def memory_relaxed(self, a: int, b: int, rc: bool, rank: int) -> float:
        """A lower bound of :meth:`memory` that is monotone in both ends (for proofs)."""
        params = self.PP[b] - self.PP[a]
        acts = max(0.0, self.costs.prefix_activation[b] - self.costs.prefix_activation[a] - self.costs.activation_slack)
        n = self.inflight[rank]
        stash = self.pmin_input[a]
        if rc:
            return static_bytes(params, self.training) + n * stash + acts
        return static_bytes(params, self.training) + n * acts


def work_total(costs: LayerCosts) -> float:
    """Forward + backward of every layer, at speed 1 (one micro-batch)."""
    return costs.prefix_forward[-1] + costs.prefix_backward[-1]


def recompute_options(options: PlanOptions, stage: int) -> tuple[bool, ...]:
    """The recompute flags the options allow for stage ``stage`` (both when free)."""
    if isinstance(options.recompute, bool):
        return (options.recompute,)
    if isinstance(options.recompute, list):
        return (options.recompute[stage],)
    return (False, True)


def farthest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Largest ``b`` in ``[lo, hi]`` with ``ok(b)``, for ``ok`` true on a prefix; None if ``ok(lo)`` fails."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def bisect_feasible(
    feasible: Callable[[float], bool],
    lo: float,
    *,
    rel_tol: float = REL_TOL,
    hi: float | None = None,
    give_up: float = math.inf,
) -> tuple[float, float]:
    """``(lo, hi)`` within ``rel_tol`` with ``feasible(hi)`` and no feasible value below ``lo``.

    Needs ``lo`` a lower bound of the smallest feasible value, and ``feasible(inf)`` unless
    ``give_up`` is finite: then ``(lo, inf)`` when nothing up to ``give_up`` is feasible.  A
    ``hi`` known to be feasible skips the search for one.
    """
    lo = max(lo, 0.0)
    if feasible(lo):
        return lo, lo
    if hi is None:
        hi = max(lo * 1.25, 1e-9)
        while not feasible(hi):
            if hi > give_up:
                return lo, math.inf
            lo, hi = hi, hi * 2
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


def quick_step(
    sm: StageModel,
    cluster: Cluster,
    groups: Sequence[Group],
    split: Split,
    compiled: dict[tuple[Schedule, int, int, int], CompiledSchedule] | None = None,
) -> float:
    """The step time :func:`planner.costmodel.estimate` would predict, without building a Plan.

    Uses the cost model's transfer and all-reduce functions and the simulator's schedules
    (compiled once per shape into ``compiled``); a test checks it against ``estimate`` so
    the two cannot drift apart.
    """
    cfg = sm.cfg
    k = cfg.pipeline_degree
    key = cfg.shape
    if compiled is None:
        compiled = {}
    if key not in compiled:
        compiled[key] = compile_schedule(*key)
    ranges = list(split.ranges)
    placement = [list(groups[g].devices) for g in split.groups]
    speed = [groups[g].speed for g in split.groups]
    fwd = [(sm.F[b] - sm.F[a]) / speed[s] for s, (a, b) in enumerate(ranges)]
    bwd = [(sm.B[b] - sm.B[a]) / speed[s] for s, (a, b) in enumerate(ranges)]
    total_b = [bwd[s] + (fwd[s] if split.recompute[s] else 0.0) for s in range(len(ranges))]
    xfer = boundary_transfer_ms(sm.costs, ranges, placement, cluster)
    finish = makespans(compiled[key], fwd, total_b, xfer)
    step = 0.0
    for r in range(k):
        own = [s for s in range(len(ranges)) if s % k == r]
        grad = sum(sm.PP[ranges[s][1]] - sm.PP[ranges[s][0]] for s in own) * sm.grad_factor
        link = groups[split.groups[own[0]]].link
        ar = allreduce_ms(grad, cfg.data_parallel, link.bandwidth_bytes_per_s, link.latency_s)
        step = max(step, finish[r] + ar)
    return step


def split_memory_ok(sm: StageModel, groups: Sequence[Group], split: Split) -> bool:
    """Every rank's predicted peak fits its group's usable memory (exactly as ``estimate``)."""
    k = sm.cfg.pipeline_degree
    for r in range(k):
        own = [s for s in range(len(split.ranges)) if s % k == r]
        mem = rank_memory_bytes(
            sm.costs, [split.ranges[s] for s in own], [split.recompute[s] for s in own], sm.training,
            inflight=sm.inflight[r],
        )
        if math.ceil(mem) > groups[split.groups[own[0]]].limit_bytes:
            return False
    return True
