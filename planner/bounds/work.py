"""Work bounds of a configuration: total work, fill, all-reduce, indivisible layers, pinned ranks.

:func:`cheap_bound` is the closed-form bound every configuration gets before any search (level
0 of :mod:`planner.search.driver`); it is the largest of

* total work ÷ total speed, plus the pipeline fill and the gradient all-reduce;
* the recompute memory forces (:func:`planner.bounds.memory.memory_work_bound`);
* ranks known in part with their all-reduce (:func:`rank_allreduce_bound`, on the tables of
  :class:`PinnedRanks`): rank 0, rank K-1 and the busiest rank, since layers cannot be divided;
* the last stage, which waits for micro-batch 0 to pass forward through every earlier layer;
* for one chunk per device, the continuous relaxation of the min-max split.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from planner.bounds.memory import memory_work_bound
from planner.cost import LayerCosts, allreduce_ms
from planner.schedules import SPLIT_BACKWARD, placement_of
from planner.search.model import StageModel, work_total
from planner.search.space import Config, Group
from planner.search.state import SearchState


def cheap_bound(search: SearchState, cfg: Config, groups: Sequence[Group]) -> float:
    """A closed-form lower bound of any split of ``cfg`` (no memory)."""
    costs = search.costs_at(cfg.microbatch_size(search.training.global_batch_size))
    w = work_total(costs)
    m, k = cfg.num_microbatches, cfg.pipeline_degree
    smax = max(g.speed for g in groups)
    ssum = sum(g.speed for g in groups)
    split_bw = cfg.schedule in SPLIT_BACKWARD
    # one micro-batch goes forward through every layer and its gradient back (a split
    # backward's weight gradients need not be on that path)
    path = w if not split_bw else costs.prefix_forward[-1] + costs.prefix_grad[-1]
    bound = max(m * w / ssum, path / smax)
    # every rank r starts after the forward path through the stages before its first
    # stage (at least r layers) and ends after the backward path back: averaging the ranks'
    # bounds with weights speed_r / sum(speed) gives
    smin = min(g.speed for g in groups)
    # (a split backward may defer its weight gradients past the gradient's way back: then
    # only the way in counts)
    first = sum(
        costs.prefix_forward[r] + (0.0 if split_bw else costs.prefix_backward[r]) for r in range(min(k, costs.num_layers))
    )
    bound = max(bound, m * w / ssum + smin * first / (ssum * smax))
    d = cfg.data_parallel
    if d > 1:
        # every rank all-reduces its gradients after its work: averaging finish + all-reduce
        # over the ranks (weights speed_r / sum(speed)) bounds the slowest from below
        link = max((g.link for g in groups), key=lambda li: (li.bandwidth_bytes_per_s, -li.latency_s))
        grads = costs.prefix_param[-1] * search.training.gradient_bytes_per_param_byte
        # a rank with no gradient bytes all-reduces nothing and pays no latency (ZeRO 3, layers
        # without parameters): every rank pays it only when every layer has parameters
        paying = 0 if grads <= 0 else (k if costs.params_in_every_layer else 1)
        ar_all = (2 * (d - 1) / d * grads / link.bandwidth_bytes_per_s + paying * 2 * (d - 1) * link.latency_s) * 1e3
        ar_all *= 1.0 - search.training.gradient_overlap
        bound = max(bound, m * w / ssum + smin * ar_all / ssum)
    # (both shared by the schedules of one shape: cached on what they read)
    groups_key = tuple(g.devices for g in groups)
    counts = tuple(StageModel.joint_of(cfg, costs.num_layers))
    mem_key = (cfg.microbatch_size(search.training.global_batch_size), cfg.num_microbatches, counts, groups_key)
    bound = max(bound, search.table(_Cached, ("memory", mem_key), lambda: _Cached(memory_work_bound(search, cfg, groups))).value)
    # indivisible layers: some rank holds the heaviest ones (and all-reduces them)
    pinned_key = (
        cfg.microbatch_size(search.training.global_batch_size), cfg.data_parallel, cfg.pipeline_degree,
        cfg.num_microbatches, cfg.virtual_stages, placement_of(cfg.schedule), split_bw, groups_key,
    )
    bound = max(bound, search.table(_Cached, ("pinned", pinned_key), lambda: _Cached(rank_allreduce_bound(search, cfg, groups))).value)
    # the last stage holds the last layer and cannot start before micro-batch 0 has gone
    # forward through every earlier layer; then its rank still works at least M times that
    # layer (interleaved: its earlier chunks' warm-up forwards come out of its own work, see
    # planner.bounds.split), and without interleaving the gradient must also flow back through them
    n_l = costs.num_layers
    last = costs.prefix_forward[n_l] - costs.prefix_forward[n_l - 1] + costs.prefix_backward[n_l] - costs.prefix_backward[n_l - 1]
    path = costs.prefix_forward[n_l - 1] + (costs.prefix_backward[n_l - 1] if cfg.virtual_stages == 1 and not split_bw else 0.0)
    bound = max(bound, (path + m * last) / smax)
    if cfg.virtual_stages == 1 and split_bw:
        # the last stage's input gradients come before its deferred weight gradients, and the
        # last one still has to flow back through every earlier layer (its cheaper of B and I)
        pre = costs.forward_ms[n_l - 1] + costs.prefix_grad[n_l] - costs.prefix_grad[n_l - 1]
        bound = max(bound, (costs.prefix_forward[n_l - 1] + m * pre + costs.prefix_grad[n_l - 1]) / smax)
    if cfg.virtual_stages == 1 and m > 1:
        # continuous relaxation of min over splits of max_s (P[a_s] + M c_s), with P the work
        # before the stage (forward path in and gradient path out, which a B-only schedule
        # adds to its rank's work): the reach y_{s+1} = y_s + (T - y_s) / M gives
        # T >= W / (1 - ((M-1)/M)^K).  A split backward may defer its weight gradients past
        # the gradient's way out, so only the forward path counts: P(y) >= alpha·y with
        # alpha the least forward share of any layer, and T >= alpha·W / (1 - (1-alpha/M)^K)
        alpha = costs.min_forward_share if split_bw else 1.0
        if alpha > 0:
            q = (1 - alpha / m) ** k
            bound = max(bound, alpha * w / smax / (1 - q))
    return bound


@dataclass(frozen=True)
class _Cached:
    value: float


class PinnedRanks:
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

    def ends(self, k: int, v: int, *, v_shape: bool = False) -> tuple[tuple[float, float], tuple[float, float] | None]:
        """(work, params) at least of rank 0 and of rank K-1 (K >= 2): the end layer and
        ``v - 1`` more (one per other chunk), rank K-1's from layer K-1 on.  In the V
        placement (``v_shape``) rank 0 holds both end layers and rank K-1 neither: (rank 0's,
        None)."""
        if v_shape:
            n = self.n
            both = (self.work[0] + self.work[n - 1], self.params[0] + self.params[n - 1]) if n > 1 else (self.work[0], self.params[0])
            return both, None
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


def rank_allreduce_bound(search: SearchState, cfg: Config, groups: Sequence[Group]) -> float:
    """Ranks known in part, with their gradient all-reduce.

    A rank runs its M micro-batches and then all-reduces its gradients (the step is the
    latest finish plus all-reduce), so ``T >= in_f + M·work_r / speed + max(out_b,
    allreduce(params_r))`` for every rank r.  Three ranks are pinned down whatever the split
    (:class:`PinnedRanks`):

    * rank 0 holds layer 0 and, one per other chunk, at least v - 1 more layers (not the
      last one, which is on rank K-1 when K >= 2);
    * rank K-1 holds the last layer and v - 1 more from layer K-1 on; its first stage comes
      after at least K - 1 layers, forward on the way in and backward on the gradient's way
      back (plus the least transfers of :class:`planner.bounds.split.TransferBounds`);
    * the busiest rank: layers cannot be divided, so among the ``j·K + 1`` largest layers
      some rank holds j + 1, and works at least the j + 1 smallest of them (j = 0: the
      largest layer), with at least the j + 1 smallest parameters among them.

    Work and parameters are bounded separately (the lightest layers for each); the
    all-reduce uses the fastest link of any group.  With one rank it holds every layer.
    """
    b = cfg.microbatch_size(search.training.global_batch_size)
    costs = search.costs_at(b)
    k, m, v, d = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages, cfg.data_parallel
    pinned = search.table(PinnedRanks, b, lambda: PinnedRanks(costs))
    smax = max(g.speed for g in groups)
    link = max((g.link for g in groups), key=lambda li: (li.bandwidth_bytes_per_s, -li.latency_s))
    factor = search.training.gradient_bytes_per_param_byte

    def rank_bound(path_f: float, path_b: float, work_params: tuple[float, float]) -> float:
        grads = work_params[1] * factor
        ar = allreduce_ms(grads, d, link.bandwidth_bytes_per_s, link.latency_s) * (1.0 - search.training.gradient_overlap)
        return path_f + m * work_params[0] / smax + max(path_b, ar)

    if k == 1:  # one rank holds every layer
        return rank_bound(0.0, 0.0, (sum(pinned.work), sum(pinned.params)))
    first, last = pinned.ends(k, v, v_shape=placement_of(cfg.schedule) == "v")
    bound = max(rank_bound(0.0, 0.0, first), *(rank_bound(0.0, 0.0, x) for x in pinned.busiest(k)))
    if last is None:
        return bound
    up = search.transfers_at(b, groups).up
    fill_f = costs.prefix_forward[k - 1] / smax + up[k - 1]
    # a split backward may run its weight gradients after the gradient has gone back
    fill_b = 0.0 if cfg.schedule in SPLIT_BACKWARD else costs.prefix_backward[k - 1] / smax + up[k - 1]
    return max(bound, rank_bound(fill_f, fill_b, last))
