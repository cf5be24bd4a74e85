"""How one layer's cost grows with the micro-batch size: the physical fit of measured points.

A profile measures every per-layer quantity (forward and backward time, activation, output and
cut bytes) at a few micro-batch sizes.  On tiny layers those figures carry timer noise: a
size-2 forward can be measured faster than a size-1 forward.  Linear interpolation through such
points, extrapolated to larger sizes, reaches zero, and a plan made of free layers is nonsense.

So every series is first projected onto what physics allows, and only then read at the size a
plan needs.  With ``f`` the cost at micro-batch size ``b``:

* ``f(b) >= 0``;
* ``f`` is non-decreasing: a bigger micro-batch never costs less;
* ``f(b) / b`` is non-increasing: the cost per sample never grows with the batch (a batched
  kernel is at worst as efficient per sample as a smaller one).

:func:`fit` finds the values closest to the measurements (least squares, each point weighted by
``1 / spread**2`` when the profile gives a run-to-run spread) that satisfy the three constraints
at the measured sizes: Dykstra's alternating projections over isotonic regression of the values
(non-decreasing), antitonic regression of the per-sample values (non-increasing, weights
``w * b**2``), and the non-negative orthant.  Most series already satisfy them (synthesized
profiles always do) and are returned unchanged.

:func:`evaluate` reads a fitted series at any size: linearly between measured sizes; below the
smallest and above the largest along the nearest segment, which keeps every constraint (the
fitted points satisfy ``z[i] <= z[i+1] <= z[i] * b[i+1] / b[i]``, so each segment has a
non-negative slope and a non-negative intercept).  A series measured at one size scales in
proportion (``value * b / b0``).  Beyond the largest measured size the figure is an
extrapolation: :func:`extrapolation_note` says so, and how to measure it instead.

This module is the one place that turns measured points into a cost at a micro-batch size;
the cost model (:func:`planner.cost.layer_costs`), and through it the bounds and the
baselines, read it.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Dykstra iterations before giving up on the last few ulps (each is O(n), n = measured sizes)
_MAX_ITERATIONS = 500
_TOLERANCE = 1e-12


def is_physical(sizes: Sequence[int], values: Sequence[float]) -> bool:
    """Whether ``values`` at ``sizes`` already satisfy the three constraints of the module doc."""
    for i, v in enumerate(values):
        if v < 0:
            return False
        if i:
            prev, b0, b1 = values[i - 1], sizes[i - 1], sizes[i]
            if v < prev or v * b0 > prev * b1 * (1 + 1e-12):
                return False
    return True


def _pool_adjacent(values: list[float], weights: list[float], *, increasing: bool) -> list[float]:
    """Weighted isotonic (``increasing``) or antitonic regression by pool-adjacent-violators."""
    blocks: list[list[float]] = []  # [weighted mean, total weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1:
            a, b = blocks[-2], blocks[-1]
            violated = a[0] > b[0] if increasing else a[0] < b[0]
            if not violated:
                break
            total = a[1] + b[1]
            mean = (a[0] * a[1] + b[0] * b[1]) / total if total > 0 else (a[0] + b[0]) / 2
            blocks[-2:] = [[mean, total, a[2] + b[2]]]
    out: list[float] = []
    for mean, _, count in blocks:
        out.extend([mean] * int(count))
    return out


def fit(
    sizes: Sequence[int], values: Sequence[float], *, spread: Sequence[float] | None = None
) -> tuple[float, ...]:
    """The physical values closest to ``values`` measured at ``sizes`` (see the module doc)."""
    y = [float(v) for v in values]
    if is_physical(sizes, y):
        return tuple(y)
    n = len(y)
    if spread is not None:
        floor = max(1e-12, 1e-3 * max((abs(v) for v in y), default=0.0))
        w = [1.0 / max(float(s), floor) ** 2 for s in spread]
    else:
        w = [1.0] * n
    per_sample_w = [wi * b * b for wi, b in zip(w, sizes, strict=True)]
    # Dykstra: project onto C1 (non-decreasing), C2 (per-sample non-increasing), C3 (>= 0)
    x = list(y)
    p = [[0.0] * n for _ in range(3)]
    for _ in range(_MAX_ITERATIONS):
        before = list(x)
        for k in range(3):
            shifted = [xi + pi for xi, pi in zip(x, p[k], strict=True)]
            if k == 0:
                projected = _pool_adjacent(shifted, w, increasing=True)
            elif k == 1:
                rates = [v / b for v, b in zip(shifted, sizes, strict=True)]
                projected = [r * b for r, b in zip(_pool_adjacent(rates, per_sample_w, increasing=False), sizes, strict=True)]
            else:
                projected = [max(0.0, v) for v in shifted]
            p[k] = [s - q for s, q in zip(shifted, projected, strict=True)]
            x = projected
        if max(abs(a - b) for a, b in zip(x, before, strict=True)) <= _TOLERANCE * (1 + max(map(abs, x))):
            break
    return tuple(_repair(sizes, x))


def _repair(sizes: Sequence[int], x: Sequence[float]) -> list[float]:
    """Remove the rounding residue of the iteration so the constraints hold exactly."""
    out = [max(0.0, float(x[0]))]
    for i in range(1, len(x)):
        lo = out[-1]
        hi = out[-1] * sizes[i] / sizes[i - 1]
        out.append(min(max(float(x[i]), lo), hi))
    return out


def evaluate(sizes: Sequence[int], fitted: Sequence[float], b: float) -> float:
    """A fitted series (see :func:`fit`) read at micro-batch size ``b``."""
    if len(sizes) == 1:
        return float(fitted[0]) * b / sizes[0]
    if b <= sizes[0]:
        i = 0
    elif b >= sizes[-1]:
        i = len(sizes) - 2
    else:
        i = next(j for j in range(len(sizes) - 1) if sizes[j] <= b <= sizes[j + 1])
    x0, x1 = sizes[i], sizes[i + 1]
    y0, y1 = float(fitted[i]), float(fitted[i + 1])
    return max(0.0, y0 + (y1 - y0) * (b - x0) / (x1 - x0))


def at_size(
    sizes: Sequence[int], values: Sequence[float], b: float, *, spread: Sequence[float] | None = None
) -> float:
    """Fit the measured ``values`` and read the fit at ``b`` (one series, one size)."""
    return evaluate(sizes, fit(sizes, values, spread=spread), b)


def linear(sizes: Sequence[int], values: Sequence[float], b: float) -> float:
    """A signed correction (e.g. ``KeptInput.bytes``, negative for a slice) read at ``b``:
    linear between measured sizes and along the nearest segment outside them, not fitted (the
    constraints of the module doc are for costs, not for corrections to them)."""
    if len(sizes) == 1:
        return float(values[0]) * b / sizes[0]
    if b <= sizes[0]:
        i = 0
    elif b >= sizes[-1]:
        i = len(sizes) - 2
    else:
        i = next(j for j in range(len(sizes) - 1) if sizes[j] <= b <= sizes[j + 1])
    x0, x1 = sizes[i], sizes[i + 1]
    y0, y1 = float(values[i]), float(values[i + 1])
    return y0 + (y1 - y0) * (b - x0) / (x1 - x0)


def extrapolation_note(sizes: Sequence[int], b: int) -> str | None:
    """A sentence for plans whose micro-batch size ``b`` lies beyond the measured sizes, else None."""
    largest = max(sizes)
    if b <= largest:
        return None
    wanted = sorted({*sizes, *_doublings(largest, b), b})
    return (
        f"micro-batch {b} is extrapolated from sizes up to {largest}; profile with "
        f"--microbatch-sizes {','.join(str(s) for s in wanted)} for a measured figure"
    )


def _doublings(start: int, stop: int) -> list[int]:
    out = []
    s = start * 2
    while s < stop:
        out.append(s)
        s *= 2
    return out
