"""Adaptive repeats (profiler/sampling.py), the summary's flags and the default sizes (torch-free)."""

from __future__ import annotations

import math
import random

import pytest

from pipeplan.cmd_profile import default_sizes, sizes_note
from planner.schema import LayerProfile, MeasuredOn, Profile
from profiler.sampling import (
    MIN_REPEATS,
    median_error,
    sample_steps,
    timer_floor,
    useful_resolution,
)
from profiler.summary import layer_flags, print_summary, summary_notes


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def noisy_step(clock: FakeClock, spreads: list[float], means: list[float], *, seconds: float = 1.0, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)

    def step() -> tuple[list[float], list[float]]:
        clock.t += seconds
        f = [m * math.exp(rng.gauss(0, s)) for m, s in zip(means, spreads, strict=True)]
        b = [2 * m * math.exp(rng.gauss(0, s)) for m, s in zip(means, spreads, strict=True)]
        return f, b

    return step


def test_median_error_formula() -> None:
    # inclusive quartiles of 1..5 are 2 and 4: 0.93 * 2 / (3 * sqrt 5)
    assert median_error([5, 1, 4, 2, 3]) == pytest.approx(0.93 * 2 / (3 * math.sqrt(5)))
    assert median_error([7.0]) == math.inf and median_error([0.0, 0.0, 0.0]) == math.inf
    assert median_error([2.0] * 10) == 0.0


def test_repeats_until_the_noisiest_layer_is_stable() -> None:
    clock = FakeClock()
    step = noisy_step(clock, [0.005, 0.2], [1.0, 1.0])
    s = sample_steps(step, 2, warmup=2, repeats=None, budget_s=10_000, target=0.02, clock=clock)
    assert s.stopped == "stable" and not s.unstable
    assert all(median_error(series) <= 0.02 for series in (*s.forward, *s.backward))
    # it did not stop before it had to: one step fewer left the noisy layer above the target
    assert max(median_error(s.forward[1][:-1]), median_error(s.backward[1][:-1])) > 0.02
    assert s.repeats > 20  # a 20 % spread needs many steps for a 2 % median
    # a quiet model stops at the minimum
    quiet = sample_steps(noisy_step(clock, [0.001, 0.001], [1.0, 1.0]), 2, warmup=0, repeats=None, budget_s=1e4, target=0.02, clock=clock)
    assert quiet.repeats == MIN_REPEATS and quiet.stopped == "stable"


def test_the_budget_ends_it_and_names_the_unstable_layers() -> None:
    clock = FakeClock()
    step = noisy_step(clock, [0.005, 0.5], [1.0, 1.0], seconds=1.0)
    s = sample_steps(step, 2, warmup=0, repeats=None, budget_s=12, target=0.01, clock=clock)
    assert s.stopped == "budget" and s.unstable == [1]
    assert MIN_REPEATS <= s.repeats <= 12
    assert s.error[1] > 0.01 >= s.error[0]
    # a budget shorter than the minimum still takes the minimum
    short = sample_steps(noisy_step(clock, [0.5, 0.5], [1.0, 1.0], seconds=5.0), 2, warmup=0, repeats=None, budget_s=1, target=0.01, clock=clock)
    assert short.repeats == MIN_REPEATS and short.stopped == "budget"
    capped = sample_steps(noisy_step(clock, [0.5, 0.5], [1.0, 1.0]), 2, warmup=0, repeats=None, budget_s=1e9, target=1e-6,
                          max_repeats=40, clock=clock)
    assert capped.repeats == 40 and capped.stopped == "max" and capped.unstable == [0, 1]


def test_layers_below_the_timer_resolution_are_flagged_not_waited_for() -> None:
    clock = FakeClock()
    # layer 1 takes 1 microsecond with a 50 % spread: no number of repeats makes it meaningful
    step = noisy_step(clock, [0.001, 0.5], [1.0, 0.001])
    s = sample_steps(step, 2, warmup=0, repeats=None, budget_s=1e4, target=0.02, useful_ms=0.01, clock=clock)
    assert s.below_resolution == [1] and s.unstable == [] and s.stopped == "stable"
    assert s.repeats == MIN_REPEATS


def test_fixed_repeats_are_exact() -> None:
    clock = FakeClock()
    calls = []
    step = noisy_step(clock, [0.5], [1.0])

    def counted() -> tuple[list[float], list[float]]:
        calls.append(1)
        return step()

    s = sample_steps(counted, 1, warmup=3, repeats=4, budget_s=1e-9, target=1e-9, clock=clock)
    assert s.repeats == 4 and len(calls) == 7 and s.stopped == "fixed" and s.unstable == []
    assert len(s.forward[0]) == 4


def test_timer_floor_and_resolution() -> None:
    ticks = iter(range(10**6))
    floor, tick = timer_floor(lambda: next(ticks) * 1e-6, lambda: 0.003, samples=20)
    assert floor == 0.003 and tick == pytest.approx(1e-3)
    assert useful_resolution(0.003, 0.001) == pytest.approx(0.03)


def _flagged_profile() -> Profile:
    layers = [
        LayerProfile(name=n, param_bytes=10, forward_ms=[f], backward_ms=[2 * f], activation_bytes=[1], output_bytes=[1],
                     forward_ms_spread=[0.1 * f], backward_ms_spread=[0.2 * f])
        for n, f in (("big", 3.0), ("noisy", 1.0), ("relu", 0.002))
    ]
    meta = {
        "profiler": {
            "repeats": [37],
            "adaptive": {"target_error": 0.02, "time_budget_s": 30.0, "stopped": ["budget"]},
            "timer": {"floor_ms": 0.0005, "tick_ms": 0.0001, "useful_ms": 0.005},
            "unstable": {"4": ["noisy"]},
            "below_resolution": {"4": ["relu"]},
            "median_error": {"4": [0.004, 0.061, None]},
        }
    }
    return Profile(model="m", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=[4], layers=layers, metadata=meta)


def test_summary_flags_unstable_and_tiny_layers(capsys: pytest.CaptureFixture[str]) -> None:
    prof = _flagged_profile()
    assert layer_flags(prof, 4) == {"noisy": "unstable", "relu": "< timer"}
    notes = summary_notes(prof)
    assert len(notes) == 2
    assert notes[0].startswith("1 layer(s) did not reach a median within ±2% in the 30 s budget (37 at micro-batch 4 repeats): noisy")
    assert "--time-budget 60" in notes[0]
    assert notes[1].startswith("1 layer(s) run faster than the timer's useful resolution (0.0050 ms): relu")
    print_summary(prof)
    err = capsys.readouterr().err
    assert "37 timed steps (adaptive)" in err and "median ±" in err and "6.1%" in err
    assert "unstable" in err and "< timer" in err and "note: 1 layer(s) run faster" in err
    # a profile with no timing metadata (synthesized) has no flag column and no notes
    plain = prof.model_copy(update={"metadata": {}})
    assert layer_flags(plain, 4) == {} and summary_notes(plain) == []


def test_default_sizes_reach_the_batch() -> None:
    assert default_sizes(None) == [1, 2, 4, 8]
    assert default_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert default_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert default_sizes(1) == [1]
    assert sizes_note([1, 2, 4, 8, 16, 32], 32) is None
    note = sizes_note([1, 2], 16)
    assert note is not None and "--microbatch-sizes 1,2,4,8,16" in note and "up to 16" in note
    generic = sizes_note([1, 2, 4, 8], None)
    assert generic is not None and "--batch-size G" in generic
