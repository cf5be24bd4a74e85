"""The planner: the fastest plan that fits, with a proven bound on how far from optimal it is.

``solve(profile, cluster, training, options)`` searches the data-parallel degree D, the
pipeline degree K, the micro-batch count M (and so the micro-batch size), the schedule
(gpipe, 1f1b, interleaved-1f1b with v chunks), the stage boundaries, recompute per stage,
and, on heterogeneous clusters, which devices take which pipeline position.

Method (best-first branch and bound over configurations, see :mod:`planner.solver_core` for
the split bounds and :func:`_branch_and_bound` for the levels):

1. Every configuration (D, K, M, schedule, v) allowed by the options gets a closed-form lower
   bound (work, fill, all-reduce, :func:`memory_work_bound`: the recompute that memory
   forces, indivisible layers, the last stage).  The ``INCUMBENT_TRIES`` that promise most
   (the balanced-split estimate) are solved first; then the configuration with the smallest
   bound always advances next, and configurations whose bound reaches the best step time
   found are skipped.
2. Advancing a configuration first computes its strong bound: for v = 1 the exact bottleneck
   algorithm (binary search on the bound of :mod:`planner.solver_core`, with a farthest-reach
   greedy that is exact because the relaxed stage test is monotone), for v > 1
   :func:`memory_bounds` (the static-memory and per-chunk memory bounds); either may prove
   that nothing fits.  Once a plan is known, one test at its step time decides whether the
   configuration can beat it at all.  Configurations too large to simulate stop there.
3. Then it searches for a plan.  Small chains (few splits) are enumerated completely, in
   bound order, so their optimum is exact.  Longer ones (v = 1) get the greedy with the exact
   memory model, once plain, once with the schedule's fill and drain waits in the stage test,
   and for 1F1B once that also keeps the steady state's transfer cycles within the period;
   each split is simulated (:func:`planner.solver_core.quick_step`).  Interleaved
   configurations get time-balanced chunks, memory-aware chunks, and chunks with recompute
   chosen per chunk (:func:`interleaved_mixed_split`).
4. CP-SAT (:mod:`planner.solver_cpsat`) tightens the bounds of one-chunk configurations left
   open, with the stage boundaries as integer variables and element constraints on prefix
   sums, hinted by the greedy split.
5. The baselines' splits are candidates too, so the plan is never worse than any of them, and
   a hill climb moves the best plan's boundaries one layer at a time.

The returned plan comes out of :func:`planner.costmodel.estimate`.  ``optimal`` (gap 0) is
reported only when every configuration was solved to optimality or excluded by a bound;
otherwise the status is ``feasible`` and ``gap`` is ``(step - bound) / step`` for the
smallest bound still open.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.costmodel import (
    LayerCosts,
    allreduce_ms,
    boundary_transfer_ms,
    estimate,
    layer_costs,
    static_bytes,
)
from planner.errors import InputError
from planner.schema import (
    SCHEDULES,
    Cluster,
    Plan,
    PlanOptions,
    Profile,
    Schedule,
    SolverInfo,
    TrainingSetup,
    check_coverage,
)
from planner.simulator import CompiledSchedule
from planner.solver_core import (
    Config,
    Group,
    Split,
    StageModel,
    TransferBounds,
    farthest,
    make_groups,
    quick_step,
    recompute_options,
    split_lower_bound,
    split_memory_ok,
)

#: enumerate every split of a configuration when there are at most this many
ENUMERATE_LIMIT = 400
#: configurations solved in order of promise before the search turns best-first
INCUMBENT_TRIES = 6
#: largest number of chunks per device tried for interleaved-1f1b when v is free
MAX_VIRTUAL_STAGES = 4
#: share of the work budget the configuration search may use
SEARCH_SHARE = 0.6
#: share of the work budget the final boundary polish may use
POLISH_SHARE = 0.15
#: work units (about one simulated action, or one stage test) per second of time limit
WORK_PER_SECOND = 400_000.0
#: wall-clock safety net: stop searching after this multiple of the time limit regardless
WALL_SAFETY = 3.0
#: least time CP-SAT gets to tighten open bounds (seconds, within the time limit)
TIGHTEN_MIN_S = 0.25
#: configurations whose schedule has more actions (2 x M x stages) are not simulated
SIM_ACTION_LIMIT = 300_000
#: work units per simulated action (the compiled program runs about 5 actions per unit)
SIM_WORK = 0.2
#: micro-batch sizes beyond this multiple of the largest measured one are not tried (unless M is fixed)
MAX_EXTRAPOLATION = 2
#: relative precision of the bottleneck binary searches
REL_TOL = 1e-6
#: layers with a work density this many times the median are outliers (:func:`_outlier_layers`)
OUTLIER_DENSITY = 1.25
#: most outlier layers :func:`chunk_memory_bound` sets apart
MAX_OUTLIERS = 4
#: share of the work budget the boundary tables of :mod:`planner.chain_dp` may use
CHAIN_SHARE = 0.2
#: work units per entry of those tables (measured: about 7·10^6 entries a second), and per stage
CHAIN_WORK = 0.06
CHAIN_STAGE_WORK = 100
#: relative width at which a configuration's table bisection stops
CHAIN_TOL = 2e-4
#: most layer runs :class:`_Windows` lists (beyond, the chunk bound uses the knapsack alone)
WINDOW_LIMIT = 200_000
#: relative precision of :func:`chunk_memory_bound`'s bisection (each step costs K knapsack solves)
CHUNK_REL_TOL = 5e-4
#: relative precision of the configuration bounds' binary search (the bound only loses this much)
BOUND_REL_TOL = 2e-5


@dataclass
class _Search:
    profile: Profile
    cluster: Cluster
    training: TrainingSetup
    options: PlanOptions
    deadline: float
    costs: dict[int, LayerCosts] = field(default_factory=dict)
    best_step: float = math.inf
    best: tuple[Config, Split, list[Group]] | None = None
    open_bounds: list[float] = field(default_factory=list)
    #: configurations whose bound is below the best step, with that bound: CP-SAT's work
    open_configs: dict[Config, tuple[float, list[Group]]] = field(default_factory=dict)
    #: best split found per configuration (CP-SAT hints)
    best_split_of: dict[Config, Split] = field(default_factory=dict)
    best_step_of: dict[Config, float] = field(default_factory=dict)
    compiled: dict[tuple[Schedule, int, int, int], CompiledSchedule] = field(default_factory=dict)
    visited: int = 0
    pruned: int = 0
    infeasible: int = 0
    timed_out: bool = False
    too_big: int = 0
    pruned_after_visit: int = 0
    infeasible_after_visit: int = 0
    #: work done so far, in units of about one simulated action (deterministic, unlike time)
    work: float = 0.0
    work_budget: float = math.inf
    wall_stop: float = math.inf
    _param_bytes: int = -1
    #: per micro-batch size: the fractional-knapsack table of :func:`memory_work_bound`
    knapsacks: dict[int, _Knapsack] = field(default_factory=dict)
    #: per micro-batch size: the whole-layer window table of :func:`chunk_memory_bound`
    windows: dict[tuple[int, frozenset[int]], _Windows] = field(default_factory=dict)
    #: (micro-batch size, devices of each position): :class:`TransferBounds`
    transfer_bounds: dict[tuple[int, tuple[tuple[int, ...], ...]], TransferBounds] = field(default_factory=dict)
    #: per micro-batch size: :class:`_PinnedRanks`
    pinned: dict[int, _PinnedRanks] = field(default_factory=dict)
    #: configurations whose bound the boundary table has settled (CP-SAT cannot raise it)
    chain_done: set[Config] = field(default_factory=set)

    @property
    def profile_param_bytes(self) -> int:
        if self._param_bytes < 0:
            self._param_bytes = sum(layer.param_bytes for layer in self.profile.layers)
        return self._param_bytes

    def costs_at(self, b: int) -> LayerCosts:
        if b not in self.costs:
            self.costs[b] = layer_costs(self.profile, b)
        return self.costs[b]

    def knapsack_at(self, b: int) -> _Knapsack:
        if b not in self.knapsacks:
            self.knapsacks[b] = _Knapsack.of(self.costs_at(b))
        return self.knapsacks[b]

    def transfers_at(self, b: int, groups: Sequence[Group]) -> TransferBounds:
        """:class:`planner.solver_core.TransferBounds` of these pipeline positions, cached."""
        key = (b, tuple(g.devices for g in groups))
        if key not in self.transfer_bounds:
            self.transfer_bounds[key] = TransferBounds.of(self.cluster, self.costs_at(b), groups)
        return self.transfer_bounds[key]

    def windows_at(self, b: int, *, exclude: frozenset[int] = frozenset()) -> _Windows:
        """:class:`_Windows` at micro-batch size ``b``, without the runs through ``exclude``."""
        key = (b, exclude)
        if key not in self.windows:
            self.windows[key] = _Windows(self.costs_at(b), exclude=exclude)
        return self.windows[key]

    def offer(self, cfg: Config, split: Split, groups: list[Group], step: float) -> None:
        if step < self.best_step_of.get(cfg, math.inf):
            self.best_step_of[cfg] = step
            self.best_split_of[cfg] = split
        key = (step, cfg, split.ranges, split.recompute, split.groups)
        if self.best is None or key < (self.best_step, self.best[0], self.best[1].ranges, self.best[1].recompute, self.best[1].groups):
            self.best_step = step
            self.best = (cfg, split, groups)


def consider(search: _Search, sm: StageModel, groups: list[Group], split: Split) -> float:
    """Simulate ``split`` unless its lower bound already loses; offer it; its step (or inf)."""
    if split_lower_bound(sm, search.cluster, groups, split) >= search.best_step:
        return math.inf
    cfg = sm.cfg
    actions = 2 * cfg.num_microbatches * cfg.num_stages
    if cfg.shape not in search.compiled:
        search.work += actions  # compiling the schedule costs about 5 simulations
    step = quick_step(sm, search.cluster, groups, split, search.compiled)
    search.work += SIM_WORK * actions + 50
    search.offer(sm.cfg, split, groups, step)
    return step


# --------------------------------------------------------------------------- public API


def solve(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions | None = None,
) -> Plan:
    """The plan with the lowest predicted step time whose every stage fits its device.

    Raises :class:`planner.errors.InputError` for contradictory options and
    :class:`planner.errors.InfeasibleError` (with ``details``: ``layer``, ``layer_bytes``,
    ``min_memory_bytes``, ``min_devices``) when nothing fits.
    """
    options = options or PlanOptions()
    start = time.perf_counter()
    configs = enumerate_configs(profile, cluster, training, options)
    search = _Search(profile, cluster, training, options, deadline=start + options.time_limit_s)
    # Budgets count work, not seconds, so that the same input gives the same plan on any
    # machine and load; WORK_PER_SECOND makes them match the time limit on a 2-core host.
    # The configuration search stops at SEARCH_SHARE of it, leaving room for the baselines'
    # candidates, the polish, CP-SAT and the final estimate.
    search.work_budget = options.time_limit_s * WORK_PER_SECOND
    search.wall_stop = start + WALL_SAFETY * options.time_limit_s
    _branch_and_bound(search, configs)
    _seed_with_baselines(search, configs)
    _polish(search)
    _tighten_chains(search)
    if search.best is None:
        from planner.infeasible import diagnose

        raise diagnose(profile, cluster, training, options)
    from planner.solver_cpsat import tighten

    # CP-SAT gets what is left of the budget (at least TIGHTEN_MIN_S), in its deterministic time
    left = max(0.0, search.work_budget - search.work) / WORK_PER_SECOND
    tighten(search, configs, budget_s=max(TIGHTEN_MIN_S, min(left, options.time_limit_s)))
    cfg, split, groups = search.best
    bound = min([search.best_step, *search.open_bounds, *(b for b, _ in search.open_configs.values())])
    gap = max(0.0, (search.best_step - bound) / search.best_step) if search.best_step > 0 else 0.0
    if gap <= 1e-9:
        status, gap = "optimal", 0.0
    else:
        status = "feasible"
    message = (
        f"{len(configs)} configurations: {search.pruned} excluded by bounds, "
        f"{search.infeasible} proven not to fit, "
        f"{max(0, search.visited - search.pruned_after_visit - search.infeasible_after_visit)} solved"
        + (f"; {search.too_big} too large to simulate" if search.too_big else "")
        + ("; time limit reached" if search.timed_out else "")
    )
    plan = estimate(
        profile,
        cluster,
        training,
        list(split.ranges),
        num_microbatches=cfg.num_microbatches,
        schedule=cfg.schedule,
        recompute=list(split.recompute),
        data_parallel=cfg.data_parallel,
        pipeline_degree=cfg.pipeline_degree,
        devices=[list(groups[g].devices) for g in split.groups],
        solver=SolverInfo(status=status, gap=gap, wall_time_s=0.0, message=message),
    )
    if abs(plan.predicted.step_time_ms - search.best_step) > 1e-6 * max(1.0, search.best_step):
        raise AssertionError(  # pragma: no cover - quick_step and estimate are tested equal
            f"internal error: the solver predicted {search.best_step} ms but estimate gives "
            f"{plan.predicted.step_time_ms} ms; please report this input"
        )
    wall = time.perf_counter() - start
    return plan.model_copy(
        update={"solver": SolverInfo(status=status, gap=gap, wall_time_s=wall, message=message)}
    )


# --------------------------------------------------------------------------- configurations


def _divisors(x: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(x) + 1) if x % i == 0]
    return sorted(set(small + [x // i for i in small]))


def fixed_ranges(options: PlanOptions) -> list[tuple[int, int]] | None:
    if isinstance(options.stages, list):
        return [(r.start, r.stop) for r in options.stages]
    return None


def enumerate_configs(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions
) -> list[Config]:
    """Every (D, K, M, schedule, v) the options allow; :class:`InputError` if they contradict."""
    n, num_layers, g = cluster.num_devices, profile.num_layers, training.global_batch_size
    ranges = fixed_ranges(options)
    if ranges is not None:
        try:
            check_coverage(ranges, num_layers)
        except ValueError as err:
            raise InputError(f"invalid --stages: {err}") from None
    v_opt = options.virtual_stages
    if v_opt is not None and v_opt > 1 and options.schedule not in (None, "interleaved-1f1b"):
        raise InputError(
            f"virtual_stages={v_opt} needs schedule interleaved-1f1b, not {options.schedule!r}: "
            "drop the virtual stages or choose interleaved-1f1b"
        )
    if isinstance(options.stages, int):
        k = options.stages
        if k > n:
            raise InputError(
                f"stages={k} needs {k} devices but the cluster has {n}: use --stages {n} or fewer, "
                "or add devices"
            )
        if k > num_layers:
            raise InputError(
                f"stages={k} but the model has only {num_layers} layers: use --stages {num_layers} or fewer"
            )
    if options.data_parallel is not None:
        d = options.data_parallel
        if d > n:
            raise InputError(f"data_parallel={d} exceeds the {n} devices: use --data-parallel {n} or less")
        if g % d:
            raise InputError(
                f"data_parallel={d} does not divide the global batch {g}: choose one of {_divisors(g)[:12]}"
            )
    if options.num_microbatches is not None:
        m = options.num_microbatches
        ds = [options.data_parallel] if options.data_parallel else _divisors(g)
        if not any(g % (d * m) == 0 for d in ds):
            raise InputError(
                f"num_microbatches={m} does not split the global batch {g}"
                + (f" over data_parallel={options.data_parallel}" if options.data_parallel else "")
                + f": choose M dividing {g // (options.data_parallel or 1)}, e.g. "
                f"{_divisors(g // (options.data_parallel or 1))[:10]}"
            )
    if isinstance(options.recompute, list):
        count = len(options.recompute)
        if ranges is not None and count != len(ranges):
            raise InputError(
                f"recompute lists {count} flags for {len(ranges)} stages: give one per stage"
            )
        if isinstance(options.stages, int) and count != options.stages * (v_opt or 1):
            raise InputError(
                f"recompute lists {count} flags but stages={options.stages}: give one per stage"
            )
    # micro-batches larger than twice the largest measured size would be extrapolated far
    max_b = MAX_EXTRAPOLATION * profile.microbatch_sizes[-1]
    schedules: tuple[Schedule, ...] = (options.schedule,) if options.schedule else SCHEDULES
    if v_opt is not None and v_opt > 1:
        schedules = ("interleaved-1f1b",)
    out: list[Config] = []
    for d in ([options.data_parallel] if options.data_parallel else _divisors(g)):
        if d > n:
            continue
        for sched in schedules:
            for k, v in _pipeline_shapes(options, sched, n // d, num_layers, ranges):
                if k * d > n:
                    continue
                ms = [options.num_microbatches] if options.num_microbatches else [
                    x for x in _divisors(g // d) if g // (d * x) <= max_b
                ]
                for m in ms:
                    if g % (d * m):
                        continue
                    if sched == "interleaved-1f1b" and (k < 2 or m % k):
                        continue
                    if sched == "1f1b" and m < k:
                        continue  # torch's Schedule1F1B needs M >= K (simulator.check_schedule_shape)
                    if sched == "gpipe" and k == 1 and options.schedule is None:
                        continue  # identical to 1f1b with one stage, which keeps less in flight
                    out.append(Config(d, k, m, sched, v))
    if not out:
        raise InputError(_no_config_message(options, n, num_layers, g))
    return sorted(set(out))


def _pipeline_shapes(
    options: PlanOptions, sched: Schedule, max_k: int, num_layers: int, ranges: list[tuple[int, int]] | None
) -> list[tuple[int, int]]:
    """(K, v) pairs for a schedule."""
    v_opt = options.virtual_stages
    rc_len = len(options.recompute) if isinstance(options.recompute, list) else None
    shapes = []
    if sched != "interleaved-1f1b":
        if v_opt not in (None, 1):
            return []
        if ranges is not None:
            return [(len(ranges), 1)]
        ks = [options.stages] if isinstance(options.stages, int) else range(1, min(max_k, num_layers) + 1)
        return [(k, 1) for k in ks if rc_len is None or rc_len == k]
    vs = [v_opt] if v_opt else list(range(2, MAX_VIRTUAL_STAGES + 1))
    for v in vs:
        if ranges is not None:
            if len(ranges) % v == 0:
                shapes.append((len(ranges) // v, v))
            continue
        ks = [options.stages] if isinstance(options.stages, int) else range(2, min(max_k, num_layers // v) + 1)
        for k in ks:
            if k * v <= num_layers and (rc_len is None or rc_len == k * v):
                shapes.append((k, v))
    return shapes


def _no_config_message(options: PlanOptions, n: int, num_layers: int, g: int) -> str:
    fixed = {k: v for k, v in options.model_dump().items() if v is not None and k != "time_limit_s"}
    hint = "relax one of them"
    if options.schedule == "interleaved-1f1b":
        hint = (
            "interleaved-1f1b needs K >= 2 devices per pipeline, at least 2 chunks of layers per "
            "device and M a multiple of K: relax --microbatches or --stages, or choose 1f1b"
        )
    return (
        f"no configuration satisfies the options {fixed} on {n} devices, {num_layers} layers and "
        f"global batch {g}: {hint}"
    )


# --------------------------------------------------------------------------- bounds


def _work_total(costs: LayerCosts) -> float:
    return costs.prefix_forward[-1] + costs.prefix_backward[-1]


def cheap_bound(search: _Search, cfg: Config, groups: Sequence[Group]) -> float:
    """A closed-form lower bound of any split of ``cfg`` (no memory)."""
    costs = search.costs_at(cfg.microbatch_size(search.training.global_batch_size))
    w = _work_total(costs)
    m, k = cfg.num_microbatches, cfg.pipeline_degree
    smax = max(g.speed for g in groups)
    ssum = sum(g.speed for g in groups)
    bound = max(m * w / ssum, w / smax)
    # every rank r starts after the forward path through the stages before its first
    # stage (at least r layers) and ends after the backward path back: averaging the ranks'
    # bounds with weights speed_r / sum(speed) gives
    smin = min(g.speed for g in groups)
    first = sum(costs.prefix_forward[r] + costs.prefix_backward[r] for r in range(min(k, costs.num_layers)))
    bound = max(bound, m * w / ssum + smin * first / (ssum * smax))
    d = cfg.data_parallel
    if d > 1:
        # every rank all-reduces its gradients after its work: averaging finish + all-reduce
        # over the ranks (weights speed_r / sum(speed)) bounds the slowest from below
        link = max((g.link for g in groups), key=lambda li: (li.bandwidth_bytes_per_s, -li.latency_s))
        grads = costs.prefix_param[-1] * search.training.gradient_bytes_per_param_byte
        ar_all = (2 * (d - 1) / d * grads / link.bandwidth_bytes_per_s + k * 2 * (d - 1) * link.latency_s) * 1e3
        bound = max(bound, m * w / ssum + smin * ar_all / ssum)
    bound = max(bound, memory_work_bound(search, cfg, groups))
    # indivisible layers: some rank holds the heaviest ones (and all-reduces them)
    bound = max(bound, rank_allreduce_bound(search, cfg, groups))
    # the last stage holds the last layer and cannot start before micro-batch 0 has gone
    # forward through every earlier layer; then its rank still works at least M times that
    # layer (interleaved: its earlier chunks' warm-up forwards come out of its own work, see
    # solver_core), and without interleaving the gradient must also flow back through them
    n_l = costs.num_layers
    last = costs.prefix_forward[n_l] - costs.prefix_forward[n_l - 1] + costs.prefix_backward[n_l] - costs.prefix_backward[n_l - 1]
    path = costs.prefix_forward[n_l - 1] + (costs.prefix_backward[n_l - 1] if cfg.virtual_stages == 1 else 0.0)
    bound = max(bound, (path + m * last) / smax)
    if cfg.virtual_stages == 1 and m > 1:
        # continuous relaxation of min over splits of max_s (P[a_s] + M c_s): the reach
        # y_{s+1} = y_s + (T - y_s) / M gives T >= W / (1 - ((M-1)/M)^K)
        q = ((m - 1) / m) ** k
        bound = max(bound, w / smax / (1 - q))
    return bound


@dataclass(frozen=True)
class _Knapsack:
    """Layers sorted by work per activation byte (zero-activation layers first), with prefix
    sums: ``value(A)`` is the most forward + backward work (at speed 1) of any set of layers
    whose activations total at most ``A`` bytes, layers taken fractionally (an upper bound)."""

    acts: tuple[float, ...]
    prefix_acts: tuple[float, ...]
    prefix_work: tuple[float, ...]
    #: least recompute overhead per unit of work: min over layers of f / (f + b)
    phi: float
    work: float

    @staticmethod
    def of(costs: LayerCosts) -> _Knapsack:
        items = []
        phi = math.inf
        for f, b, a in zip(costs.forward_ms, costs.backward_ms, costs.activation_bytes, strict=True):
            w = f + b
            if w > 0:
                phi = min(phi, f / w)
            items.append((-(w / a) if a > 0 else -math.inf, a, w))
        items.sort()
        pa, pw = [0.0], [0.0]
        for _, a, w in items:
            pa.append(pa[-1] + a)
            pw.append(pw[-1] + w)
        return _Knapsack(
            tuple(a for _, a, _ in items), tuple(pa), tuple(pw), 0.0 if phi == math.inf else phi, pw[-1]
        )

    def value(self, capacity: float) -> float:
        i = bisect.bisect_right(self.prefix_acts, capacity) - 1  # prefix_acts[i] <= capacity
        if i >= len(self.acts):
            return self.prefix_work[-1]
        left = capacity - self.prefix_acts[i]
        a = self.acts[i]
        part = (self.prefix_work[i + 1] - self.prefix_work[i]) * min(1.0, left / a) if a > 0 else 0.0
        return self.prefix_work[i] + part

    def tangents(self, capacities: Sequence[float]) -> set[tuple[float, float]]:
        """Lines ``(alpha, beta)`` of the concave curve's segments at ``capacities``: for
        every capacity ``A``, ``value(A) <= alpha + beta·A`` (zero-activation items skipped)."""
        lines = set()
        for cap in capacities:
            i = min(max(0, bisect.bisect_right(self.prefix_acts, cap) - 1), len(self.acts) - 1)
            while i < len(self.acts) and self.acts[i] <= 0:
                i += 1
            if i < len(self.acts):
                beta = (self.prefix_work[i + 1] - self.prefix_work[i]) / self.acts[i]
                lines.add((self.prefix_work[i] - beta * self.prefix_acts[i], beta))
        return lines


class _Windows:
    """The most work one chunk can keep activations for: whole, contiguous layers.

    ``value(A)`` is the most forward + backward work (speed 1) of any run of consecutive
    layers whose activation bytes total at most ``A``: exact, where :meth:`_Knapsack.value`
    takes layers fractionally and from anywhere (a chunk cannot keep 1.9 layers).  The table
    lists every run up to the largest capacity asked so far (doubling on demand, at most
    ``WINDOW_LIMIT`` runs); past that, ``value`` answers infinity (no information), and the
    callers take the smaller of both bounds.
    """

    def __init__(self, costs: LayerCosts, *, exclude: frozenset[int] = frozenset()) -> None:
        self._exclude = exclude
        self._pa = costs.prefix_activation
        self._pw = [f + b for f, b in zip(costs.prefix_forward, costs.prefix_backward, strict=True)]
        self._n = costs.num_layers
        self._built = -1.0
        self._acts: list[float] = []
        self._best: list[float] = []

    def _build(self, capacity: float) -> None:
        import numpy as np  # only here: the service never builds this table at start-up

        pa, pw = np.asarray(self._pa), np.asarray(self._pw)
        n = self._n
        ok = np.ones(n + 1, dtype=bool)  # ok[b]: layer b - 1 may end a run (not excluded)
        for i in self._exclude:
            ok[i + 1] = False
        # blocked[b]: excluded layers among the first b (a run (a, b) is allowed when none
        # of layers a..b-1 is excluded, i.e. blocked[b] == blocked[a])
        blocked = np.concatenate(([0], np.cumsum(~ok[1:])))
        acts_parts, work_parts = [], []
        count = 0
        for length in range(1, n + 1):
            acts = pa[length:] - pa[:-length]
            if acts.min() > capacity:
                break  # every longer run holds one of these, so it is larger still
            keep = (acts <= capacity) & (blocked[length:] == blocked[:-length])
            count += int(keep.sum())
            if count > WINDOW_LIMIT:
                self._built, self._acts, self._best = math.inf, [], []
                return
            acts_parts.append(acts[keep])
            work_parts.append((pw[length:] - pw[:-length])[keep])
        if not acts_parts:
            self._built, self._acts, self._best = capacity, [], []
            return
        acts_all = np.concatenate(acts_parts)
        order = np.argsort(acts_all, kind="stable")
        best = np.maximum.accumulate(np.concatenate(work_parts)[order])
        self._built, self._acts, self._best = capacity, acts_all[order].tolist(), best.tolist()

    def reserve(self, capacity: float) -> None:
        """List the runs up to ``capacity`` now (one build instead of several doublings)."""
        cap = capacity * (1 + 1e-9) + 1e-6
        if cap > self._built:
            self._build(max(cap, 2 * self._built))

    def value(self, capacity: float) -> float:
        # tolerances keep float rounding of the prefix sums on the safe (larger) side
        cap = capacity * (1 + 1e-9) + 1e-6
        if cap > self._built:
            self._build(max(2 * cap, 2 * self._built))
        if self._built == math.inf:
            return math.inf  # too many runs to list: no information
        i = bisect.bisect_right(self._acts, cap)
        return self._best[i - 1] * (1 + 1e-12) if i else 0.0


def _outlier_layers(costs: LayerCosts) -> frozenset[int]:
    """The few layers (at most ``MAX_OUTLIERS``) whose work per activation byte exceeds
    ``OUTLIER_DENSITY`` times the median: an LM head or an embedding next to uniform blocks.

    Which layers are picked only changes how tight :func:`chunk_memory_bound` is, never
    whether it is valid."""
    dens = sorted(
        ((f + b) / a, i)
        for i, (f, b, a) in enumerate(zip(costs.forward_ms, costs.backward_ms, costs.activation_bytes, strict=True))
        if a > 0 and f + b > 0
    )
    if not dens:
        return frozenset()
    median = dens[len(dens) // 2][0]
    return frozenset(i for d, i in dens[::-1][:MAX_OUTLIERS] if d > OUTLIER_DENSITY * median)


def _state_per_work(costs: LayerCosts, training: TrainingSetup) -> float:
    """Least parameter-state bytes (parameters, gradients, optimizer) per unit of forward +
    backward work over the layers that do work (0 when none does)."""
    sigma = math.inf
    for f, bw, pb in zip(costs.forward_ms, costs.backward_ms, costs.param_bytes, strict=True):
        if f + bw > 0:
            sigma = min(sigma, static_bytes(pb, training) / (f + bw))
    return 0.0 if sigma == math.inf else sigma


def _recompute_freedom(options: PlanOptions) -> tuple[bool, bool]:
    """(some stage may keep its activations, some stage may recompute) under the options."""
    rc = options.recompute
    if isinstance(rc, bool):
        return not rc, rc
    if isinstance(rc, list):
        return not all(rc), any(rc)
    return True, True


class _PinnedRanks:
    """Least work (speed 1) and parameter bytes of the ranks :func:`rank_allreduce_bound`
    pins down, at one micro-batch size: rank 0 and rank K-1 (:meth:`ends`, per K and v),
    and per j the busiest rank holding j + 1 of the ``j·K + 1`` largest layers
    (:meth:`busiest`, per K).  Sorted once, cached per K."""

    def __init__(self, costs: LayerCosts) -> None:
        n = self.n = costs.num_layers
        self.work = [f + bw for f, bw in zip(costs.forward_ms, costs.backward_ms, strict=True)]
        self.params = [float(p) for p in costs.param_bytes]
        self.by_work = sorted(range(n), key=lambda i: (-self.work[i], i))
        # layers 1..n-2 (neither end), lightest first, with their index
        self.light_work = sorted((self.work[i], i) for i in range(1, n - 1))
        self.light_params = sorted((self.params[i], i) for i in range(1, n - 1))
        self._busiest: dict[int, tuple[tuple[float, float], ...]] = {}

    def ends(self, k: int, v: int) -> tuple[tuple[float, float], tuple[float, float]]:
        """(work, params) at least of rank 0 and of rank K-1 (K >= 2): the end layer and
        ``v - 1`` more (one per other chunk), rank K-1's from layer K-1 on."""
        extra = v - 1

        def lightest(pairs: list[tuple[float, int]], start: int) -> float:
            picked: list[float] = []
            for value, i in pairs:
                if len(picked) == extra:
                    break
                if i >= start:
                    picked.append(value)
            return sum(picked)

        n, work, params = self.n, self.work, self.params
        first = (work[0] + lightest(self.light_work, 1), params[0] + lightest(self.light_params, 1))
        last = (work[n - 1] + lightest(self.light_work, k - 1), params[n - 1] + lightest(self.light_params, k - 1))
        return first, last

    def busiest(self, k: int) -> tuple[tuple[float, float], ...]:
        if k not in self._busiest:
            seen: list[float] = []  # parameters of the largest layers so far, sorted
            out = []
            for j in range((self.n - 1) // k + 1):
                for i in self.by_work[len(seen) : j * k + 1]:
                    bisect.insort(seen, self.params[i])
                top = self.by_work[j * k + 1 - (j + 1) : j * k + 1]
                out.append((sum(self.work[i] for i in top), sum(seen[: j + 1])))
            self._busiest[k] = tuple(out)
        return self._busiest[k]


def rank_allreduce_bound(search: _Search, cfg: Config, groups: Sequence[Group]) -> float:
    """Ranks known in part, with their gradient all-reduce.

    A rank runs its M micro-batches and then all-reduces its gradients (the step is the
    latest finish plus all-reduce), so ``T >= in_f + M·work_r / speed + max(out_b,
    allreduce(params_r))`` for every rank r.  Three ranks are pinned down whatever the split
    (:class:`_PinnedRanks`):

    * rank 0 holds layer 0 and, one per other chunk, at least v - 1 more layers (not the
      last one, which is on rank K-1 when K >= 2);
    * rank K-1 holds the last layer and v - 1 more from layer K-1 on; its first stage comes
      after at least K - 1 layers, forward on the way in and backward on the gradient's way
      back (plus the least transfers of :class:`planner.solver_core.TransferBounds`);
    * the busiest rank: layers cannot be divided, so among the ``j·K + 1`` largest layers
      some rank holds j + 1, and works at least the j + 1 smallest of them (j = 0: the
      largest layer), with at least the j + 1 smallest parameters among them.

    Work and parameters are bounded separately (the lightest layers for each); the
    all-reduce uses the fastest link of any group.  With one rank it holds every layer.
    """
    b = cfg.microbatch_size(search.training.global_batch_size)
    costs = search.costs_at(b)
    k, m, v, d = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages, cfg.data_parallel
    if b not in search.pinned:
        search.pinned[b] = _PinnedRanks(costs)
    pinned = search.pinned[b]
    smax = max(g.speed for g in groups)
    link = max((g.link for g in groups), key=lambda li: (li.bandwidth_bytes_per_s, -li.latency_s))
    factor = search.training.gradient_bytes_per_param_byte

    def rank_bound(path_f: float, path_b: float, work_params: tuple[float, float]) -> float:
        grads = work_params[1] * factor
        ar = allreduce_ms(grads, d, link.bandwidth_bytes_per_s, link.latency_s)
        return path_f + m * work_params[0] / smax + max(path_b, ar)

    if k == 1:  # one rank holds every layer
        return rank_bound(0.0, 0.0, (sum(pinned.work), sum(pinned.params)))
    first, last = pinned.ends(k, v)
    bound = max(rank_bound(0.0, 0.0, first), *(rank_bound(0.0, 0.0, x) for x in pinned.busiest(k)))
    up = search.transfers_at(b, groups).up
    fill_f = costs.prefix_forward[k - 1] / smax + up[k - 1]
    fill_b = costs.prefix_backward[k - 1] / smax + up[k - 1]
    return max(bound, rank_bound(fill_f, fill_b, last))


def memory_work_bound(search: _Search, cfg: Config, groups: Sequence[Group]) -> float:
    """A lower bound of any split of ``cfg`` that counts the recompute memory forces.

    Rank ``r`` holds ``n_r`` micro-batches in flight, so each of its chunks that does not
    recompute keeps at most ``limit / n_r`` activation bytes, and its (at most v) such chunks
    at most ``A_r = v · limit / n_r`` (``limit``: the largest usable memory of any group).
    Work of a recomputed layer costs ``1 + phi`` times its forward + backward
    (``phi = min f / (f + b)``).  Rank ``r`` runs ``M`` micro-batches within ``T``, so it
    does at most ``t_r = T · speed_r / M`` of work (counting recompute).  For any set ``S`` of
    ranks, the work done without recompute is at most ``sum_{r in S} t_r`` plus the knapsack
    value (most work per activation byte, fractional) of the other ranks' capacities
    ``sum_{r not in S} A_r``; the rest of the model ``W`` is recomputed.  Taking ``S`` = the j
    ranks with the largest ``A_r`` and the j fastest speeds (valid for every assignment of
    groups to positions), covering ``W`` needs, for every j,

        T >= M · ((1 + phi)·W - phi·kappa_j) / (sum(speed) + phi·sigma_j)

    with ``kappa_j`` the knapsack value of the K - j smallest capacities and ``sigma_j`` the
    sum of the j largest speeds.  Without recompute allowed, ``T >= M (W - kappa_j) / sigma_j``
    (infinite when ``kappa_0 < W``: nothing fits).  Transfers, bubbles and all-reduce only
    add to the step time, so they are left out.
    """
    b = cfg.microbatch_size(search.training.global_batch_size)
    knap = search.knapsack_at(b)
    k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
    limit = max(g.limit_bytes for g in groups)
    caps = sorted(
        (v * limit / max(1, StageModel.inflight_of(cfg, r)) for r in range(k)), reverse=True
    )
    speeds = sorted((g.speed for g in groups), reverse=True)
    ssum = sum(speeds)
    keep_allowed, allow_rc = _recompute_freedom(search.options)
    all_rc = not keep_allowed
    w, phi = knap.work, knap.phi
    if all_rc:
        return m * (1 + phi) * w / ssum
    best = 0.0
    suffix = 0.0  # sum of the K - j smallest capacities, j from K down to 0
    sigma = [0.0]
    for sp in speeds:
        sigma.append(sigma[-1] + sp)
    # every rank's parameters, gradients and optimizer state take memory that its
    # activations cannot use: the ranks outside S hold at least static - j·limit of it, which
    # costs them at least v / n_max activation bytes per byte
    static = static_bytes(search.profile_param_bytes, search.training)
    n_max = max(StageModel.inflight_of(cfg, r) for r in range(k))
    for j in range(k, -1, -1):
        if j < k:
            suffix += caps[j]
        kappa = knap.value(max(0.0, suffix - v * max(0.0, static - j * limit) / max(1, n_max)))
        if allow_rc:
            best = max(best, m * ((1 + phi) * w - phi * kappa) / (ssum + phi * sigma[j]))
        elif kappa < w * (1 - 1e-12):
            if sigma[j] <= 0:
                return math.inf
            best = max(best, m * (w - kappa) / sigma[j])
    return best


def static_memory_bound(search: _Search, cfg: Config, groups: Sequence[Group]) -> float:
    """:func:`memory_work_bound` with each rank's parameter state taken out of its memory.

    A rank holding work ``y_r`` (forward + backward at speed 1 of its layers) keeps at least
    ``sigma·y_r`` bytes of parameters, gradients and optimizer state (``sigma``: least state
    bytes per unit of work over the layers), so its chunks without recompute keep at most
    ``a_r = v (limit - sigma·y_r) / n_r`` activation bytes.  The work done without recompute,
    over all ranks, is at most the knapsack value of ``sum a_r``, and so at most
    ``alpha + beta·sum a_r`` for any line ``(alpha, beta)`` of the concave knapsack curve.
    A rank with work ``y_r`` of which ``z_r`` is recomputed needs ``y_r + phi·z_r <= t_r =
    T·speed/M``.  Hence ``sum_r (y_r - z_r) + gamma_r·y_r <= C`` with ``gamma_r = beta·v·sigma/n_r``
    and ``C = alpha + beta·v·limit·sum 1/n_r``: each rank's use of ``C`` is convex piecewise
    linear in ``y_r`` (``gamma_r`` per unit up to ``t_r/(1+phi)``, all recomputed, then
    ``1 + gamma_r + 1/phi``), so the most work the ranks can cover within ``T`` is a
    fractional greedy over those pieces.  The bound is the least ``T`` (bisection) at which
    it reaches the model's work ``W``; the largest over a few knapsack lines is returned
    (infinite when no ``T`` covers ``W``: nothing fits).  Heterogeneous speeds use the
    fastest for every rank.
    """
    b = cfg.microbatch_size(search.training.global_batch_size)
    knap = search.knapsack_at(b)
    costs = search.costs_at(b)
    k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
    limit = max(g.limit_bytes for g in groups)
    smax = max(g.speed for g in groups)
    inflight = [max(1, StageModel.inflight_of(cfg, r)) for r in range(k)]
    sigma = _state_per_work(costs, search.training)
    keep_allowed, allow_rc = _recompute_freedom(search.options)
    if not keep_allowed:
        return 0.0  # everything recomputed: memory_work_bound already counts it exactly
    w, phi = knap.work, knap.phi
    if w <= 0:
        return 0.0
    inv = sum(1.0 / n for n in inflight)
    a_star = v * limit * inv
    lines = knap.tangents([a_star * theta for theta in (1.0, 0.5, 0.15)])

    best = 0.0
    for alpha, beta in sorted(lines):
        cap = alpha + beta * v * limit * inv
        gammas = [beta * v * sigma / n for n in inflight]

        def coverable(t: float, cap: float = cap, gammas: list[float] = gammas) -> float:
            pieces: list[tuple[float, float]] = []
            for g_r in gammas:
                if not allow_rc:
                    pieces.append((1 + g_r, t))
                elif phi <= 0:
                    pieces.append((g_r, t))
                else:
                    pieces.append((g_r, t / (1 + phi)))
                    pieces.append((1 + g_r + 1 / phi, t - t / (1 + phi)))
            pieces.sort()
            left, total = cap, 0.0
            for cost, amount in pieces:
                if cost <= 0:
                    total += amount
                    continue
                take = min(amount, left / cost)
                total += take
                left -= take * cost
                if left <= 0:
                    break
            return total

        def per_rank(t: float, alpha: float = alpha, beta: float = beta) -> float:
            total = 0.0
            for n in inflight:
                big_p = alpha + beta * v * limit / n
                big_q = beta * v * sigma / n
                y_cap = limit / sigma if sigma > 0 else math.inf
                if big_p - big_q * t >= t:
                    y = t
                elif not allow_rc:
                    y = big_p / (1 + big_q)
                elif phi <= 0:
                    y = t
                else:
                    y = (t + phi * big_p) / (1 + phi + phi * big_q)
                    if big_p - big_q * y < 0:
                        y = t / (1 + phi)
                total += max(0.0, min(y, t, y_cap))
            return total

        for cover in (coverable, per_rank):
            # per-rank budget t = T·smax/M; coverage is nondecreasing in t
            lo, hi = 0.0, w / k
            while cover(hi) < w * (1 - 1e-12):
                if hi > w * 1e6:
                    return math.inf
                lo, hi = hi, hi * 2
            for _ in range(40):
                if hi - lo <= 1e-9 * hi:
                    break
                mid = (lo + hi) / 2
                if cover(mid) >= w * (1 - 1e-12):
                    hi = mid
                else:
                    lo = mid
            best = max(best, lo * m / smax)
    return best


def chunk_memory_bound(
    search: _Search, cfg: Config, groups: Sequence[Group], *, lo: float = 0.0, cutoff: float = math.inf
) -> float:
    """A lower bound of any split of ``cfg`` from each rank's memory, chunk by chunk.

    ``lo`` is a known lower bound (it starts the bisection); with a finite ``cutoff`` (the
    best step time so far) a bound at or above it is returned as ``cutoff`` after one test,
    since then only "not better" matters.

    Rank ``r`` holds ``n_r`` micro-batches in flight and v chunks.  With ``y_r`` its work
    (forward + backward at speed 1) and ``u_r`` the work of its chunks that keep their
    activations, the cost model gives, for every split:

    * its parameter state is at least ``sigma·y_r`` (``sigma``: least state bytes per unit
      of work over the layers), so every chunk that keeps its activations keeps at most
      ``A_r = (limit - sigma·y_r) / n_r`` activation bytes, and works at most ``kappa(A_r)``,
      the smaller of the fractional knapsack of :class:`_Knapsack` (most work per activation
      byte) and the whole-layer windows of :class:`_Windows` (a chunk keeps whole layers);
    * either no chunk recomputes (``u_r = y_r <= v·kappa(A_r)``) or at least one does, and
      then ``u_r <= (v - 1)·kappa(A_r)``: this is what the whole-model bounds cannot see, a
      rank that recomputes anything gives up a whole chunk's share of its memory;
    * the rank works ``y_r + phi·(y_r - u_r) <= t = T·speed / M`` (recompute costs at least
      ``phi = min f / (f + b)`` of the work it repeats);
    * globally the chunks that keep activations hold at most ``sum_r j_r·A_r`` bytes
      (``j_r`` of them on rank r), so ``sum_r u_r <= alpha + beta·sum_r j_r·A_r`` for every
      tangent ``(alpha, beta)`` of the concave knapsack curve (one rank's knapsack alone
      would let every rank claim the same best layers);
    * ``sum_r y_r = W``.

    For a multiplier ``lambda >= 0`` on the global constraint, ``lambda·alpha + sum_r max
    (y - lambda·(u - beta·j·A_r(y)))`` over each rank's choices bounds the work the ranks
    can cover (weak duality); each rank's maximum is a concave piecewise-linear function of
    ``y`` on an interval, so it is read at its breakpoints.  ``T`` is infeasible when any
    multiplier's cover falls short of W; the bound is the least ``T`` (bisection) that no
    multiplier excludes (infinite when none fits).  Heterogeneous clusters use the fastest
    speed and the largest memory for every rank.  Fill, drain, transfers and all-reduce only
    add to the step time and are left out.
    """
    import numpy as np  # only here: the service never computes this bound at start-up

    b = cfg.microbatch_size(search.training.global_batch_size)
    knap = search.knapsack_at(b)
    windows = search.windows_at(b)
    costs = search.costs_at(b)
    k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
    w, phi = knap.work, knap.phi
    if w <= 0:
        return 0.0
    limit = float(max(g.limit_bytes for g in groups))
    smax = max(g.speed for g in groups)
    sigma = _state_per_work(costs, search.training)
    keep_allowed, rc_allowed = _recompute_freedom(search.options)
    # chunks that may keep their activations when a rank recomputes something
    keep_with_rc = v - 1 if keep_allowed else 0
    inflight = [max(1, StageModel.inflight_of(cfg, r)) for r in range(k)]
    y_cap = limit / sigma if sigma > 0 else math.inf
    keep_all_work: dict[tuple[int, bool], float] = {}  # most work with nothing recomputed
    # runs through a few outlier layers (the densest, like an LM head) can be kept by at
    # most that many chunks in the whole model; every other rank is held to the runs
    # without them (``base``), and only the ``len(outliers)`` ranks that gain most get more
    outliers = _outlier_layers(costs)
    base_windows = search.windows_at(b, exclude=outliers) if outliers else windows
    for runs in {id(windows): windows, id(base_windows): base_windows}.values():
        runs.reserve(limit / min(inflight))  # the largest capacity asked (y = 0)

    def most_work(n: int, chunks: int, need: Callable[[float], float], base: bool, top: float = math.inf) -> float:
        """At least the largest y in [0, min(y_cap, top)] with need(y) <= chunks·kappa(A(y))
        (need increasing, so the set is an interval); -1 when not even y = 0 qualifies.  The
        bisection returns its infeasible end, so the result never falls short."""
        runs = base_windows if base else windows

        def ok(y: float) -> bool:
            a_cap = (limit - sigma * y) / n
            if a_cap < 0:
                return False
            kappa = min(knap.value(a_cap), runs.value(a_cap))
            return need(y) <= chunks * kappa * (1 + 1e-12) + 1e-12
        hi = min(y_cap, w, top)
        if ok(hi):
            return hi
        if not ok(0.0):
            return -1.0
        lo = 0.0
        while hi - lo > 1e-6 * hi:
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return hi

    def rank_options(t: float, n: int, base: bool) -> list[tuple[float, float, float, bool]]:
        """Each choice as (y_max, kink, chunks kept, keeps all): y <= y_max; without
        recompute u = y, with it u = max(0, ((1+phi)·y - t) / phi), which grows past ``kink``."""
        opts: list[tuple[float, float, float, bool]] = []
        if keep_allowed:
            if (n, base) not in keep_all_work:
                keep_all_work[n, base] = most_work(n, v, lambda y: y, base)
            if keep_all_work[n, base] >= 0:
                opts.append((min(t, keep_all_work[n, base]), math.inf, float(v), True))
        if rc_allowed:
            if phi <= 0:
                y_ii = min(t, y_cap, w)
                opts.append((y_ii, math.inf, float(keep_with_rc), False))
            else:
                def need(y: float, t: float = t) -> float:
                    return max(0.0, ((1 + phi) * y - t) / phi)
                y_ii = (
                    min(t, most_work(n, keep_with_rc, need, base, t)) if keep_with_rc else min(t / (1 + phi), y_cap, w)
                )
                if y_ii >= 0:
                    opts.append((y_ii, t / (1 + phi), float(keep_with_rc), False))
        return opts

    a_all = sum(v * limit / n for n in inflight)
    lines = {(knap.work, 0.0), *knap.tangents([a_all * theta for theta in (1.0, 0.5, 0.25, 0.1)])}
    lambdas = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)

    def points(per_rank: list[list[tuple[float, float, float, bool]]], t: float) -> tuple[Any, Any, Any]:
        """Each rank's breakpoints as arrays (rank x point) of y, u and the chunks' share of
        the global capacity ``chunks·A(y)``; missing points have y = -inf."""
        size = max(3 * len(o) for o in per_rank)
        ys = np.full((k, size), -np.inf)
        us = np.zeros((k, size))
        caps = np.zeros((k, size))
        for r, (n, opts) in enumerate(zip(inflight, per_rank, strict=True)):
            i = 0
            for y_max, kink, chunks, keeps_all in opts:
                for y in (0.0, min(kink, y_max), y_max):
                    if keeps_all:
                        u = y
                    else:
                        u = max(0.0, ((1 + phi) * y - t) / phi) if phi > 0 else 0.0
                    ys[r, i], us[r, i], caps[r, i] = y, u, chunks * (limit - sigma * y) / n
                    i += 1
        return ys, us, caps

    def covers(t: float) -> bool:
        per_rank = [rank_options(t, n, False) for n in inflight]
        if any(not o for o in per_rank):
            return False
        full_pts = points(per_rank, t)
        if outliers:
            per_rank_base = [rank_options(t, n, True) for n in inflight]
            # a rank without choices under the held runs is counted with all of them
            base_pts = points([ob or o for ob, o in zip(per_rank_base, per_rank, strict=True)], t)
        for alpha, beta in sorted(lines):
            for lam in lambdas if beta > 0 else (0.0,):
                # each rank's max over its breakpoints of y - lambda·(u - beta·chunks·A(y))
                ys, us, caps = full_pts
                full = (ys - lam * (us - beta * caps)).max(axis=1)
                total = lam * alpha if beta > 0 else 0.0
                if outliers:
                    ys, us, caps = base_pts
                    held = (ys - lam * (us - beta * caps)).max(axis=1)
                    gains = np.sort(np.maximum(0.0, full - held))[::-1]
                    total += float(held.sum() + gains[: len(outliers)].sum())
                else:
                    total += float(full.sum())
                if total < w * (1 - 1e-9):
                    return False
        return True

    hi = None
    if cutoff < math.inf:
        hi = cutoff * smax / m
        if not covers(hi):
            return cutoff
    low, high = _bisect(covers, lo * smax / m, rel_tol=CHUNK_REL_TOL, hi=hi, give_up=w * 1e3)
    return math.inf if high == math.inf else max(lo, low * m / smax)


