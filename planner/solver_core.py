"""Building blocks of the solver: configurations, device groups, stage tests, bounds.

Everything here works on :func:`planner.costmodel.layer_costs` prefix sums; the event
simulator is only run (through :func:`quick_step`) on a few finished candidates.

Notation: a *configuration* fixes the data-parallel degree D, the pipeline degree K, the
micro-batch count M, the schedule and the chunks per device v.  A *split* is K·v contiguous
``[start, stop)`` layer ranges plus a recompute flag per stage.

Lower bound of a split (GPipe, 1F1B, interleaved; valid for any durations): rank ``r`` can
start no earlier than the first micro-batch's forward path into its first stage, works
``M · c_r`` (its stages' forward + backward + recompute per micro-batch, divided by its
speed), and after its last backward the gradient still has to flow back to stage 0 (or the
rank all-reduces its gradients, whichever is longer):

    LB_r = in_f(r) + M·c_r + idle_r + max(out_b(r), allreduce_r)

``idle_r`` is the wait the schedule's fixed order forces between the last forward and the
last backward of rank ``r`` (1F1B: the downstream path minus the ``w = min(K-r-1, M)``
backwards the rank can run meanwhile, plus, when ``M >= w + 2``, the wait between the first
forward and the first backward: the downstream path minus the ``w`` warm-up forwards run
meanwhile; the two intervals are disjoint because ``F(M-1)`` comes after ``B(0)``; GPipe: the downstream path of the first micro-batch
minus the ``M-1`` forwards that follow it; interleaved: 0).  Interleaved ranks also get
one bound per chunk j: the forward of chunk j on micro-batch 0 waits for the path through
every earlier stage, and the rank has by then run only K forwards of each earlier chunk.  The simulator's makespan can
only be larger, so ``max_r LB_r`` bounds the step time of that split from below.
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
    transfer_ms,
)
from planner.schema import Cluster, Interconnect, PlanOptions, Schedule, TrainingSetup
from planner.simulator import CompiledSchedule, compile_schedule, makespans


@dataclass(frozen=True, order=True)
class Config:
    """One point of the outer search: D, K, M, schedule, v."""

    data_parallel: int
    pipeline_degree: int
    num_microbatches: int
    schedule: Schedule
    virtual_stages: int = 1

    @property
    def num_stages(self) -> int:
        return self.pipeline_degree * self.virtual_stages

    @property
    def shape(self) -> tuple[Schedule, int, int, int]:
        """(schedule, K, M, v): what its compiled schedule depends on."""
        return (self.schedule, self.pipeline_degree, self.num_microbatches, self.virtual_stages)

    def microbatch_size(self, global_batch_size: int) -> int:
        return global_batch_size // (self.data_parallel * self.num_microbatches)

    def describe(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (
            f"D={self.data_parallel} K={self.pipeline_degree} M={self.num_microbatches} "
            f"{self.schedule}{v}"
        )


@dataclass(frozen=True)
class Group:
    """The D devices that hold one pipeline rank (its data-parallel replicas)."""

    devices: tuple[int, ...]
    speed: float
    limit_bytes: int
    link: Interconnect

    @property
    def kind(self) -> tuple[float, int]:
        return (self.speed, self.limit_bytes)


@dataclass(frozen=True)
class Split:
    """Stage ranges, recompute flags, and the group (rank) index of every stage."""

    ranges: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    groups: tuple[int, ...]


def usable_bytes(memory_bytes: int, training: TrainingSetup) -> int:
    """A device's memory less the margin, rounded as :func:`planner.costmodel.estimate` does."""
    return int(memory_bytes * (1 - training.memory_margin))


def make_groups(
    cluster: Cluster, training: TrainingSetup, data_parallel: int, pipeline_degree: int, *, default_layout: bool = False
) -> list[Group]:
    """The K device groups of a D x K mesh.

    Homogeneous clusters use :func:`planner.costmodel.default_devices` (replica d of rank k is
    device d·K + k).  Heterogeneous ones sort devices by speed, then memory (fastest and
    largest first), keep the first D·K and give each rank D consecutive ones, so a rank's
    replicas are alike; which rank takes which pipeline position is the solver's choice.
    ``default_layout`` keeps the homogeneous layout (what the baselines use).
    """
    k, d = pipeline_degree, data_parallel
    if cluster.homogeneous or default_layout:
        groups_devs = [tuple(r + j * k for j in range(d)) for r in range(k)]
    else:
        order = sorted(
            range(cluster.num_devices),
            key=lambda i: (-cluster.devices[i].speed, -cluster.devices[i].memory_bytes, i),
        )[: d * k]
        groups_devs = [tuple(sorted(order[r * d : (r + 1) * d])) for r in range(k)]
    out = []
    for devs in groups_devs:
        speed = min(cluster.devices[i].speed for i in devs)
        limit = usable_bytes(min(cluster.devices[i].memory_bytes for i in devs), training)
        same = all(cluster.same_node(devs[0], i) for i in devs)
        out.append(Group(devs, speed, limit, cluster.intra_node if same else cluster.inter_node))
    return out


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
        acts = self.costs.prefix_activation[b] - self.costs.prefix_activation[a]
        n = self.inflight[rank]
        stash = self.pmin_input[a]
        if rc:
            return static_bytes(params, self.training) + n * stash + acts
        return static_bytes(params, self.training) + n * acts


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


