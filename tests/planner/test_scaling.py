"""The physical fit of measured per-layer series (planner.scaling), against its definition."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from planner import scaling

SIZES = st.lists(st.integers(1, 64), min_size=1, max_size=6, unique=True).map(sorted)
VALUE = st.one_of(st.just(0.0), st.floats(0, 100, allow_nan=False, allow_infinity=False))


@st.composite
def series(draw: st.DrawFn) -> tuple[list[int], list[float], list[float] | None]:
    sizes = draw(SIZES)
    values = draw(st.lists(VALUE, min_size=len(sizes), max_size=len(sizes)))
    spread = draw(st.none() | st.lists(st.floats(0, 10), min_size=len(sizes), max_size=len(sizes)))
    return sizes, values, spread


def _physical(sizes: list[int], z: tuple[float, ...], tol: float = 1e-9) -> bool:
    scale = 1 + max(z, default=0)
    for i, v in enumerate(z):
        if v < -tol * scale:
            return False
        if i and (v < z[i - 1] - tol * scale or v / sizes[i] > z[i - 1] / sizes[i - 1] + tol * scale):
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(series())
def test_fit_is_physical_and_idempotent(data: tuple[list[int], list[float], list[float] | None]) -> None:
    sizes, values, spread = data
    z = scaling.fit(sizes, values, spread=spread)
    assert _physical(sizes, z)
    assert scaling.is_physical(sizes, z)
    assert scaling.fit(sizes, z, spread=spread) == z


@settings(max_examples=300, deadline=None)
@given(series(), st.data())
def test_fit_is_the_closest_physical_series(data: tuple[list[int], list[float], list[float] | None], draw: st.DataObject) -> None:
    """A projection onto a convex set: <y - x, z - x>_w <= 0 for every physical z."""
    sizes, values, _ = data
    x = scaling.fit(sizes, values)
    # random physical candidates: z0 >= 0, then each step within [z, z * b1 / b0]
    z = [draw.draw(st.floats(0, 100))]
    for i in range(1, len(sizes)):
        hi = z[-1] * sizes[i] / sizes[i - 1]
        z.append(z[-1] + draw.draw(st.floats(0, 1)) * (hi - z[-1]))
    inner = sum((y - xi) * (zi - xi) for y, xi, zi in zip(values, x, z, strict=True))
    assert inner <= 1e-6 * (1 + sum(v * v for v in values))
    dist = math.dist(values, x)
    assert dist <= math.dist(values, z) + 1e-6 * (1 + dist)


def test_physical_series_are_kept_exactly() -> None:
    assert scaling.fit([1, 2, 4, 8], [1.0, 1.5, 2.5, 4.0]) == (1.0, 1.5, 2.5, 4.0)


def test_noise_is_pooled_not_followed() -> None:
    # the noisy-profile case: size 2 measured faster than size 1
    assert scaling.fit([1, 2], [0.05, 0.03]) == (0.04, 0.04)
    # superlinear growth (per-sample cost rising) is fitted down to per-sample constant
    # (least squares on the line z2 = 2 z1: z1 = (1 + 2 * 3) / 5)
    z = scaling.fit([1, 2], [1.0, 3.0])
    assert math.isclose(z[0], 1.4, rel_tol=1e-6) and math.isclose(z[1], 2.8, rel_tol=1e-6)


def test_spread_weights_trust_the_precise_point() -> None:
    precise_first = scaling.fit([1, 2], [0.05, 0.03], spread=[0.001, 0.02])
    precise_second = scaling.fit([1, 2], [0.05, 0.03], spread=[0.02, 0.001])
    assert precise_first[0] > 0.049 and precise_second[0] < 0.031


@settings(max_examples=300, deadline=None)
@given(series(), st.lists(st.floats(0.01, 1024), min_size=2, max_size=8))
def test_evaluate_keeps_the_constraints_everywhere(
    data: tuple[list[int], list[float], list[float] | None], points: list[float]
) -> None:
    sizes, values, spread = data
    z = scaling.fit(sizes, values, spread=spread)
    pts = sorted(points)
    f = [scaling.evaluate(sizes, z, b) for b in pts]
    for (b0, f0), (b1, f1) in zip(zip(pts, f, strict=True), zip(pts[1:], f[1:], strict=True), strict=False):
        assert f0 >= 0 and f1 >= f0 - 1e-9 * (1 + f0)
        assert f1 / b1 <= f0 / b0 + 1e-9 * (1 + f0 / b0)
    if z[-1] > 0:  # never extrapolated to zero
        assert all(v > 0 for b, v in zip(pts, f, strict=True) if b >= sizes[-1])


def test_extrapolation_note() -> None:
    assert scaling.extrapolation_note([1, 2], 2) is None
    note = scaling.extrapolation_note([1, 2], 8)
    assert note == (
        "micro-batch 8 is extrapolated from sizes up to 2; profile with "
        "--microbatch-sizes 1,2,4,8 for a measured figure"
    )