def memory_bounds(search: _Search, cfg: Config, groups: Sequence[Group], *, lo: float = 0.0) -> float:
    """The larger of ``lo``, :func:`static_memory_bound` and :func:`chunk_memory_bound`
    (infinite when either proves that nothing fits), with their work counted; a bound at or
    above the best step time so far comes back as that step time."""
    search.work += 800 * cfg.pipeline_degree
    bound = max(lo, static_memory_bound(search, cfg, groups))
    if bound == math.inf or bound >= search.best_step:
        return bound
    return max(bound, chunk_memory_bound(search, cfg, groups, lo=bound, cutoff=search.best_step))


def relaxed_bound(
    search: _Search, sm: StageModel, groups: Sequence[Group], lo: float, *, cutoff: float = math.inf
) -> float | None:
    """min over splits (and device orders) of ``max_s LB_s`` with a relaxed memory test.

    Returns None when even the relaxation does not fit memory: then no split of this
    configuration fits.  Only for v = 1.  With a finite ``cutoff`` (the best step time so
    far), a bound at or above it is returned as ``cutoff`` after one test, since then only
    "not better" matters.
    """
    cfg = sm.cfg
    kinds = sorted({g.kind for g in groups}, reverse=True)
    kind_groups = [next(g for g in groups if g.kind == kd) for kd in kinds]
    smax = max(g.speed for g in groups)
    m, k = cfg.num_microbatches, cfg.pipeline_degree
    # the paths into and out of stage s cross the boundaries too
    xfers = search.transfers_at(sm.costs.microbatch_size, groups)

    def feasible(t: float) -> bool:
        search.work += cfg.pipeline_degree * len(kind_groups) * 2 * math.log2(sm.L + 1)
        a = 0
        for s in range(k):
            lo_b, hi_b = a, sm.L
            reach = a  # an empty stage is allowed in the relaxation
            in_f = sm.F[a] / smax + xfers.up[s]
            out_b = sm.B[a] / smax + xfers.up[s]
            for g in kind_groups:
                for rc in recompute_options(search.options, s):

                    def ok(
                b: int, g: Group = g, rc: bool = rc, a: int = a, s: int = s, in_f: float = in_f, out_b: float = out_b
            ) -> bool:
                        if b == a:
                            return True
                        wait = _idle_bound(sm, a, b, rc, s, g.speed, smax, transfers=xfers.down[s])
                        value = in_f + m * sm.work_ms(a, b, rc, g.speed) + wait + max(out_b, sm.allreduce(a, b, g))
                        return value <= t and sm.memory_relaxed(a, b, rc, s) <= g.limit_bytes

                    b = farthest(ok, lo_b, hi_b)
                    if b is not None and b > reach:
                        reach = b
            a = reach
        return a == sm.L

    if not feasible(math.inf):
        return None
    if cutoff < math.inf and cutoff > lo and not feasible(cutoff):
        return cutoff  # no split reaches below the cutoff (the greedy test is exact)
    # only ``lo`` is used (a valid bound at any precision), so a coarser tolerance is enough
    return _bisect(feasible, lo, rel_tol=BOUND_REL_TOL)[0]


