"""The chunk memory bound: each rank's memory, chunk by chunk, in whole layers.

:func:`chunk_memory_bound` is the strongest memory bound of an interleaved configuration
(see its doc for the derivation).  What it adds to :mod:`planner.bounds.memory`:

* a rank that recomputes anything gives up a whole chunk's share of its memory;
* a chunk that keeps its activations holds whole, consecutive layers (:class:`Windows`: the
  most work of any run of layers within a byte budget), not a fractional knapsack's 1.9 layers;
* the few outlier layers of much higher work per activation byte, like an LM head
  (:func:`outlier_layers`), sit in one chunk each, so only that many ranks may count runs
  through them;
* the ranks share one knapsack of the model's layers through a Lagrangian multiplier, so they
  cannot all claim the best layers.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

from planner.bounds.knapsack import knapsack_at, recompute_freedom, state_per_work
from planner.cost import LayerCosts
from planner.search.model import bisect_feasible
from planner.search.space import Config, Group
from planner.search.state import SearchState

#: layers with a work density this many times the median are outliers (:func:`outlier_layers`)
OUTLIER_DENSITY = 1.25
#: most outlier layers :func:`chunk_memory_bound` sets apart
MAX_OUTLIERS = 4
#: most layer runs :class:`Windows` lists (beyond, the chunk bound uses the knapsack alone)
WINDOW_LIMIT = 200_000
#: relative precision of :func:`chunk_memory_bound`'s bisection (each step costs K knapsack solves)
CHUNK_REL_TOL = 5e-4


class Windows:
    """The most work one chunk can keep activations for: whole, contiguous layers.

    ``value(A)`` is the most forward + backward work (speed 1) of any run of consecutive
    layers whose activation bytes total at most ``A``: exact, where :meth:`planner.bounds.knapsack.Knapsack.value`
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


def windows_at(search: SearchState, b: int, *, exclude: frozenset[int] = frozenset()) -> Windows:
    """:class:`Windows` at micro-batch size ``b``, without the runs through ``exclude``,
    built once per search."""
    return search.table(Windows, (b, exclude), lambda: Windows(search.costs_at(b), exclude=exclude))


def outlier_layers(costs: LayerCosts) -> frozenset[int]:
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