@dataclass(frozen=True)
class TransferBounds:
    """Split-independent lower bounds of the transfers on a v = 1 pipeline's paths.

    Every boundary moves at least the smallest cut of the model (over the link between
    those positions, or the faster link type when the positions' devices are not fixed):
    ``down[s]`` counts boundaries ``s..K-2`` forward and back (stage s's downstream path),
    ``up[s]`` boundaries before s one way (the forward path into stage s, and the
    gradient's way back).  Constant in the stage's end, so the stage test stays monotone.
    (:mod:`planner.chain_dp` counts every later stage's recompute and transfers exactly.)
    """

    down: tuple[float, ...]
    up: tuple[float, ...]
    #: per boundary, the (bandwidth, latency) of the link types its replicas cross; on a
    #: mixed cluster (positions' devices not fixed) both types, of which the faster counts
    links: tuple[tuple[tuple[float, float], ...], ...]

    @staticmethod
    def of(cluster: Cluster, costs: LayerCosts, groups: Sequence[Group]) -> TransferBounds:
        """For the pipeline positions of ``groups`` (position s holds ``groups[s]``)."""
        k = len(groups)
        cut = min(costs.cut_bytes[: max(1, costs.num_layers - 1)])
        intra = (cluster.intra_node.bandwidth_bytes_per_s, cluster.intra_node.latency_s)
        inter = (cluster.inter_node.bandwidth_bytes_per_s, cluster.inter_node.latency_s)
        links: list[tuple[tuple[float, float], ...]] = []
        hops = []
        for s in range(k - 1):
            if cluster.homogeneous:
                per_node = cluster.devices_per_node
                pairs = zip(groups[s].devices, groups[s + 1].devices, strict=True)
                crossed = {intra if x // per_node == y // per_node else inter for x, y in pairs}
                links.append(tuple(sorted(crossed)))
                hops.append(max(transfer_ms(cut, *li) for li in crossed))
            else:
                links.append((intra, inter))
                hops.append(min(transfer_ms(cut, *li) for li in (intra, inter)))
        down, up = [0.0] * k, [0.0] * k
        for s in range(k - 2, -1, -1):
            down[s] = down[s + 1] + 2 * hops[s]
        for s in range(1, k):
            up[s] = up[s - 1] + hops[s - 1]
        return TransferBounds(tuple(down), tuple(up), tuple(links))


# --------------------------------------------------------------------------- exact evaluation


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


def split_lower_bound(sm: StageModel, cluster: Cluster, groups: Sequence[Group], split: Split) -> float:
    """``max_r LB_r`` of the module doc: no simulation of this split can be faster."""
    cfg = sm.cfg
    k, m = cfg.pipeline_degree, cfg.num_microbatches
    ranges = list(split.ranges)
    n = len(ranges)
    placement = [list(groups[g].devices) for g in split.groups]
    xfer = boundary_transfer_ms(sm.costs, ranges, placement, cluster)
    speed = [groups[g].speed for g in split.groups]
    f = [(sm.F[b] - sm.F[a]) / speed[s] for s, (a, b) in enumerate(ranges)]
    bw = [(sm.B[b] - sm.B[a]) / speed[s] + (f[s] if split.recompute[s] else 0.0) for s, (a, b) in enumerate(ranges)]
    in_f = [0.0] * n
    out_b = [0.0] * n
    for s in range(1, n):
        in_f[s] = in_f[s - 1] + f[s - 1] + xfer[s - 1]
        out_b[s] = out_b[s - 1] + bw[s - 1] + xfer[s - 1]
    # downstream path after stage s: all later stages forward and backward plus transfers twice
    down = [0.0] * n
    for s in range(n - 2, -1, -1):
        down[s] = down[s + 1] + f[s + 1] + bw[s + 1] + 2 * xfer[s]
    best = 0.0
    for r in range(k):
        own = [s for s in range(n) if s % k == r]
        first = own[0]
        work = m * sum(f[s] + bw[s] for s in own)
        if len(own) == 1:
            ar = sm.allreduce(*ranges[first], groups[split.groups[first]])
        else:
            grad = sum(sm.PP[ranges[s][1]] - sm.PP[ranges[s][0]] for s in own) * sm.grad_factor
            link = groups[split.groups[first]].link
            ar = allreduce_ms(grad, cfg.data_parallel, link.bandwidth_bytes_per_s, link.latency_s)
        tail = max(out_b[first], ar)
        idle = 0.0
        if cfg.schedule == "1f1b":
            w = min(k - r - 1, m)
            idle = max(0.0, down[first] - w * bw[first])
            if m >= w + 2:
                # the wait for the first backward too: between F(0) and B(0) the rank runs
                # only its w warm-up forwards, and that interval ends before F(M-1) starts
                idle += max(0.0, down[first] - w * f[first])
        elif cfg.schedule == "gpipe":
            idle = max(0.0, down[first] - (m - 1) * f[first])
        else:
            # interleaved: before the forward of chunk j on micro-batch 0 the rank has run
            # exactly K forwards of each earlier chunk (they are all in its warm-up), so
            # from that start it still has M·c_r minus those forwards to do
            done = 0.0
            for j, s in enumerate(own):
                if j > 0:
                    best = max(best, in_f[s] + work - done + tail)
                done += k * f[s]
        best = max(best, in_f[first] + work + idle + tail)
    return best