def _idle_bound(
    sm: StageModel,
    a: int,
    b: int,
    rc: bool,
    s: int,
    speed: float,
    smax: float,
    *,
    transfers: float = 0.0,
) -> float:
    """The schedule's forced wait on stage ``s`` = [a, b) (see :mod:`planner.solver_core`),
    counted only where it keeps the stage test monotone (so the greedy stays exact).

    1F1B: ``max(0, downstream - w·backward)`` with ``w = min(K-s-1, M)``, monotone when
    ``M >= w + 1``, plus the wait for the first backward ``max(0, downstream - w·forward)``
    when ``M >= w + 2`` (then one more layer adds ``M·c_l`` to the work and takes at most
    ``(2 + w)·c_l`` off the two waits, so the test stays monotone); GPipe:
    ``max(0, downstream - (M-1)·forward)``, always monotone.  The downstream path is the
    later layers' forward + backward at the fastest speed without recompute, plus
    ``transfers`` (a lower bound of the later boundaries' transfers, both ways: constant in
    ``b``, so the test stays monotone).
    """
    cfg = sm.cfg
    m = cfg.num_microbatches
    down = (sm.F[-1] + sm.B[-1] - sm.F[b] - sm.B[b]) / smax + transfers
    if cfg.schedule == "1f1b":
        w = min(cfg.pipeline_degree - s - 1, m)
        if m < w + 1:
            return 0.0
        f = sm.F[b] - sm.F[a]
        bw = (sm.B[b] - sm.B[a] + (f if rc else 0.0)) / speed
        idle = max(0.0, down - w * bw)
        if m >= w + 2:
            idle += max(0.0, down - w * f / speed)
        return idle
    if cfg.schedule == "gpipe":
        return max(0.0, down - (m - 1) * (sm.F[b] - sm.F[a]) / speed)
    return 0.0


