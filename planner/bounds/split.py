"""The lower bound of one split, and the least transfers of a pipeline's paths.

Lower bound of a split (every schedule; valid for any durations): rank ``r`` can start no
earlier than the first micro-batch's forward path into its first stage, works ``M · c_r``
(its stages' forward + backward + recompute per micro-batch, divided by its speed), and
after the last gradient leaves its first stage, that gradient still has to flow back to
stage 0 (or the rank all-reduces its gradients, whichever is longer):

    LB_r = in_f(r) + idle_r + max(M·c_r + allreduce_r, M·p_r + out_b(r))

where ``p_r`` is what the rank runs before the last gradient leaves: with a split backward
(zero-bubble schedules, ``planned``) its forwards and input gradients, since it may still run
all its weight gradients after that, and the path back crosses input gradients only;
otherwise ``p_r = c_r`` (and the bound is the older ``in_f + M·c_r + idle + max(out_b,
allreduce)``).

``idle_r`` is the wait the schedule's fixed order forces between the last forward and the
last backward of rank ``r`` (1F1B: the downstream path minus the ``w = min(K-r-1, M)``
backwards the rank can run meanwhile, plus, when ``M >= w + 2``, the wait between the first
forward and the first backward: the downstream path minus the ``w`` warm-up forwards run
meanwhile; the two intervals are disjoint because ``F(M-1)`` comes after ``B(0)``; GPipe: the
downstream path of the first micro-batch minus the ``M-1`` forwards that follow it; ZB-H1:
the wait for the first input gradient, its forward and input-gradient path downstream minus
the ``w`` warm-up forwards; every other schedule: 0).  Ranks of several chunks also get one bound per chunk j: the forward
of chunk j on micro-batch 0 waits for the path through every earlier stage, and the rank
has by then run only a fixed number of forwards of each earlier chunk
(:func:`planner.schedules.forwards_before_chunk`: K for interleaved 1F1B).  The simulator's
makespan can only be larger, so ``max_r LB_r`` (:func:`split_lower_bound`) bounds the step
time of that split from below: the search simulates a candidate only when this bound beats
the best plan.

:class:`TransferBounds` gives split-independent lower bounds of the transfers on those paths,
which the configuration bounds (:mod:`planner.bounds.relaxed`, :mod:`planner.bounds.work`,
:mod:`planner.bounds.chain_dp`) add to theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import LayerCosts, allreduce_ms, boundary_transfer_ms, transfer_ms
from planner.schedules import forwards_before_chunk
from planner.schema import Cluster
from planner.search.model import Split, StageModel
from planner.search.space import Group


@dataclass(frozen=True)
class TransferBounds:
    """Split-independent lower bounds of the transfers on a v = 1 pipeline's paths.

    Every boundary moves at least the smallest cut of the model (over the link between
    those positions, or the faster link type when the positions' devices are not fixed):
    ``down[s]`` counts boundaries ``s..K-2`` forward and back (stage s's downstream path),
    ``up[s]`` boundaries before s one way (the forward path into stage s, and the
    gradient's way back).  Constant in the stage's end, so the stage test stays monotone.
    (:mod:`planner.bounds.chain_dp` counts every later stage's recompute and transfers exactly.)
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
        homogeneous = cluster.homogeneous  # (once: it reads every device)
        for s in range(k - 1):
            if homogeneous:
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
    rec = [(sm.R[b] - sm.R[a]) / speed[s] if split.recompute[s] else 0.0 for s, (a, b) in enumerate(ranges)]
    bw = [(sm.B[b] - sm.B[a]) / speed[s] + rec[s] for s, (a, b) in enumerate(ranges)]
    if sm.split_backward:
        iw = [(sm.I[b] - sm.I[a]) / speed[s] + rec[s] for s, (a, b) in enumerate(ranges)]
        # a micro-batch's backward is a B, or an I and a W (together at least as long,
        # planner.cost.split_backward); what sends its gradient on is a B or an I
        grad = [min(x, y) for x, y in zip(bw, iw, strict=True)]
    else:
        grad = bw
    back = bw
    in_f = [0.0] * n
    out_b = [0.0] * n
    for s in range(1, n):
        in_f[s] = in_f[s - 1] + f[s - 1] + xfer[s - 1]
        out_b[s] = out_b[s - 1] + grad[s - 1] + xfer[s - 1]
    # downstream path after stage s: all later stages forward and backward (for ZB-H1 the
    # input gradients: what the first one waits for) plus transfers twice
    later = grad if cfg.schedule == "zb-h1" else bw
    down = [0.0] * n
    for s in range(n - 2, -1, -1):
        down[s] = down[s + 1] + f[s + 1] + later[s + 1] + 2 * xfer[s]
    before = forwards_before_chunk(cfg.schedule, k, m, cfg.virtual_stages)
    best = 0.0
    for r in range(k):
        own = sm.rank_stages[r]
        first = own[0]
        work = m * sum(f[s] + back[s] for s in own)
        # what the rank runs before the last gradient leaves its first stage: everything but
        # the weight gradients it may still defer (all of its work without a split backward)
        pre = m * sum(f[s] + grad[s] for s in own)
        if len(own) == 1:
            ar = sm.allreduce(*ranges[first], groups[split.groups[first]])
        else:
            grad_bytes = sum(sm.PP[ranges[s][1]] - sm.PP[ranges[s][0]] for s in own) * sm.grad_factor
            link = groups[split.groups[first]].link
            ar = allreduce_ms(grad_bytes, cfg.data_parallel, link.bandwidth_bytes_per_s, link.latency_s) * sm.ar_exposed
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
        elif cfg.schedule == "zb-h1":
            # between F(0) and I(0) the rank runs only its w warm-up forwards
            idle = max(0.0, down[first] - min(k - r - 1, m) * f[first])
        elif len(own) > 1:
            # several chunks: before the forward of chunk j on micro-batch 0 the rank has run
            # only before[r][j] forwards of each earlier chunk, so from that start it still
            # has M·c_r minus those forwards to do
            for j, s in enumerate(own):
                if j > 0:
                    done = before[r][j] * sum(f[q] for q in own[:j])
                    best = max(best, in_f[s] + max(work - done + ar, pre - done + out_b[first]))
        best = max(best, in_f[first] + idle + max(work + ar, pre + out_b[first]))
    return best
