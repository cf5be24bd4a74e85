"""The fractional knapsack the memory bounds share, and what the options let them assume.

:class:`Knapsack` answers "the most forward + backward work of layers whose activations total
at most ``A`` bytes", layers taken fractionally, best work per activation byte first: an upper
bound of the work any set of chunks can keep activations for.  :func:`state_per_work` (least
parameter-state bytes per unit of work) and :func:`recompute_freedom` (may stages keep,
may they recompute) are the other two facts :mod:`planner.bounds.memory` and
:mod:`planner.bounds.chunk_memory` build on.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import LayerCosts, static_bytes
from planner.schema import PlanOptions, TrainingSetup
from planner.search.state import SearchState


@dataclass(frozen=True)
class Knapsack:
    """Layers sorted by work per activation byte (zero-activation layers first), with prefix
    sums: ``value(A)`` is the most forward + backward work (at speed 1) of any set of layers
    whose activations total at most ``A`` bytes, layers taken fractionally (an upper bound).
    A profile whose kept inputs can shrink a stage below its layers' sum (``slack`` bytes at
    most, :attr:`planner.cost.LayerCosts.activation_slack`) gets ``slack`` more room."""

    acts: tuple[float, ...]
    prefix_acts: tuple[float, ...]
    prefix_work: tuple[float, ...]
    #: least recompute overhead per unit of work: min over layers of r / (f + b), r what its
    #: recompute re-runs (``LayerCosts.recompute_ms``)
    phi: float
    work: float
    slack: float = 0.0

    @staticmethod
    def of(costs: LayerCosts) -> Knapsack:
        items = []
        phi = math.inf
        for f, b, a, r in zip(costs.forward_ms, costs.backward_ms, costs.activation_bytes, costs.recompute_ms,
                              strict=True):
            w = f + b
            if w > 0:
                phi = min(phi, r / w)
            items.append((-(w / a) if a > 0 else -math.inf, a, w))
        items.sort()
        pa, pw = [0.0], [0.0]
        for _, a, w in items:
            pa.append(pa[-1] + a)
            pw.append(pw[-1] + w)
        return Knapsack(
            tuple(a for _, a, _ in items), tuple(pa), tuple(pw), 0.0 if phi == math.inf else phi, pw[-1],
            costs.activation_slack,
        )

    def value(self, capacity: float) -> float:
        capacity += self.slack
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
            cap += self.slack
            i = min(max(0, bisect.bisect_right(self.prefix_acts, cap) - 1), len(self.acts) - 1)
            while i < len(self.acts) and self.acts[i] <= 0:
                i += 1
            if i < len(self.acts):
                beta = (self.prefix_work[i + 1] - self.prefix_work[i]) / self.acts[i]
                lines.add((self.prefix_work[i] - beta * self.prefix_acts[i] + beta * self.slack, beta))
        return lines


def knapsack_at(search: SearchState, b: int) -> Knapsack:
    """The :class:`Knapsack` of micro-batch size ``b``, built once per search."""
    return search.table(Knapsack, b, lambda: Knapsack.of(search.costs_at(b)))


def state_per_work(costs: LayerCosts, training: TrainingSetup) -> float:
    """Least parameter-state bytes (parameters, gradients, optimizer) per unit of forward +
    backward work over the layers that do work (0 when none does)."""
    sigma = math.inf
    for f, bw, pb in zip(costs.forward_ms, costs.backward_ms, costs.param_bytes, strict=True):
        if f + bw > 0:
            sigma = min(sigma, static_bytes(pb, training) / (f + bw))
    return 0.0 if sigma == math.inf else sigma


def recompute_freedom(options: PlanOptions) -> tuple[bool, bool]:
    """(some stage may keep its activations, some stage may recompute) under the options."""
    rc = options.recompute
    if isinstance(rc, bool):
        return not rc, rc
    if isinstance(rc, list):
        return not all(rc), any(rc)
    return True, True