def relaxed_memory_fits(search: _Search, sm: StageModel, groups: Sequence[Group]) -> bool:
    """False only when no split of the configuration fits memory (any v).

    Relaxation: each chunk alone must fit its rank's largest device (a rank holds at least
    that chunk), with the monotone memory lower bound and empty chunks allowed; the
    farthest-reach greedy decides it exactly.
    """
    cfg = sm.cfg
    k = cfg.pipeline_degree
    search.work += cfg.num_stages * 2 * math.log2(sm.L + 1)
    limit = max(g.limit_bytes for g in groups)
    a = 0
    for j in range(cfg.num_stages):
        reach = a
        for rc in recompute_options(search.options, j):

            def ok(b: int, rc: bool = rc, a: int = a, j: int = j) -> bool:
                return b == a or sm.memory_relaxed(a, b, rc, j % k) <= limit

            b = farthest(ok, a, sm.L)
            if b is not None and b > reach:
                reach = b
        a = reach
    return a == sm.L


def _bisect(
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


# --------------------------------------------------------------------------- primal splits


def greedy_split(
    search: _Search,
    sm: StageModel,
    groups: Sequence[Group],
    order: Sequence[int],
    t: float,
    *,
    idle: bool = False,
    window: bool = False,
) -> Split | None:
    """Farthest-reach split with every stage's bound ``<= t`` and exact memory (v = 1).

    ``idle``: count the schedule's forced waits (:func:`_idle_bound`) in each stage's bound,
    so that stages with long downstream paths take less work.

    ``window`` (1F1B): also keep the steady state's ping-pong cycles within the period.  In
    1F1B, ranks ``s..u`` pass micro-batches back and forth, so every ``u - s + 1`` of them
    cost that window ``sum(c) + 2·sum(x)`` (work per micro-batch and the transfers inside
    it, both ways); a slow link between two full stages stretches the whole pipeline's
    period by its transfer time.  Each stage's slack (``(t - bound) / M``, the period it
    leaves unused) must cover the transfers of every window ending at it, so stages beside
    a slow link take a little less work.
    """
    cfg = sm.cfg
    smax = max(g.speed for g in groups)
    k, m, n = cfg.pipeline_degree, cfg.num_microbatches, sm.L
    a = 0
    in_f = out_b = 0.0
    out_ranges: list[tuple[int, int]] = []
    rcs: list[bool] = []
    # most transfer time (2x per boundary, less the slack) of any window ending at the last stage
    owed = 0.0
    use_window = window and cfg.schedule == "1f1b"
    for s in range(k):
        g = groups[order[s]]
        lo_b, hi_b = (n, n) if s == k - 1 else (a + 1, n - (k - s - 1))
        best_b, best_rc, best_value = None, False, 0.0

        for rc in recompute_options(search.options, s):

            def value(
                b: int, g: Group = g, rc: bool = rc, a: int = a, s: int = s, in_f: float = in_f, out_b: float = out_b
            ) -> float:
                wait = _idle_bound(sm, a, b, rc, s, g.speed, smax) if idle else 0.0
                return in_f + m * sm.work_ms(a, b, rc, g.speed) + wait + max(out_b, sm.allreduce(a, b, g))

            def ok(
                b: int, g: Group = g, rc: bool = rc, a: int = a, s: int = s, value: Callable[[int], float] = value,
                owed: float = owed,
            ) -> bool:
                val = value(b)
                if val > t or (use_window and (t - val) / m < owed):
                    return False
                return math.ceil(sm.memory(a, b, rc, s)) <= g.limit_bytes

            b = farthest(ok, lo_b, hi_b)
            if b is not None and (best_b is None or b > best_b):
                best_b, best_rc, best_value = b, rc, value(b)
        if best_b is None:
            return None
        out_ranges.append((a, best_b))
        rcs.append(best_rc)
        f = (sm.F[best_b] - sm.F[a]) / g.speed
        bw = (sm.B[best_b] - sm.B[a]) / g.speed + (f if best_rc else 0.0)
        x = 0.0
        if s < k - 1:
            nxt = groups[order[s + 1]]
            x = boundary_transfer_ms(
                sm.costs, [(a, best_b), (best_b, best_b + 1)], [list(g.devices), list(nxt.devices)], search.cluster
            )[0]
        in_f += f + x
        out_b += bw + x
        owed = 2 * x - (t - best_value) / m + max(0.0, owed)
        a = best_b
    return Split(tuple(out_ranges), tuple(rcs), tuple(order[:k]))


def fixed_split(search: _Search, sm: StageModel, groups: Sequence[Group], order: Sequence[int]) -> Split | None:
    """The user's ranges with the cheapest recompute flags that fit."""
    ranges = fixed_ranges(search.options)
    assert ranges is not None
    k = sm.cfg.pipeline_degree
    stage_groups = tuple(order[s % k] for s in range(len(ranges)))
    return _with_recompute(search, sm, groups, tuple(ranges), stage_groups)


def _with_recompute(
    search: _Search, sm: StageModel, groups: Sequence[Group], ranges: tuple[tuple[int, int], ...], stage_groups: tuple[int, ...]
) -> Split | None:
    """Recompute only where needed: per stage (v = 1) or per rank (all its chunks, v > 1)."""
    k = sm.cfg.pipeline_degree
    n = len(ranges)
    search.work += n
    rcs = [False] * n
    for r in range(k):
        own = [s for s in range(n) if s % k == r]
        choices = [tuple(recompute_options(search.options, s)) for s in own]
        found = False
        # try no recompute first, then everything the options allow, cheapest first
        combos = sorted(
            itertools.product(*choices),
            key=lambda c: sum(sm.F[ranges[s][1]] - sm.F[ranges[s][0]] for s, x in zip(own, c, strict=True) if x),
        )
        for combo in combos[:16]:
            from planner.costmodel import rank_memory_bytes

            mem = rank_memory_bytes(
                sm.costs, [ranges[s] for s in own], list(combo), sm.training, inflight=sm.inflight[r]
            )
            if math.ceil(mem) <= groups[stage_groups[own[0]]].limit_bytes:
                for s, x in zip(own, combo, strict=True):
                    rcs[s] = x
                found = True
                break
        if not found:
            return None
    return Split(ranges, tuple(rcs), stage_groups)


def interleaved_split(
    search: _Search, sm: StageModel, groups: Sequence[Group], order: Sequence[int], *, memory_aware: bool = False
) -> Split | None:
    """Balance the K·v chunks' work (min-max), then recompute where memory needs it.

    ``memory_aware``: when the balanced chunks need recompute, cut instead with each rank's
    memory in the test (without recompute first), so that ranks holding many micro-batches
    take smaller chunks rather than recomputing.
    """
    cfg = sm.cfg
    k, n = cfg.pipeline_degree, cfg.num_stages
    speeds = [groups[order[s % k]].speed for s in range(n)]

    def cut(t: float) -> tuple[tuple[int, int], ...] | None:
        a = 0
        out = []
        for s in range(n):
            lo_b, hi_b = (sm.L, sm.L) if s == n - 1 else (a + 1, sm.L - (n - s - 1))
            sp = speeds[s]
            def fits(b: int, a: int = a, sp: float = sp) -> bool:
                return sm.work_ms(a, b, False, sp) <= t

            b = farthest(fits, lo_b, hi_b)
            if b is None:
                return None
            out.append((a, b))
            a = b
        return tuple(out)

    def feasible(t: float) -> bool:
        search.work += n * math.log2(sm.L + 1)
        return cut(t) is not None

    total = _work_total(sm.costs)
    t = _bisect(feasible, total / (n * max(speeds)))[1]
    ranges = cut(t)
    if ranges is None:  # pragma: no cover - bisect returns a feasible value
        return None
    stage_groups = tuple(order[s % k] for s in range(n))
    split = _with_recompute(search, sm, groups, ranges, stage_groups)
    if split is not None and not (memory_aware and any(split.recompute)):
        return split
    # the time-balanced chunks do not fit (or need recompute): cut again with each rank's
    # memory in the test, allowing chunks up to 3x the balanced time
    for rc in sorted(set(recompute_options(search.options, 0)) & {False, True}):
        if isinstance(search.options.recompute, list):
            break
        for step in range(16):
            search.work += 2 * n * math.log2(sm.L + 1)
            ranges_m = _memory_aware_cut(sm, groups, stage_groups, t * 3 ** (step / 15), rc)
            if ranges_m is not None:
                if step > 0 and memory_aware:
                    # the scan overshoots: a larger budget than needed lets the early chunks
                    # run far and starves the last ones, so bisect back to the smallest budget
                    lo, hi = t * 3 ** ((step - 1) / 15), t * 3 ** (step / 15)
                    for _ in range(10):
                        mid = (lo + hi) / 2
                        search.work += 2 * n * math.log2(sm.L + 1)
                        found = _memory_aware_cut(sm, groups, stage_groups, mid, rc)
                        if found is None:
                            lo = mid
                        else:
                            hi, ranges_m = mid, found
                return _with_recompute(search, sm, groups, ranges_m, stage_groups)
    return None


def interleaved_mixed_split(
    search: _Search, sm: StageModel, groups: Sequence[Group], order: Sequence[int]
) -> Split | None:
    """Interleaved chunks cut with recompute chosen per chunk (:func:`_mixed_cut`), at the
    smallest per-chunk budget (scan, then bisection) for which the cut covers every layer."""
    if search.options.recompute is not None:
        return None  # the user fixed recompute: the other splits follow it
    cfg = sm.cfg
    k, n = cfg.pipeline_degree, cfg.num_stages
    stage_groups = tuple(order[s % k] for s in range(n))
    speeds = [groups[g].speed for g in stage_groups]
    t0 = _work_total(sm.costs) / (n * max(speeds))
    found: tuple[tuple[tuple[int, int], ...], tuple[bool, ...]] | None = None
    prev = t0
    for step in range(9):
        t = t0 * 2 ** (step / 3)
        search.work += 4 * n * math.log2(sm.L + 1)
        found = _mixed_cut(sm, groups, stage_groups, t)
        if found is not None:
            if step > 0:
                lo, hi = prev, t
                for _ in range(10):
                    mid = (lo + hi) / 2
                    search.work += 4 * n * math.log2(sm.L + 1)
                    again = _mixed_cut(sm, groups, stage_groups, mid)
                    if again is None:
                        lo = mid
                    else:
                        hi, found = mid, again
            break
        prev = t
    if found is None:
        return None
    return _with_recompute(search, sm, groups, found[0], stage_groups)


def _mixed_cut(
    sm: StageModel, groups: Sequence[Group], stage_groups: tuple[int, ...], t: float
) -> tuple[tuple[tuple[int, int], ...], tuple[bool, ...]] | None:
    """Farthest-reach chunks, each with or without recompute (whichever reaches farther),
    such that rank ``r``'s work after its j-th chunk is at most ``(j + 1)·t`` (a chunk that
    memory keeps small leaves its slack to the rank's later chunks) and the rank fits memory."""
    from planner.costmodel import rank_memory_bytes

    k, n = sm.cfg.pipeline_degree, sm.cfg.num_stages
    own: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    own_rc: list[list[bool]] = [[] for _ in range(k)]
    done = [0.0] * k
    out: list[tuple[int, int]] = []
    rcs: list[bool] = []
    a = 0
    for s in range(n):
        r = s % k
        g = groups[stage_groups[s]]
        lo_b, hi_b = (sm.L, sm.L) if s == n - 1 else (a + 1, sm.L - (n - s - 1))
        budget = (len(own[r]) + 1) * t - done[r]
        best_b, best_rc = None, False
        for rc in (False, True):

            def fits(
                b: int, a: int = a, r: int = r, g: Group = g, rc: bool = rc, budget: float = budget
            ) -> bool:
                if sm.work_ms(a, b, rc, g.speed) > budget:
                    return False
                mem = rank_memory_bytes(
                    sm.costs, [*own[r], (a, b)], [*own_rc[r], rc], sm.training, inflight=sm.inflight[r]
                )
                return math.ceil(mem) <= g.limit_bytes

            b = farthest(fits, lo_b, hi_b)
            if b is not None and (best_b is None or b > best_b):
                best_b, best_rc = b, rc
        if best_b is None:
            return None
        own[r].append((a, best_b))
        own_rc[r].append(best_rc)
        done[r] += sm.work_ms(a, best_b, best_rc, g.speed)
        out.append((a, best_b))
        rcs.append(best_rc)
        a = best_b
    return tuple(out), tuple(rcs)


def _memory_aware_cut(
    sm: StageModel, groups: Sequence[Group], stage_groups: tuple[int, ...], t: float, rc: bool
) -> tuple[tuple[int, int], ...] | None:
    """Farthest-reach chunks with work <= t whose rank (all its chunks so far) fits memory."""
    from planner.costmodel import rank_memory_bytes

    k, n = sm.cfg.pipeline_degree, sm.cfg.num_stages
    own: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    out = []
    a = 0
    for s in range(n):
        r = s % k
        g = groups[stage_groups[s]]
        lo_b, hi_b = (sm.L, sm.L) if s == n - 1 else (a + 1, sm.L - (n - s - 1))

        def fits(b: int, a: int = a, r: int = r, g: Group = g) -> bool:
            if sm.work_ms(a, b, rc, g.speed) > t:
                return False
            chunks = [*own[r], (a, b)]
            mem = rank_memory_bytes(sm.costs, chunks, [rc] * len(chunks), sm.training, inflight=sm.inflight[r])
            return math.ceil(mem) <= g.limit_bytes

        b = farthest(fits, lo_b, hi_b)
        if b is None:
            return None
        own[r].append((a, b))
        out.append((a, b))
        a = b
    return tuple(out)


def _orders(groups: Sequence[Group]) -> list[tuple[int, ...]]:
    """Device-group orders to try for the pipeline positions (heterogeneous clusters)."""
    k = len(groups)
    base = tuple(range(k))
    if len({g.kind for g in groups}) == 1:
        return [base]
    by_speed = tuple(sorted(base, key=lambda i: (-groups[i].speed, -groups[i].limit_bytes, i)))
    by_memory = tuple(sorted(base, key=lambda i: (-groups[i].limit_bytes, -groups[i].speed, i)))
    orders = [by_speed, tuple(reversed(by_speed)), by_memory, tuple(reversed(by_memory))]
    # alternate kinds (slow devices spread out)
    kinds = sorted({g.kind for g in groups}, reverse=True)
    buckets = [[i for i in by_speed if groups[i].kind == kd] for kd in kinds]
    mixed = []
    while any(buckets):
        for bucket in buckets:
            if bucket:
                mixed.append(bucket.pop(0))
    orders.append(tuple(mixed))
    distinct_perms = _distinct_permutations(groups, limit=24)
    return list(dict.fromkeys(orders + distinct_perms))


def _distinct_permutations(groups: Sequence[Group], *, limit: int) -> list[tuple[int, ...]]:
    """All orders that differ in the kinds of device at each position, if there are few."""
    kinds = [g.kind for g in groups]
    count = math.factorial(len(kinds))
    for kd in set(kinds):
        count //= math.factorial(kinds.count(kd))
    if count > limit:
        return []
    seen: dict[tuple[tuple[float, int], ...], tuple[int, ...]] = {}
    for perm in itertools.permutations(range(len(groups))):
        key = tuple(kinds[i] for i in perm)
        seen.setdefault(key, perm)
    return sorted(seen.values())


def _enumerate(search: _Search, sm: StageModel, cfg: Config, groups: list[Group], lb: float) -> bool:
    """Solve ``cfg`` by enumerating every split in bound order; False if there are too many.

    Exact unless the cluster has too many distinct device orders to try them all, in which
    case ``lb`` stays open.
    """
    n = cfg.num_stages
    orders = _orders(groups)
    total = math.comb(sm.L - 1, n - 1) * len(orders)
    if total > ENUMERATE_LIMIT:
        return False
    if len(orders) > 1 and not _distinct_permutations(groups, limit=24):
        search.open_bounds.append(lb)
    candidates: list[tuple[float, Split]] = []
    k = cfg.pipeline_degree
    for order in orders:
        for cuts in itertools.combinations(range(1, sm.L), n - 1):
            bounds = (0, *cuts, sm.L)
            ranges = tuple((bounds[i], bounds[i + 1]) for i in range(n))
            split = _with_recompute(search, sm, groups, ranges, tuple(order[s % k] for s in range(n)))
            if split is None:
                continue
            candidates.append((split_lower_bound(sm, search.cluster, groups, split), split))
    if not candidates:
        search.infeasible += 1
        return True
    candidates.sort(key=lambda c: (c[0], c[1].ranges, c[1].groups))
    for lb_split, split in candidates:
        if lb_split >= search.best_step:
            break
        consider(search, sm, groups, split)
        if cfg.virtual_stages > 1 and any(split.recompute):
            # recompute is chosen per rank by the forward time it adds, not by simulation:
            # exact only without recompute, so the configuration's bound stays open
            search.open_bounds.append(lb)
    return True


# --------------------------------------------------------------------------- search


def _polish(search: _Search) -> None:
    """Hill-climb the best plan's boundaries one layer at a time on the simulated step.

    The greedy splits minimise a bound, not the simulated makespan; moving a boundary by
    one layer, keeping the move when the simulated step drops, closes part of that
    difference.  Uses at most POLISH_SHARE of the work budget.
    """
    if search.best is None:
        return
    stop_work = search.work + POLISH_SHARE * search.work_budget
    cfg, split, groups = search.best
    sm = StageModel(search.costs_at(cfg.microbatch_size(search.training.global_batch_size)), cfg, search.training)
    if fixed_ranges(search.options) is not None:
        return
    improved = True
    while improved:
        improved = False
        cfg, split, groups = search.best
        bounds = [r[0] for r in split.ranges] + [sm.L]
        for i in range(1, len(bounds) - 1):
            for delta in (-1, 1):
                if search.work > stop_work or time.perf_counter() > search.wall_stop:
                    return
                moved = list(bounds)
                moved[i] += delta
                if not moved[i - 1] < moved[i] < moved[i + 1]:
                    continue
                ranges = tuple((moved[j], moved[j + 1]) for j in range(len(moved) - 1))
                candidate = _with_recompute(search, sm, groups, ranges, split.groups)
                if candidate is None:
                    continue
                before = search.best_step
                search.work += len(ranges)
                consider(search, sm, groups, candidate)
                if search.best_step < before * (1 - 1e-12):
                    improved = True
                    break
            if improved:
                break


def _seed_with_baselines(search: _Search, configs: Sequence[Config]) -> None:
    """The baselines' splits (where the options allow them) as candidates: simulated only
    when their bound beats the best plan found, so the plan is never worse than them."""
    from planner.baselines import baseline_splits

    if fixed_ranges(search.options) is not None:
        return
    g = search.training.global_batch_size
    for cfg, ranges in baseline_splits(search.profile, search.cluster, search.training, search.options):
        # the baselines follow the options; they may use micro-batches larger than the
        # search tries (MAX_EXTRAPOLATION), which is why they are candidates of their own
        if (
            cfg.data_parallel * cfg.pipeline_degree > search.cluster.num_devices
            or g % (cfg.data_parallel * cfg.num_microbatches)
            or (cfg.schedule == "interleaved-1f1b" and cfg.num_microbatches % cfg.pipeline_degree)
            or (cfg.schedule == "1f1b" and cfg.num_microbatches < cfg.pipeline_degree)
        ):
            continue
        groups = make_groups(
            search.cluster, search.training, cfg.data_parallel, cfg.pipeline_degree, default_layout=True
        )
        sm = StageModel(search.costs_at(cfg.microbatch_size(search.training.global_batch_size)), cfg, search.training)
        k = cfg.pipeline_degree
        split = _with_recompute(search, sm, groups, tuple(ranges), tuple(s % k for s in range(len(ranges))))
        if split is not None:
            consider(search, sm, groups, split)


def _promise(search: _Search, cfg: Config, groups: Sequence[Group]) -> float:
    """Step time of a perfectly balanced split: W (M + (K-1)/v) / (K·speed)."""
    costs = search.costs_at(cfg.microbatch_size(search.training.global_batch_size))
    w = _work_total(costs)
    k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
    speed = sum(g.speed for g in groups) / len(groups)
    return w * (m + (k - 1) / v) / (k * speed)


def static_fits(search: _Search, cfg: Config, groups: Sequence[Group]) -> bool:
    """False when the parameters, gradients and optimizer state alone cannot fit the K ranks
    (each rank's share is at most its largest device's usable memory)."""
    total = static_bytes(search.profile_param_bytes, search.training)
    return total <= sum(g.limit_bytes for g in groups)


def _branch_and_bound(search: _Search, configs: Sequence[Config]) -> None:
    """Best-first branch and bound over the configurations, in three levels of effort.

    Level 0 is :func:`cheap_bound`, for every configuration.  Level 1 is the configuration's
    strong bound (v = 1: :func:`relaxed_bound`; v > 1: :func:`memory_bounds`), or its proof
    that nothing fits.  Level 2 is the search for a plan (:func:`_enumerate`, the greedy
    splits), after which a configuration is solved or stays open at its bound.

    First the ``INCUMBENT_TRIES`` configurations that promise most (the textbook step time
    of a balanced split) go through every level, so that a good plan prunes the rest; then
    the configuration with the smallest bound is always the next to advance a level, since
    it alone decides the proven gap.  The search stops when the smallest bound reaches the
    best plan (optimal) or at SEARCH_SHARE of the work budget; what is left stays open at
    its bound.
    """
    entries = []
    group_cache: dict[tuple[int, int], list[Group]] = {}
    for cfg in configs:
        key = (cfg.data_parallel, cfg.pipeline_degree)
        if key not in group_cache:
            group_cache[key] = make_groups(search.cluster, search.training, *key)
        groups = group_cache[key]
        if not static_fits(search, cfg, groups):
            search.infeasible += 1
            continue
        entries.append((cheap_bound(search, cfg, groups), cfg, groups))
    promising = sorted(entries, key=lambda e: (max(e[0], _promise(search, e[1], e[2])), e[1]))
    started: set[Config] = set()
    for cheap, cfg, groups in promising:
        if search.best is not None and len(started) >= INCUMBENT_TRIES:
            break
        if search.best is not None and _out_of_budget(search):
            break
        started.add(cfg)
        if cheap >= search.best_step:
            search.pruned += 1
            continue
        first = _advance(search, cfg, groups, cheap, 0)
        if first is not None:
            _advance(search, cfg, groups, *first)
    heap = [(cheap, 0, cfg, groups) for cheap, cfg, groups in entries if cfg not in started]
    heapq.heapify(heap)
    while heap:
        bound, level, cfg, groups = heapq.heappop(heap)
        if bound >= search.best_step:
            search.pruned += 1 + len(heap)
            return
        if search.best is not None and _out_of_budget(search):
            search.timed_out = True
            for bound_, _, cfg_, groups_ in [(bound, level, cfg, groups), *heap]:
                if bound_ >= search.best_step:
                    search.pruned += 1
                else:
                    search.open_configs[cfg_] = (bound_, groups_)
            return
        nxt = _advance(search, cfg, groups, bound, level)
        if nxt is not None:
            heapq.heappush(heap, (nxt[0], nxt[1], cfg, groups))


def _tighten_chains(search: _Search) -> None:
    """Raise the bounds of open one-chunk configurations with the boundary table of
    :mod:`planner.chain_dp` (homogeneous clusters), smallest bound first, and offer the
    split the table finds at each time it can reach.

    Each step tests one time ``t`` between the configuration's bound and the smallest time
    known to be reachable: the first test is at the best step time (if nothing reaches it,
    the configuration is excluded), then bisection.  The configuration with the smallest
    bound always goes next, since it alone decides the gap; the loop stops at a
    configuration the table cannot take, at ``CHAIN_TOL``, or at ``CHAIN_SHARE`` of the work.
    """
    if not search.cluster.homogeneous or fixed_ranges(search.options) is not None or not search.open_configs:
        return
    from planner.chain_dp import MAX_CELLS, chain_cells, chain_split

    g = search.training.global_batch_size
    stop = search.work + CHAIN_SHARE * search.work_budget
    reachable: dict[Config, float] = {}
    heap = [(bound, cfg) for cfg, (bound, _) in search.open_configs.items()]
    heapq.heapify(heap)
    while heap:
        bound, cfg = heapq.heappop(heap)
        if search.open_configs.get(cfg, (None,))[0] != bound:
            continue  # stale entry
        groups = search.open_configs[cfg][1]
        if bound >= search.best_step * (1 - 1e-9):
            del search.open_configs[cfg]
            search.pruned += 1
            continue
        if cfg.virtual_stages != 1 or cfg in search.chain_done:
            return  # the smallest bound cannot rise here, so neither can the gap
        if search.work > stop or time.perf_counter() > search.wall_stop:
            return
        sm = StageModel(search.costs_at(cfg.microbatch_size(g)), cfg, search.training)
        hi = min(reachable.get(cfg, math.inf), search.best_step * (1 - 1e-9))
        t = hi if cfg not in reachable else (bound + hi) / 2
        cells = chain_cells(sm, groups, t)
        cost = CHAIN_WORK * cells + CHAIN_STAGE_WORK * cfg.pipeline_degree
        if cells > MAX_CELLS or search.work + cost > stop:
            return  # too large for what is left of the budget: the bound stays where it is
        search.work += cost
        found = chain_split(sm, groups, search.cluster, search.training, search.options, t)
        if found is None:
            bound = t  # no split reaches t: the configuration's bound rises to it
            if cfg in reachable and reachable[cfg] - bound <= CHAIN_TOL * bound:
                search.chain_done.add(cfg)
        else:
            reachable[cfg] = t
            split = Split(found[0], found[1], tuple(range(cfg.pipeline_degree)))
            if split_memory_ok(sm, groups, split):
                consider(search, sm, groups, split)
            if t - bound <= CHAIN_TOL * t:
                search.chain_done.add(cfg)
        if bound >= search.best_step * (1 - 1e-9):
            del search.open_configs[cfg]
            search.pruned += 1
            continue
        search.open_configs[cfg] = (bound, groups)
        heapq.heappush(heap, (bound, cfg))


def _out_of_budget(search: _Search) -> bool:
    return search.work > SEARCH_SHARE * search.work_budget or time.perf_counter() > search.wall_stop


def _advance(
    search: _Search, cfg: Config, groups: list[Group], bound: float, level: int
) -> tuple[float, int] | None:
    """Take ``cfg`` from ``level`` to the next one (see :func:`_branch_and_bound`).

    Returns its new (bound, level) while it needs more work, or None once it is settled:
    solved, pruned, proven not to fit, or left open (``search.open_configs``) at its bound.
    """
    g = search.training.global_batch_size
    fixed = fixed_ranges(search.options) is not None
    too_big = 2 * cfg.num_microbatches * cfg.num_stages > SIM_ACTION_LIMIT
    sm = StageModel(search.costs_at(cfg.microbatch_size(g)), cfg, search.training)
    if level == 0:
        search.visited += 1
        if too_big:
            search.too_big += 1
        if fixed:
            if too_big:
                search.open_configs[cfg] = (bound, groups)
            else:
                _solve_fixed(search, sm, cfg, groups, _orders(groups), bound)
            return None
        lb: float | None
        if cfg.virtual_stages == 1:
            lb = relaxed_bound(search, sm, groups, bound, cutoff=search.best_step)
        else:
            lb = memory_bounds(search, cfg, groups, lo=bound)
            if lb == math.inf or not relaxed_memory_fits(search, sm, groups):
                lb = None
        if lb is None:
            search.infeasible += 1
            search.infeasible_after_visit += 1
            return None
        if lb >= search.best_step:
            search.pruned += 1
            search.pruned_after_visit += 1
            return None
        if too_big:
            search.open_configs[cfg] = (lb, groups)  # its bound is all it gets
            return None
        return lb, 1
    orders = _orders(groups)
    if _enumerate(search, sm, cfg, groups, bound):
        return None
    if cfg.virtual_stages == 1:
        step = _primal_chain(search, sm, cfg, groups, orders, bound)
        best_here = math.inf if step is None else step
    else:
        best_here = math.inf
        for i_order, order in enumerate(orders[:3]):
            tried: list[Split] = []
            for memory_aware in (False, True, None):
                if memory_aware is None:
                    if i_order > 0:
                        continue  # the per-chunk recompute split only for the first order
                    split = interleaved_mixed_split(search, sm, groups, order)
                else:
                    split = interleaved_split(search, sm, groups, order, memory_aware=memory_aware)
                if split is None or split in tried:
                    continue
                tried.append(split)
                best_here = min(best_here, consider(search, sm, groups, split))
    if best_here > bound * (1 + 1e-9):
        search.open_configs[cfg] = (bound, groups)
    return None


def _solve_fixed(
    search: _Search, sm: StageModel, cfg: Config, groups: list[Group], orders: Sequence[tuple[int, ...]], cheap: float
) -> None:
    best_here = math.inf
    for order in orders:
        split = fixed_split(search, sm, groups, order)
        if split is None:
            continue
        best_here = min(best_here, consider(search, sm, groups, split))
    if best_here == math.inf:
        search.infeasible += 1
    elif len(orders) > 1 and len(orders) < math.factorial(cfg.pipeline_degree):
        search.open_bounds.append(cheap)  # device orders were not all tried


def _primal_chain(
    search: _Search, sm: StageModel, cfg: Config, groups: list[Group], orders: Sequence[tuple[int, ...]], lb: float
) -> float | None:
    """Greedy splits at the smallest feasible bound, per device order; the best is offered."""
    best_here: float | None = None
    # with the schedule's waits in the stage test (1F1B, GPipe) as a second candidate: the
    # plain test ignores the fill and drain, which the simulated step pays
    # and, for 1F1B, with the steady state's transfer cycles too (greedy_split's ``window``)
    variants = [(False, False)]
    if cfg.schedule != "interleaved-1f1b" and cfg.pipeline_degree > 1:
        variants.append((True, False))
        if cfg.schedule == "1f1b":
            variants.append((True, True))
    for order in orders:
        for idle, window in variants:

            def feasible(t: float, order: tuple[int, ...] = order, idle: bool = idle, window: bool = window) -> bool:
                search.work += cfg.pipeline_degree * 2 * math.log2(sm.L + 1)
                return greedy_split(search, sm, groups, order, t, idle=idle, window=window) is not None

            if not feasible(math.inf):
                continue
            t = _bisect(feasible, lb)[1]
            split = greedy_split(search, sm, groups, order, t, idle=idle, window=window)
            if split is None:
                split = greedy_split(search, sm, groups, order, math.inf, idle=idle, window=window)
            if split is None:
                continue
            step = consider(search, sm, groups, split)
            best_here = step if best_here is None else min(best_here, step)
    return best_here