def chunk_memory_bound(
    search: SearchState, cfg: Config, groups: Sequence[Group], *, lo: float = 0.0, cutoff: float = math.inf
) -> float:
    """A lower bound of any split of ``cfg`` from each rank's memory, chunk by chunk.

    ``lo`` is a known lower bound (it starts the bisection); with a finite ``cutoff`` (the
    best step time so far) a bound at or above it is returned as ``cutoff`` after one test,
    since then only "not better" matters.

    Rank ``r`` has v chunks; at some moment of its memory walk it holds ``n_{r,j}``
    micro-batches of chunk j, and any mixture of its moments bounds the bytes of its kept
    chunks together by ``L / g_r`` (:meth:`planner.search.state.SearchState.memory_counts`:
    the walk itself, or the closed forms of :func:`planner.schedules.first_backward_counts`
    for large schedules).  With ``y_r`` its work (forward + backward
    at speed 1) and ``u_r`` the work of its chunks that keep their activations, the cost model
    gives, for every split:

    * its parameter state is at least ``sigma·y_r`` (``sigma``: least state bytes per unit
      of work over the layers), so with ``L_r = limit - sigma·y_r`` the chunks that keep
      their activations hold each at most ``L_r / n_{r,j}`` and all together at most
      ``A_r = L_r / g_r``; a chunk holding ``a`` works at most
      ``kappa(a)``, the smaller of the fractional knapsack of
      :class:`planner.bounds.knapsack.Knapsack` (most work per activation byte, concave: c
      chunks sharing ``A_r`` work at most ``c·knapsack(A_r / c)``) and the whole-layer windows
      of :class:`Windows` (a chunk keeps whole layers);
    * either no chunk recomputes (``u_r = y_r`` within all v chunks' share) or at least one
      does, and then ``u_r`` is within the share of v - 1 chunks: this is what the
      whole-model bounds cannot see, a rank that recomputes anything gives up a whole chunk's
      share of its memory;
    * the rank works ``y_r + phi·(y_r - u_r) <= t = T·speed / M`` (recompute costs at least
      ``phi = min f / (f + b)`` of the work it repeats);
    * globally the chunks that keep activations hold at most ``sum_r A_r`` bytes (over the
      ranks keeping any), so ``sum_r u_r <= alpha + beta·sum_r A_r`` for every
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
    if search.costs_at(b).activation_slack > 0:
        return lo  # its tables sum activations by prefix: no information with negative kept inputs
    knap = knapsack_at(search, b)
    windows = windows_at(search, b)
    costs = search.costs_at(b)
    k, m, v = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages
    w, phi = knap.work, knap.phi
    if w <= 0:
        return 0.0
    limit = float(max(g.limit_bytes for g in groups))
    smax = max(g.speed for g in groups)
    sigma = state_per_work(costs, search.training)
    keep_allowed, rc_allowed = recompute_freedom(search.options)
    # chunks that may keep their activations when a rank recomputes something
    keep_with_rc = v - 1 if keep_allowed else 0
    # per rank, its chunks' in-flight counts at its first backward, smallest first: kept
    # chunks j satisfy sum_j n_j·a_j <= limit - state, so each a_j <= that / n_j and their
    # total <= that / n_0 (planner.schedules.first_backward_counts)
    held = search.memory_counts(cfg)
    inflight = [tuple(sorted(c.per_chunk)) for c in held]
    joint = {ns: min(c.joint for c, ns2 in zip(held, inflight, strict=True) if ns2 == ns) for ns in inflight}
    y_cap = limit / sigma if sigma > 0 else math.inf
    keep_all_work: dict[tuple[tuple[int, ...], bool], float] = {}  # most work with nothing recomputed
    # runs through a few outlier layers (the densest, like an LM head) can be kept by at
    # most that many chunks in the whole model; every other rank is held to the runs
    # without them (``base``), and only the ``len(outliers)`` ranks that gain most get more
    outliers = outlier_layers(costs)
    base_windows = windows_at(search, b, exclude=outliers) if outliers else windows
    for runs in {id(windows): windows, id(base_windows): base_windows}.values():
        runs.reserve(limit / min(min(ns[0], joint[ns]) for ns in inflight))  # the largest capacity asked (y = 0)

    def most_work(
        ns: tuple[int, ...], chunks: int, need: Callable[[float], float], base: bool, top: float = math.inf
    ) -> float:
        """At least the largest y in [0, min(y_cap, top)] with need(y) <= kappa_chunks(y), the
        most work ``chunks`` kept chunks can hold (need increasing, so the set is an
        interval); -1 when not even y = 0 qualifies.  The bisection returns its infeasible
        end, so the result never falls short.

        With ``L = limit - sigma·y``: each kept chunk j holds at most ``L / n_j`` (whole layers:
        :class:`Windows`, or the knapsack), so at most the ``chunks`` smallest counts' worth;
        and together at most ``L / n_0``, which the concave knapsack spreads best evenly."""
        runs = base_windows if base else windows

        def ok(y: float) -> bool:
            left = limit - sigma * y
            if left < 0:
                return False
            each = sum(min(knap.value(left / n), runs.value(left / n)) for n in ns[:chunks])
            together = chunks * knap.value(left / (joint[ns] * chunks)) if chunks else 0.0
            return need(y) <= min(each, together) * (1 + 1e-12) + 1e-12
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

    def rank_options(t: float, n: tuple[int, ...], base: bool) -> list[tuple[float, float, float, bool]]:
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

    a_all = sum(limit / joint[ns] for ns in inflight)
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
                    ys[r, i], us[r, i], caps[r, i] = y, u, (limit - sigma * y) / joint[n] if chunks else 0.0
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
    low, high = bisect_feasible(covers, lo * smax / m, rel_tol=CHUNK_REL_TOL, hi=hi, give_up=w * 1e3)
    return math.inf if high == math.inf else max(lo, low * m / smax)
