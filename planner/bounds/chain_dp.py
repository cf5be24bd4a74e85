"""Exact bound of a one-chunk pipeline (v = 1) by dynamic programming over its boundaries.

:func:`planner.bounds.relaxed.relaxed_bound` decides "is there a split whose every stage passes a
relaxed test at ``t``" with a farthest-reach greedy.  That greedy is only exact for a
test that sees nothing beyond its own stage, so the stage's downstream path (which the
1F1B and GPipe waits depend on) is counted without the later stages' recompute and
transfers.  On memory-bound models those are what the plan pays for: in a 1024-layer,
64-device plan the early ranks recompute, and every rank before them waits for that
recompute twice, in the fill and in the drain.

Here the test of stage ``s`` is the split bound of :func:`planner.bounds.split.split_lower_bound`
itself, with one relaxation: the gradient's way back into the stage (``out_b``) is counted
without the recompute of earlier stages (the forward path into it, ``in_f``, has none).
Transfers before the stage are the smallest each boundary can cost.  Everything after the
stage is exact, because the table is built from the last stage backwards:

    G[s][a] = least (recompute + transfers, both ways) on the path of stages s..K-1
              covering layers [a, L), over the splits whose every stage passes at t

A stage ``[a, b)`` passes when ``in_f + M·work + idle + max(out_b, allreduce) <= t`` with
``idle`` computed from ``down = W[b:] + 2·x(b) + G[s+1][b]`` (the waits only grow with
``down``, so the least ``G`` is the best suffix for every earlier stage), and when it fits
memory exactly as :func:`planner.cost.rank_memory_bytes` says.  In 1F1B it must also
pass the ping-pong path it forms with the next rank (:func:`_pair_bound`): the table keeps
beside ``G`` the least ``cycles·c_{s+1} + G`` over the next stage's choices, which is all that
path needs of the suffix (taking the two minima apart is a relaxation, so still valid).
``G[0][0]`` finite means some split passes every test at ``t``; infinite proves that every
split of the configuration takes longer than ``t``.  The table is computed with numpy, every
start ``a`` at once for each stage length; a stage holds 1 to ``longest`` layers (the most
whose M micro-batches fit in ``t``), which limits the starts each stage can have.

Every one-chunk schedule: the waits are counted for 1F1B and GPipe only; with a split
backward the stage test is the split bound's ``max(M·work + allreduce, M·pre_gradient +
out_b)``, since the weight gradients may run after the last gradient has gone back (memory
uses the closed-form in-flight count, a lower bound where it is not exact).

Homogeneous clusters only: with mixed devices the positions' speeds depend on the device
order, which the other bounds relax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from planner.bounds.split import TransferBounds
from planner.cost import boundary_transfer_ms
from planner.schema import Cluster, PlanOptions, TrainingSetup
from planner.search.model import Split, StageModel, recompute_options
from planner.search.space import Group

if TYPE_CHECKING:
    import numpy as np

#: skip configurations whose table has more entries (stages x starts x stage lengths); about 1 s
MAX_CELLS = 8_000_000


def chain_cells(sm: StageModel, groups: Sequence[Group], t: float) -> int:
    """Entries of the table at ``t`` (its cost): over the stages, the starts a stage can
    have times the most layers a stage can hold."""
    k, n_layers = sm.cfg.pipeline_degree, sm.L
    longest = max(1, _longest_stage(sm, groups, t))
    cells = 0
    for s in range(k):
        lo, hi = _start_range(s, k, n_layers, longest)
        cells += max(0, hi + 1 - lo) * longest
    return cells


def _start_range(s: int, k: int, n_layers: int, longest: int) -> tuple[int, int]:
    """Every stage holds 1..longest layers, so stage s starts within [lo, hi]."""
    return max(s, n_layers - (k - s) * longest), min(n_layers - (k - s), s * longest)


def _longest_stage(sm: StageModel, groups: Sequence[Group], t: float) -> int:
    """Most layers any stage can hold when its M micro-batches alone take at most ``t``."""
    import numpy as np

    speed = max(g.speed for g in groups)
    work = np.asarray(sm.F) + np.asarray(sm.B)
    reach = np.searchsorted(work, work + t * speed / sm.cfg.num_microbatches * (1 + 1e-9), side="right") - 1
    return int((reach - np.arange(sm.L + 1)).max())


def chain_split(
    sm: StageModel,
    groups: Sequence[Group],
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions,
    t: float,
) -> tuple[tuple[tuple[int, int], ...], tuple[bool, ...]] | None:
    """A split (ranges, recompute flags) of ``sm.cfg`` (v = 1, homogeneous cluster) whose
    every stage passes the test at ``t`` with the least downstream recompute, or None when
    none does: then every split takes longer than ``t``."""
    import numpy as np

    cfg = sm.cfg
    k, m, d = cfg.pipeline_degree, cfg.num_microbatches, cfg.data_parallel
    n_layers = sm.L
    costs = sm.costs
    speed = groups[0].speed
    f_pre = np.asarray(sm.F) / speed
    b_pre = np.asarray(sm.B) / speed
    r_pre = np.asarray(sm.R) / speed  # what a recompute re-runs
    split_bw = sm.split_backward
    # the gradient's path back: per layer the cheaper of B and I in split-backward schedules
    g_pre = np.asarray(sm.G) / speed if split_bw else b_pre
    p_pre = np.asarray(sm.PP, dtype=float)
    a_pre = np.asarray(costs.prefix_activation)
    total = f_pre[-1] + b_pre[-1]
    inputs = np.array([costs.stage_input_bytes(a) if a < n_layers else 0.0 for a in range(n_layers + 1)])
    # cut[b]: bytes crossing a boundary right after layer b - 1 (b = 1..L-1)
    cut = np.array([0.0, *costs.cut_bytes])
    state_factor = 1.0 + training.gradient_bytes_per_param_byte + training.optimizer_state_factor

    transfers = TransferBounds.of(cluster, sm.costs, groups)  # homogeneous: exact link types
    up, hop_links = transfers.up, transfers.links

    longest = _longest_stage(sm, groups, t)
    # every (stage length, start) at once: row l - 1 holds the stages [a, a + l)
    starts = np.arange(n_layers + 1)[None, :]
    ends = starts + np.arange(1, longest + 1)[:, None]
    inside = ends <= n_layers
    ends = np.minimum(ends, n_layers)  # safe indices; ``inside`` masks the rest
    fwd = f_pre[ends] - f_pre[starts]
    bwd = b_pre[ends] - b_pre[starts]
    redo = r_pre[ends] - r_pre[starts]
    static = (p_pre[ends] - p_pre[starts]) * state_factor
    acts = a_pre[ends] - a_pre[starts]
    # what a stage checkpointed layer by layer keeps per micro-batch (LayerCosts.checkpoint_bytes):
    # its input, each later layer's input (the bytes crossing a cut before it), and the last
    # layer's loss
    cut_pre = np.asarray(costs.prefix_cut, dtype=float)
    checkpoints = inputs[starts] + cut_pre[ends - 1] - cut_pre[starts] + np.where(
        ends == n_layers, costs.activation_bytes[-1], 0.0)
    # the largest one layer of each stage: what a stage checkpointed layer by layer re-materialises
    layer_acts = np.asarray(costs.activation_bytes, dtype=float)
    top = np.maximum.accumulate(layer_acts[np.minimum(starts + np.arange(longest)[:, None], n_layers - 1)], axis=0)
    grads = (p_pre[ends] - p_pre[starts]) * training.gradient_bytes_per_param_byte
    after = total - f_pre[ends] - b_pre[ends]  # work of the later layers
    after_g = f_pre[-1] + g_pre[-1] - f_pre[ends] - g_pre[ends]  # their forwards and gradients
    back_after = b_pre[-1] - b_pre[ends]
    inf = math.inf
    nxt = np.full(n_layers + 1, inf)  # G[s+1][.]: only the empty suffix at L is covered
    nxt[n_layers] = 0.0
    # Q[s+1][.]: least n_c(s)·c_{s+1} + G over stage s+1's choices (the pair bound's share)
    nxt_q = np.full(n_layers + 1, inf)
    one_f_one_b = cfg.schedule == "1f1b"
    # per stage: the chosen length and recompute flag of every start (to rebuild the split)
    lengths: list[np.ndarray] = []
    flags: list[np.ndarray] = []
    for s in range(k - 1, -1, -1):
        # cycles of the pair bound of (s, s+1), and of (s-1, s) for the next Q
        cycles = _cycles(k, m, s) if one_f_one_b and s < k - 1 else 0
        cycles_before = _cycles(k, m, s - 1) if one_f_one_b and s > 0 else 0
        w = min(k - s - 1, m)
        link = groups[s].link
        best = np.full(n_layers + 1, inf)
        best_q = np.full(n_layers + 1, inf)
        best_len = np.zeros(n_layers + 1, dtype=int)
        best_rc = np.zeros(n_layers + 1, dtype=bool)
        lo, hi = _start_range(s, k, n_layers, longest)
        if lo <= hi:
            cols = slice(lo, hi + 1)
            st, en = starts[:, cols], ends[:, cols]
            fw, bk, rd = fwd[:, cols], bwd[:, cols], redo[:, cols]
            later = nxt[en]
            usable = inside[:, cols] & np.isfinite(later) & ((en == n_layers) if s == k - 1 else True)
            later = np.where(usable, later, 0.0)
            xfer = np.zeros_like(fw)
            if s < k - 1:
                for bw_, lat in hop_links[s]:
                    xfer = np.maximum(xfer, (cut[en] / bw_ + lat) * 1e3)
            down = after[:, cols] + 2 * xfer + later
            down_g = after_g[:, cols] + 2 * xfer + later
            if d > 1:
                steps = 2 * (d - 1)
                gr = grads[:, cols]
                ar = np.where(gr > 0, (steps / d * gr / link.bandwidth_bytes_per_s + steps * link.latency_s) * 1e3, 0.0)
                ar = ar * (1.0 - training.gradient_overlap)
            else:
                ar = np.zeros_like(fw)
            back = (g_pre + up[s])[st]
            tail = np.maximum(back, ar)
            gw = g_pre[en] - g_pre[st]
            head = f_pre[-1] + up[s] + back_after[:, cols] + np.where(usable, nxt_q[en], inf)
            columns = np.arange(hi + 1 - lo)
            for rc in recompute_options(options, s):
                bw_total = bk + rd if rc else bk
                if cfg.schedule == "1f1b":
                    idle = np.maximum(0.0, down - w * bw_total)
                    if m >= w + 2:
                        idle = idle + np.maximum(0.0, down - w * fw)
                elif cfg.schedule == "gpipe":
                    idle = np.maximum(0.0, down - (m - 1) * fw)
                elif cfg.schedule == "zb-h1":
                    # the first input gradient's wait (planner.bounds.split), on the input
                    # gradients' path downstream
                    idle = np.maximum(0.0, down_g - w * fw)
                else:  # the other one-chunk schedules: no forced wait is counted
                    idle = np.zeros_like(fw)
                if split_bw:
                    # the weight gradients may run after the last gradient has gone back
                    pre = fw + gw + (rd if rc else 0.0)
                    bound = (f_pre + up[s])[st] + idle + np.maximum(m * (fw + bw_total) + ar, m * pre + back)
                else:
                    bound = (f_pre + up[s])[st] + m * (fw + bw_total) + idle + tail
                # memory at the rank's first backward (exact for 1F1B and GPipe, a lower bound else)
                # (a recomputing stage keeps its checkpoints per micro-batch in flight, plus its
                # largest layer re-materialised during the backward)
                kept = sm.inflight[s] * checkpoints[:, cols] + top[:, cols] if rc else sm.inflight[s] * acts[:, cols]
                ok = usable & (bound <= t) & (np.ceil(static[:, cols] + kept) <= groups[s].limit_bytes)
                if cycles:
                    ok &= _pair_bound(cycles, m, w, head, fw, bw_total, xfer, tail) <= t
                value = np.where(ok, later + 2 * xfer + (rd if rc else 0.0), inf)
                row = value.argmin(axis=0)
                low = value[row, columns]
                better = low < best[cols]
                best[cols] = np.where(better, low, best[cols])
                best_len[cols] = np.where(better, row + 1, best_len[cols])
                best_rc[cols] = np.where(better, rc, best_rc[cols])
                if cycles_before:
                    best_q[cols] = np.minimum(best_q[cols], (cycles_before * (fw + bw_total) + value).min(axis=0))
        nxt, nxt_q = best, best_q
        lengths.append(best_len)
        flags.append(best_rc)
    if not np.isfinite(nxt[0]):
        return None
    lengths.reverse()
    flags.reverse()
    ranges, rcs, start = [], [], 0
    for s in range(k):
        stop = start + int(lengths[s][start])
        ranges.append((start, stop))
        rcs.append(bool(flags[s][start]))
        start = stop
    return tuple(ranges), tuple(rcs)


def _cycles(k: int, m: int, r: int) -> int:
    """Ping-pong cycles of ranks r and r+1 in 1F1B (see :func:`_pair_bound`); 0 if none."""
    w = min(k - r - 1, m)
    return (m - w - 2) // 2 + 1 if m - w - 2 >= 0 else 0


def _pair_bound(cycles: int, m: int, w: int, head: Any, fwd: Any, bwd: Any, xfer: Any, tail: Any) -> Any:
    """A path of 1F1B through ranks r and r+1 (with ``w = K - r - 1`` warm-up forwards on r).

    In the steady state, rank r runs ``F(w+i+1)`` right after ``B(i)`` and rank r+1 runs
    ``B(i+2)`` right after ``F(w+i+1)``, so the path ``B(i)@r+1 -> B(i)@r -> F(w+i+1)@r ->
    F(w+i+1)@r+1 -> B(i+2)@r+1`` repeats every two micro-batches for ``cycles`` rounds, each
    costing both ranks' forward + backward and the boundary's transfer twice: a slow link
    between two busy stages stretches every micro-batch.  Before it lies micro-batch 0's
    path (every forward and transfer, then the backwards of stages r+1.. and their
    transfers: ``head`` holds all of that except ``x``, plus ``cycles·c_{r+1}``); after it,
    ``B(2·cycles)`` on rank r and every action rank r still has, then the tail.  Floats
    (one split) or arrays (every start of a stage at once) alike.
    """
    after_f = max(0, m - w - 2 * cycles - 1)
    after_b = m - 2 * cycles - 1
    return (
        head + xfer + cycles * (2 * xfer + fwd + bwd) + xfer + bwd + after_f * fwd + after_b * bwd + tail
    )


def split_pair_bound(sm: StageModel, groups: Sequence[Group], cluster: Cluster, split: Split) -> float:
    """The largest pair path (:func:`_pair_bound`) of a 1F1B split over every boundary: no
    simulation of the split is faster (0 for other schedules)."""
    cfg = sm.cfg
    k, m = cfg.pipeline_degree, cfg.num_microbatches
    if cfg.schedule != "1f1b" or k < 2:
        return 0.0
    ranges = list(split.ranges)
    speed = [groups[g].speed for g in split.groups]
    f = [(sm.F[b] - sm.F[a]) / speed[s] for s, (a, b) in enumerate(ranges)]
    bw = [(sm.B[b] - sm.B[a] + (sm.R[b] - sm.R[a] if split.recompute[s] else 0.0)) / speed[s]
          for s, (a, b) in enumerate(ranges)]
    x = boundary_transfer_ms(sm.costs, ranges, [list(groups[g].devices) for g in split.groups], cluster)
    best = 0.0
    out_b = 0.0
    for r in range(k - 1):
        cycles = _cycles(k, m, r)
        if cycles:
            # micro-batch 0 forward through every stage, then back to stage r+1
            first = sum(f) + sum(x) + sum(bw[r + 1 :]) + sum(x[r + 1 :])
            ar = sm.allreduce(*ranges[r], groups[split.groups[r]])
            head = first - x[r] + cycles * (f[r + 1] + bw[r + 1])
            w = min(k - r - 1, m)
            best = max(best, float(_pair_bound(cycles, m, w, head, f[r], bw[r], x[r], max(out_b, ar))))
        out_b += bw[r] + x[r]
    return best
