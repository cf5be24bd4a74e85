"""The split model: a configuration's stages, their time and memory tests, and exact evaluation.

Everything here works on :func:`planner.cost.layer_costs` prefix sums; the event
simulator is only run (through :func:`quick_step`) on a few finished candidates.

A *split* (:class:`Split`) of a configuration (:class:`planner.search.space.Config`) is K·v
contiguous ``[start, stop)`` layer ranges plus a recompute flag per stage and the group (rank)
of every stage.  :class:`StageModel` answers a stage's work, all-reduce and memory from prefix
sums; :func:`split_memory_ok` and :func:`quick_step` decide a split exactly as
:func:`planner.cost.estimate` would.  :func:`farthest` and :func:`bisect_feasible` are the
two searches every bound and split search is built on (largest passing stage end; least
passing step time).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.cost import (
    LayerCosts,
    RankTerms,
    allreduce_ms,
    boundary_transfer_ms,
    held_bytes,
    planned_actions,
    rank_memory_from_terms,
    rank_memory_terms,
    stage_times,
    static_bytes,
    step_temporary_bytes,
)
from planner.schedules import (
    SPLIT_BACKWARD,
    RankWalk,
    closed_form_walks,
    first_backward_counts,
    memory_points,
    placement_of,
    rank_stages,
    schedule_actions,
    stage_ranks,
)
from planner.schema import Cluster, PlanOptions, Schedule, TrainingSetup
from planner.search.space import Config, Group
from planner.simulator import CompiledSchedule, compile_actions, compile_schedule, makespans

#: the memory points of each rank of a schedule shape (:func:`planner.schedules.memory_points`)
RankPoints = list[RankWalk]

#: relative precision of the bottleneck binary searches
REL_TOL = 1e-6


@dataclass(frozen=True)
class Split:
    """Stage ranges, recompute flags, and the group (rank) index of every stage."""

    ranges: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    groups: tuple[int, ...]


class StageModel:
    """Per-stage time and memory tests of one configuration, from prefix sums.

    Stage ``s`` runs on rank ``owner[s]`` (the schedule's placement) as that rank's chunk
    ``chunk[s]``.  Exact memory walks the schedule's action list (its memory points, computed
    on first use, or given by ``points`` from the search's cache); the bounds use the closed
    forms of :func:`planner.schedules.first_backward_counts` (``count[s]``: micro-batches of
    stage ``s`` in flight when its rank starts its first backward), a lower bound.
    """

    def __init__(
        self,
        costs: LayerCosts,
        cfg: Config,
        training: TrainingSetup,
        *,
        points: Callable[[], RankPoints] | None = None,
    ) -> None:
        self.costs = costs
        self.cfg = cfg
        self.training = training
        self.L = costs.num_layers
        self.F = costs.prefix_forward
        #: prefix sums of what a recompute re-runs (the forward less ZeRO-3's gather)
        self.R = costs.prefix_recompute
        self.B = costs.prefix_backward
        self.I = costs.prefix_input
        self.W = costs.prefix_weight
        # per layer, the cheaper of its backward and its input gradient (what can carry a
        # gradient through it), summed: a lower bound of any stage's gradient path
        self.G = costs.prefix_grad
        self.PP = costs.prefix_param
        self.grad_factor = training.gradient_bytes_per_param_byte
        #: the share of the gradient collective that adds to the step (the rest overlaps the backward)
        self.ar_exposed = 1.0 - training.gradient_overlap
        # prefix minimum of the stage-input bytes over starts 1..a (starts >= 1 only):
        # a lower bound of the recompute stash that shrinks as the start moves right.
        pmin = [costs.input_bytes] * (self.L + 1)
        cur = math.inf
        for a in range(1, self.L + 1):
            if a < self.L:
                cur = min(cur, costs.stage_input_bytes(a))
            pmin[a] = cur if cur < math.inf else 0.0
        self.pmin_input = pmin
        k, v = cfg.pipeline_degree, cfg.virtual_stages
        placement = placement_of(cfg.schedule)
        self.owner = stage_ranks(placement, k, v)
        self.rank_stages = rank_stages(placement, k, v)
        self.chunk = [0] * (k * v)
        for own in self.rank_stages:
            for j, s in enumerate(own):
                self.chunk[s] = j
        self.counts = StageModel.counts_of(cfg, costs.num_layers)
        self.count = [self.counts[self.owner[s]][self.chunk[s]] for s in range(k * v)]
        #: lower bound of the micro-batches a one-chunk rank holds (v = 1; its stage's count)
        self.inflight = [min(c) for c in self.counts]
        self._points_source = points
        self._points: RankPoints | None = None
        self._totals: list[tuple[int, bool]] | None = None

    @staticmethod
    def counts_of(cfg: Config, num_layers: int) -> list[tuple[int, ...]]:
        """Per rank and chunk, the closed-form in-flight counts the bounds use: the moment of
        each rank's first backward; for a :func:`conservative` configuration the warm-up count
        of its closed form, which holds for every chunk there."""
        k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
        if conservative(cfg, num_layers):
            return [(min((k - r - 1) * 2 + (v - 1) * k + 1, m * v),) * v for r in range(k)]
        return first_backward_counts(cfg.schedule, k, m, v)

    @staticmethod
    def joint_of(cfg: Config, num_layers: int) -> list[float]:
        """Per rank, a count ``g`` such that its chunks that keep their activations hold at
        most ``free / g`` bytes together (:class:`RankCounts`)."""
        counts = StageModel.counts_of(cfg, num_layers)
        if conservative(cfg, num_layers):
            return [c[0] / cfg.virtual_stages for c in counts]
        return [float(max(1, min(c))) for c in counts]

    @property
    def split_backward(self) -> bool:
        return self.cfg.schedule in SPLIT_BACKWARD

    @property
    def points(self) -> RankPoints:
        """Each rank's memory points (not for ``planned``, whose order depends on the split)."""
        if self._points is None:
            if self._points_source is not None:
                self._points = self._points_source()
            else:
                self._points = search_points(self.cfg, self.L)
        return self._points

    # ------------------------------------------------------------------ time

    def work_ms(self, a: int, b: int, rc: bool, speed: float) -> float:
        """Forward + backward (+ recompute) of one micro-batch on stage [a, b) (a split
        backward's two parts take at least as long: :func:`planner.cost.split_backward`)."""
        f = self.F[b] - self.F[a] + (self.R[b] - self.R[a] if rc else 0.0)
        return f / speed + (self.B[b] - self.B[a]) / speed

    def pre_gradient_ms(self, a: int, b: int, rc: bool, speed: float) -> float:
        """Of :meth:`work_ms`, what must run before the micro-batch's gradient leaves the
        stage: all of it, except the weight gradient of a split backward (its cheaper of
        the backward and the input gradient then)."""
        if not self.split_backward:
            return self.work_ms(a, b, rc, speed)
        f = self.F[b] - self.F[a] + (self.R[b] - self.R[a] if rc else 0.0)
        return (f + min(self.B[b] - self.B[a], self.I[b] - self.I[a])) / speed

    def gradient_prefix(self, a: int) -> float:
        """Least time (speed 1) for a gradient to cross layers ``0..a-1``: per layer the
        cheaper of its backward and its input gradient in split-backward schedules, else
        their backwards."""
        return self.G[a] if self.split_backward else self.B[a]

    def stage_value(self, in_f: float, out_b: float, a: int, b: int, rc: bool, speed: float, ar: float) -> float:
        """``in_f + max(M·work + allreduce, M·pre_gradient + out_b)``: the split bound of a
        one-chunk rank holding [a, b) without its schedule's forced idle
        (:mod:`planner.bounds.split`); ``out_b`` is the gradient's path back from the stage."""
        m = self.cfg.num_microbatches
        work = m * self.work_ms(a, b, rc, speed)
        if not self.split_backward:
            return in_f + work + max(ar, out_b)
        return in_f + max(work + ar, m * self.pre_gradient_ms(a, b, rc, speed) + out_b)

    def allreduce(self, a: int, b: int, group: Group) -> float:
        grad = (self.PP[b] - self.PP[a]) * self.grad_factor
        link = group.link
        return allreduce_ms(grad, self.cfg.data_parallel, link.bandwidth_bytes_per_s, link.latency_s) * self.ar_exposed

    # ------------------------------------------------------------------ memory

    def memory_upper(self, rank: int, chunks: Sequence[tuple[int, int]], recompute: Sequence[bool]) -> float:
        """An upper bound of ``rank``'s peak holding ``chunks`` (its first chunks; later ones
        empty), in O(v): the most micro-batches its walk holds at once times its largest
        chunk's bytes, as the interleaved cost model had it (for the chunk searches' inner
        loops; the split they find is then checked exactly)."""
        if self._totals is None:
            self._totals = [
                (
                    max((sum(p.coef) for p in walk), default=0),  # micro-batches held at once
                    any(any(p.weight) for p in walk),  # whether any waits for a weight gradient
                )
                for walk in self.points
            ]
        most, weights = self._totals[rank]
        pa, pw, pp = self.costs.prefix_activation, self.costs.prefix_weight_grad, self.PP
        per = live = 0.0
        params = 0
        for (a, b), rc in zip(chunks, recompute, strict=True):
            act = self.costs.stage_activation_bytes(a, b) if self.costs.kept_inputs else pa[b] - pa[a]
            params += pp[b] - pp[a]
            held = self.costs.checkpoint_bytes(a, b) if rc else act
            if rc and act > live:
                live = act  # at least the largest checkpointed layer
            if weights and pw[b] - pw[a] > held:
                held = pw[b] - pw[a]
            if held > per:
                per = held
        return static_bytes(params, self.training) + max(most * per + live, step_temporary_bytes(params, self.training))

    def memory(self, a: int, b: int, rc: bool, rank: int) -> float:
        """Exact peak of a one-chunk rank holding stage [a, b) (v = 1)."""
        terms = rank_memory_terms(self.costs, [(a, b)], self.training)
        if self.cfg.schedule == "planned":
            return planned_memory(terms, rc)
        return rank_memory_from_terms(terms, [rc], self.points[rank])

    def memory_relaxed(self, a: int, b: int, rc: bool, stage: int) -> float:
        """A lower bound of stage ``stage``'s rank's memory when the stage is [a, b), monotone
        in both ends (for proofs)."""
        params = self.PP[b] - self.PP[a]
        acts = max(0.0, self.costs.prefix_activation[b] - self.costs.prefix_activation[a] - self.costs.activation_slack)
        n = self.count[stage]
        stash = self.pmin_input[a]
        # the optimizer step's temporaries, held when the activations are not (monotone too)
        step = step_temporary_bytes(params, self.training)
        if rc:
            # checkpointed layer by layer: it keeps at least its input, and its backward
            # re-materialises its largest layer (monotone in both ends, as the range)
            live = self.costs.max_activation(a, b)
            if self.cfg.virtual_stages == 1:
                return static_bytes(params, self.training) + max(n * stash + live, step)
            # several chunks: the first-backward moment may be another chunk's backward; the
            # stage's own backward holds its micro-batch's input and the live layer
            return static_bytes(params, self.training) + max(n * stash, stash + live, step)
        return static_bytes(params, self.training) + max(n * acts, step)


@dataclass(frozen=True)
class RankCounts:
    """What the memory bounds know of a rank's walk: for each chunk j, a micro-batch count
    ``per_chunk[j]`` it holds at some moment (so a chunk that keeps its activations ``a_j``
    needs ``per_chunk[j]·a_j`` bytes), and ``joint``, a count such that the chunks that keep
    their activations hold at most ``free / joint`` bytes together."""

    per_chunk: tuple[int, ...]
    joint: float


def closed_counts(cfg: Config, num_layers: int) -> list[RankCounts]:
    """:class:`RankCounts` from the closed forms (the moment of each rank's first backward)."""
    return [
        RankCounts(c, max(1.0, j)) for c, j in zip(StageModel.counts_of(cfg, num_layers), StageModel.joint_of(cfg, num_layers), strict=True)
    ]


#: interleaved 1F1B schedules with more actions than this are searched with the closed-form
#: memory of :func:`planner.schedules.closed_form_walks` (see :func:`conservative`)
EXACT_WALK_LIMIT = 256
#: models of at most this many layers are always searched with the exact walk (small
#: instances are solved exactly, against brute force over every plan)
SMALL_MODEL_LAYERS = 16


def conservative(cfg: Config, num_layers: int) -> bool:
    """Whether the search keeps ``cfg`` to a conservative memory model: an interleaved 1F1B
    schedule of more than ``EXACT_WALK_LIMIT`` actions on a model of more than
    ``SMALL_MODEL_LAYERS`` layers is searched, and bounded, with its closed form (the
    warm-up count times its largest chunk's footprint, an upper bound of its walk, the older
    cost model's), so its long walk is not listed and its bounds stay as strong as they were.
    Its plans fit exactly too (their memory, walked by :func:`planner.cost.estimate`, can
    only be lower); the search's space, and so its gap, covers the interleaved 1F1B plans
    fitting that closed form (a documented limit, like the largest micro-batch it
    extrapolates to).  Small models are searched with the exact walk."""
    return (
        cfg.schedule == "interleaved-1f1b"
        and num_layers > SMALL_MODEL_LAYERS
        and 2 * cfg.num_microbatches * cfg.num_stages > EXACT_WALK_LIMIT
    )


def walk_counts(points: RankPoints) -> list[RankCounts]:
    """:class:`RankCounts` from each rank's memory walk: per chunk its largest count; jointly,
    the best mixture of two moments (any mixture of the moments' constraints
    ``sum_j n_{p,j}·a_j <= free`` is one too, and gives ``sum_j a_j <= free / min_j c_j``)."""
    out = []
    for pts in points:
        v = len(pts[0].forward) if pts else 1
        per = tuple(max(1, max((p.forward[j] for p in pts), default=1)) for j in range(v))
        joint: float = max((min(p.forward) for p in pts), default=1)
        if v > 1:
            # mixtures of the moments that hold most of one chunk, or most of every chunk
            tops = {max(pts, key=lambda p, j=j: (p.forward[j], min(p.forward))) for j in range(v)}  # type: ignore[misc]
            tops.add(max(pts, key=lambda p: (min(p.forward), sum(p.forward))))
            for p, q in itertools.combinations(sorted(tops, key=lambda p: (p.forward, p.weight, p.live)), 2):
                # min_j (lam·p_j + (1-lam)·q_j) is concave in lam: check where two lines cross
                lams = {0.0, 1.0}
                for i, j in itertools.combinations(range(v), 2):
                    den = (p.forward[i] - q.forward[i]) - (p.forward[j] - q.forward[j])
                    if den:
                        lam = (q.forward[j] - q.forward[i]) / den
                        if 0.0 < lam < 1.0:
                            lams.add(lam)
                for lam in lams:
                    joint = max(joint, min(lam * a + (1 - lam) * b for a, b in zip(p.forward, q.forward, strict=True)))
        out.append(RankCounts(per, max(1.0, float(joint))))
    return out


def search_points(cfg: Config, num_layers: int) -> RankPoints:
    """The memory points the search uses for ``cfg``: closed forms where they are exact
    (GPipe, 1F1B) or where the search is :func:`conservative`, else the walk."""
    if cfg.schedule in ("gpipe", "1f1b") or conservative(cfg, num_layers):
        closed = closed_form_walks(*cfg.shape)
        assert closed is not None
        return closed
    return schedule_points(cfg)


def schedule_points(cfg: Config) -> RankPoints:
    """The memory points of every rank of ``cfg``'s (template) schedule."""
    k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
    orders = schedule_actions(cfg.schedule, k, m, v)
    return memory_points(orders, rank_stages(placement_of(cfg.schedule), k, v))


def planned_memory(terms: RankTerms, rc: bool) -> float:
    """What a ``planned`` one-chunk rank needs at least and, by construction, at most when it
    fits: one micro-batch (its forward's bytes plus its backward's live bytes, or what its
    weight gradient holds), or the optimizer step's temporaries when larger."""
    hf, hw, live = held_bytes(terms, [rc])
    return terms.static + max(hf[0] + live[0], hw[0], terms.step)


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
    """The step time :func:`planner.cost.estimate` would predict, without building a Plan.

    Uses the cost model's times, transfers and all-reduce and the simulator's schedules
    (compiled once per shape into ``compiled``; ``planned`` is list-scheduled for the split);
    a test checks it against ``estimate`` so the two cannot drift apart.
    """
    cfg = sm.cfg
    k = cfg.pipeline_degree
    ranges = list(split.ranges)
    placement = [list(groups[g].devices) for g in split.groups]
    speed = [groups[g].speed for g in split.groups]
    times = stage_times(sm.costs, ranges, split.recompute, speed, boundary_transfer_ms(sm.costs, ranges, placement, cluster))
    if cfg.schedule == "planned":
        terms = [rank_memory_terms(sm.costs, [r], sm.training) for r in ranges]
        limits = [groups[g].limit_bytes for g in split.groups]
        orders = planned_actions(cfg.num_microbatches, times, terms, split.recompute, limits)
        program = compile_actions(orders, len(ranges), cfg.num_microbatches)
    else:
        key = cfg.shape
        if compiled is None:
            compiled = {}
        if key not in compiled:
            compiled[key] = compile_schedule(*key)
        program = compiled[key]
    finish = makespans(program, times.forward, times.backward, times.transfer, binput=times.input, bweight=times.weight)
    step = 0.0
    for r in range(k):
        own = sm.rank_stages[r]
        grad = sum(sm.PP[ranges[s][1]] - sm.PP[ranges[s][0]] for s in own) * sm.grad_factor
        link = groups[split.groups[own[0]]].link
        ar = allreduce_ms(grad, cfg.data_parallel, link.bandwidth_bytes_per_s, link.latency_s) * sm.ar_exposed
        step = max(step, finish[r] + ar)
    return step


def split_memory_ok(sm: StageModel, groups: Sequence[Group], split: Split) -> bool:
    """Every rank's predicted peak fits its group's usable memory (exactly as ``estimate``)."""
    for r, own in enumerate(sm.rank_stages):
        terms = rank_memory_terms(sm.costs, [split.ranges[s] for s in own], sm.training)
        rcs = [split.recompute[s] for s in own]
        if sm.cfg.schedule == "planned":
            mem = planned_memory(terms, rcs[0])
        else:
            mem = rank_memory_from_terms(terms, rcs, sm.points[r])
        if math.ceil(mem) > groups[split.groups[own[0]]].limit_bytes:
            return False
    return True
