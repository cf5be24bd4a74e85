"""How many timed steps a profile takes: adaptive repeats under a time budget (torch-free).

Each repeat is one training step in which every layer's forward and backward is timed once.
:func:`sample_steps` keeps repeating until the median of every layer is known well enough, or
the time budget is spent, and says which layers it could not pin down.

* **Stable median.**  The median of n samples has a standard error of about 1.2533 σ / √n
  for normal noise, and the interquartile range is 1.349 σ; so :func:`median_error` estimates
  the median's relative error as ``0.93 * IQR / (median * sqrt(n))`` (robust to the odd slow
  step).  A layer is stable when that is at most ``target`` for its forward and its backward.
* **Timer resolution.**  A layer faster than the timer's *useful resolution* (the time the
  timer takes to measure nothing, and its tick, times :data:`RESOLUTION_FACTOR`) is flagged
  and does not hold up the stopping rule: more repeats would not make its figure mean more.
* **Budget.**  At least :data:`MIN_REPEATS` steps, then more while some layer is unstable and
  the budget lasts (measured on the wall clock), at most :data:`MAX_REPEATS`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: repeats an adaptive measurement always takes
MIN_REPEATS = 5
#: and at most
MAX_REPEATS = 1000
#: default target: each layer's median within this relative (standard) error
TARGET_ERROR = 0.02
#: default time budget of the timed steps, seconds, over all micro-batch sizes
TIME_BUDGET_S = 30.0
#: the useful resolution is this many times the timer's own cost (or its tick)
RESOLUTION_FACTOR = 10.0


def median_error(values: Sequence[float]) -> float:
    """Relative standard error of the median of ``values``: 0.93 IQR / (median sqrt(n)).

    ``inf`` with fewer than two values or a median of zero (nothing is known yet)."""
    n = len(values)
    if n < 2:
        return math.inf
    median = statistics.median(values)
    if median <= 0:
        return math.inf
    q = statistics.quantiles(values, n=4, method="inclusive")
    return 0.93 * max(0.0, q[2] - q[0]) / (median * math.sqrt(n))


@dataclass
class Sampling:
    """The timed steps of one micro-batch size."""

    #: per layer, every timed step's forward (and backward) milliseconds
    forward: list[list[float]]
    backward: list[list[float]]
    repeats: int
    #: why sampling stopped: "fixed" (a repeat count was given), "stable", "budget", "max"
    stopped: str
    #: layers whose median missed the target (below-resolution layers excluded)
    unstable: list[int] = field(default_factory=list)
    #: layers whose forward or backward median is below the timer's useful resolution
    below_resolution: list[int] = field(default_factory=list)
    #: per layer, the worst relative error of its forward and backward median
    error: list[float] = field(default_factory=list)


def layer_status(
    forward: Sequence[Sequence[float]], backward: Sequence[Sequence[float]], *, target: float, useful_ms: float
) -> tuple[list[int], list[int], list[float]]:
    """(unstable layers, below-resolution layers, each layer's median error) of the samples."""
    unstable, tiny, errors = [], [], []
    for i, (f, b) in enumerate(zip(forward, backward, strict=True)):
        small = any(series and statistics.median(series) < useful_ms for series in (f, b))
        worst = max(
            (median_error(series) for series in (f, b) if series and statistics.median(series) >= useful_ms),
            default=0.0,
        )
        errors.append(worst)
        if small:
            tiny.append(i)
        if worst > target:
            unstable.append(i)
    return unstable, tiny, errors


def sample_steps(
    step: Callable[[], tuple[Sequence[float], Sequence[float]]],
    layers: int,
    *,
    warmup: int,
    repeats: int | None,
    budget_s: float,
    target: float = TARGET_ERROR,
    useful_ms: float = 0.0,
    min_repeats: int = MIN_REPEATS,
    max_repeats: int = MAX_REPEATS,
    clock: Callable[[], float] = time.perf_counter,
    on_step: Callable[[float], None] | None = None,
) -> Sampling:
    """Run ``warmup`` untimed steps, then timed ``step()`` calls (each returns every layer's
    forward and backward ms): exactly ``repeats`` of them when given, else adaptively (see the
    module doc).  ``on_step(fraction)`` reports progress."""
    for _ in range(warmup):
        step()
    fwd: list[list[float]] = [[] for _ in range(layers)]
    bwd: list[list[float]] = [[] for _ in range(layers)]
    start = clock()
    done = 0
    stopped = "fixed"
    while True:
        t_f, t_b = step()
        for i in range(layers):
            fwd[i].append(t_f[i])
            bwd[i].append(t_b[i])
        done += 1
        if repeats is not None:
            if on_step is not None:
                on_step(done / repeats)
            if done >= repeats:
                break
            continue
        elapsed = clock() - start
        if on_step is not None:
            on_step(min(1.0, max(done / max_repeats, elapsed / budget_s if budget_s > 0 else 1.0)))
        if done < min_repeats:
            continue
        unstable, _, _ = layer_status(fwd, bwd, target=target, useful_ms=useful_ms)
        if not unstable:
            stopped = "stable"
            break
        if done >= max_repeats:
            stopped = "max"
            break
        # stop when another step would overrun the budget
        if elapsed + elapsed / done > budget_s:
            stopped = "budget"
            break
    unstable, tiny, errors = layer_status(fwd, bwd, target=target, useful_ms=useful_ms)
    return Sampling(fwd, bwd, done, stopped, unstable if repeats is None else [], tiny, errors)


def timer_floor(now: Callable[[], float], time_nothing: Callable[[], float], *, samples: int = 200) -> tuple[float, float]:
    """(floor, tick) in ms: the median time the timer measures for an empty call, and the
    smallest step of the clock seen in a tight loop."""
    floor = statistics.median(time_nothing() for _ in range(samples))
    tick = math.inf
    last = now()
    for _ in range(20 * samples):
        t = now()
        if t > last:
            tick = min(tick, (t - last) * 1e3)
            last = t
    return max(0.0, floor), tick if math.isfinite(tick) else 0.0


def useful_resolution(floor_ms: float, tick_ms: float) -> float:
    """Times below this are dominated by the timer: :data:`RESOLUTION_FACTOR` x max(floor, tick)."""
    return RESOLUTION_FACTOR * max(floor_ms, tick_ms)
