"""Calibration of the device model's two constants (``pipeplan calibrate``; torch-free).

A profile that ``pipeplan synth`` (``measured_on.device == "synthetic:<preset>"``) or the
fake-tensor profiler (``"fake:<preset>"``) wrote measured nothing: the device model
(:mod:`planner.cost.compute`) priced each layer's operation census with two constants of the
preset, :class:`DeviceConstants` ``gemm_efficiency`` and ``memory_efficiency``
(``measured_on.pricing`` names them).  Runs of plans made from such a profile measure what those
constants really are on the device: every timed stage is an observation of the sum of its
layers' census times at the run's micro-batch size.

How a layer's time depends on the constants (:mod:`planner.cost.compute`): a compute-bound GEMM
and fused attention take ``FLOPs / (peak x gemm_efficiency x quantisation)``, a memory-bound
kernel ``bytes / (bandwidth x memory_efficiency)``, a GEMM under its memory roof
``bytes / (bandwidth x memory_efficiency)`` too, and every kernel at least the launch floor.  So
a stage's time is close to ``G / gemm_efficiency + M / memory_efficiency + floors`` but not
exactly (which kernels sit on the roof or the floor changes with the constants).  The fit
therefore prices the census itself for each candidate:

* **Fit.**  Levenberg-Marquardt on the logarithms of the constants, bounded to
  [:data:`MIN_CONSTANT`, 1], minimizing the squared relative errors ``log(predicted /
  measured)`` of every timed stage, starting from the profile's constants (finite-difference
  Jacobian: the census is re-priced per evaluation).
* **Identifiability.**  With the Jacobian at the profile's constants, each stage's sensitivity to
  a constant is the share of its time that constant governs.  Under the stage noise ``noise``
  (relative), the 2-D fit's uncertainty of each log-constant is ``sqrt(diag(noise^2 (J^T
  J)^-1))``; when both are within :data:`CONSTANT_SPREAD` both are fitted.  Otherwise (all the
  observed time is GEMM-bound, or every stage mixes GEMM and memory time in the same proportion,
  so only a combination is determined) the one constant whose 1-D uncertainty ``noise /
  |J_i|`` is within the spread is fitted alone, the other kept at the profile's value; when
  neither is, nothing is fitted.  The provenance says which.
* **Re-pricing.**  Each layer's times at each micro-batch size are multiplied by ratios of its
  census's price with the new and the old constants.  The forward by the forward's ratio; each
  other figure (backward, its input and weight parts, the selective-recompute part: attention's
  core) that *is* its census price at the profiled constants at every micro-batch size (every
  synth block's, priced straight by :func:`planner.cost.compute.layer_times`) by its own ratio,
  so it becomes exactly the new price; a figure derived otherwise (the synth embedding's
  backward, twice its forward, all of it weight gradient) by the forward's ratio, so it keeps
  its shape.  Which figures are derived is decided once, at the profiled constants, and
  recorded (``DeviceConstantsCalibration.derived``), so that the re-pricing is exactly
  reversible (``uncalibrated``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from planner.cost import layer_costs
from planner.cost.compute import DeviceConstants, OpTimes, default_constants, layer_times
from planner.errors import InputError
from planner.presets import DEVICES
from planner.schema import LayerProfile, Operation, Profile

#: the device kinds whose times the device model priced (``MeasuredOn.device`` prefixes)
PRICED_KINDS = ("synthetic:", "fake:")
#: a fitted constant must be known within this log-spread (1 sigma, under the stage noise) to be fitted
CONSTANT_SPREAD = 0.05
#: the constants stay within [MIN_CONSTANT, 1]
MIN_CONSTANT = 1e-3
#: the names of the two constants, in the fit's order
NAMES = ("gemm_efficiency", "memory_efficiency")

_PRICING = re.compile(r"gemm efficiency ([0-9.eE+-]+), memory efficiency ([0-9.eE+-]+)")


@dataclass(frozen=True)
class DevicePricing:
    """How the device model priced a profile: the preset and its constants."""

    device_type: str
    constants: DeviceConstants


@dataclass(frozen=True)
class StageObservation:
    """One timed stage: ``measured_ms`` against ``(sum of forward_ms over forward_layers + sum of
    backward_ms over backward_layers) / speed`` at ``microbatch_size``."""

    microbatch_size: int
    forward_layers: tuple[int, ...]
    backward_layers: tuple[int, ...]
    speed: float
    measured_ms: float


@dataclass(frozen=True)
class ConstantsFit:
    """What :func:`fit_constants` found."""

    constants: DeviceConstants
    fitted: tuple[str, ...]
    derived: tuple[str, ...]  # figures re-priced with their layer's forward (derived_figures)
    observations: int
    rms_before: float  # root-mean-square relative error of the stages, profile's constants
    rms_after: float  # the same with the fitted constants
    source: str


# --------------------------------------------------------------------------- what priced the profile


def device_pricing(profile: Profile) -> tuple[DevicePricing | None, str]:
    """The device model's pricing of ``profile``, or ``None`` and why the constants cannot be
    fitted (an empty reason for a measured profile: nothing to say)."""
    device = profile.measured_on.device
    prefix = next((p for p in PRICED_KINDS if device.startswith(p)), None)
    if prefix is None:
        return None, ""
    preset = device[len(prefix):]
    synth = profile.metadata.get("synth")
    synth = synth if isinstance(synth, dict) else {}
    pricing = profile.measured_on.pricing or ""
    if pricing.startswith("flat") or synth.get("timing") == "flat mfu":
        return None, (
            f"the device model's constants are not fitted: the profile's times are a flat fraction of peak "
            f"({pricing or 'synth --mfu'}), not priced from the census; synthesize without --mfu to fit them"
        )
    if preset not in DEVICES:
        return None, (
            f"the device model's constants are not fitted: the profile was priced for {preset!r}, which is not "
            f"a device preset (choose one of {', '.join(sorted(DEVICES))})"
        )
    missing = [layer.name for layer in profile.layers if layer.operations is None]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return None, (
            f"the device model's constants are not fitted: layer(s) {shown} carry no operation census "
            "(re-synthesize the profile with this version)"
        )
    return DevicePricing(preset, _profiled_constants(profile, preset, pricing, synth)), ""


def _profiled_constants(profile: Profile, preset: str, pricing: str, synth: dict[str, object]) -> DeviceConstants:
    match = _PRICING.search(pricing)
    if match is not None:
        values: tuple[object, object] = (match.group(1), match.group(2))
        where = f"measured_on.pricing {pricing!r}"
    elif "gemm_efficiency" in synth or "memory_efficiency" in synth:
        d = default_constants(preset)
        values = (synth.get("gemm_efficiency", d.gemm_efficiency), synth.get("memory_efficiency", d.memory_efficiency))
        where = "metadata.synth"
    else:
        return default_constants(preset)
    try:
        return DeviceConstants(float(values[0]), float(values[1]))  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise InputError(
            f"profile {profile.model!r}: the device model's constants in its {where} are not fractions of "
            f"peak ({values[0]!r}, {values[1]!r}): {err}; re-synthesize the profile (pipeplan synth)"
        ) from err


def pricing_text(device_type: str, constants: DeviceConstants, *, note: str = "") -> str:
    """``measured_on.pricing`` for ``constants`` (the wording :func:`device_pricing` reads back)."""
    text = (
        f"device model {device_type}: gemm efficiency {constants.gemm_efficiency:g}, "
        f"memory efficiency {constants.memory_efficiency:g}"
    )
    return f"{text} ({note})" if note else text


# --------------------------------------------------------------------------- re-pricing


def _core(ops: Sequence[Operation]) -> list[Operation]:
    """What selective recompute re-runs: attention and the dropout on its probabilities (the
    sharded memory kernel at least as large as the scores), as ``profiler.decoder`` counts it."""
    attn = [o for o in ops if o.kind == "attention"]
    if not attn:
        return []
    a = attn[0]
    scores = a.batch * (a.heads or 0) * (a.query_len or 0) * (a.key_len or 0)
    return attn + [o for o in ops if o.kind == "memory" and o.tp_shard == "bytes" and (o.bytes or 0) >= scores > 0]


class _Prices:
    """Census times at given constants, each distinct census priced once."""

    def __init__(self, device_type: str, constants: DeviceConstants) -> None:
        self.device_type = device_type
        self.constants = constants
        self._cache: dict[tuple[Operation, ...], tuple[OpTimes, float]] = {}

    def __call__(self, ops: Sequence[Operation]) -> tuple[OpTimes, float]:
        key = tuple(ops)
        if key not in self._cache:
            total = layer_times(key, device_type=self.device_type, constants=self.constants)
            core = _core(key)
            redo = layer_times(core, device_type=self.device_type, constants=self.constants).forward if core else 0.0
            self._cache[key] = (total, redo)
        return self._cache[key]


#: a figure within this relative distance of its census's price is that price
_SAME_PRICE = 1e-9
#: the figures besides the forward that re-pricing scales (the forward's spread follows the forward)
_FIGURES = ("backward_ms", "backward_input_ms", "backward_weight_ms", "selective_recompute_ms")


def _census_price(times: tuple[OpTimes, float], name: str) -> float:
    t, redo = times
    return {
        "backward_ms": t.backward,
        "backward_input_ms": t.backward_input,
        "backward_weight_ms": t.backward_weight,
        "selective_recompute_ms": redo,
    }[name]


def derived_figures(profile: Profile, *, device_type: str, constants: DeviceConstants) -> list[str]:
    """The layer figures (``"layer.field"``) of ``profile``, priced with ``constants``, that are
    not their census's price at some micro-batch size (derived from the forward instead, like the
    synth embedding's backward): re-pricing scales them with the forward."""
    prices = _Prices(device_type, constants)
    out = []
    for layer in profile.layers:
        if layer.operations is None:
            continue
        for name in _FIGURES:
            values = getattr(layer, name)
            if values is None:
                continue
            if not all(
                abs(v - (t := _census_price(prices(ops), name))) <= _SAME_PRICE * max(abs(v), t)
                for v, ops in zip(values, layer.operations, strict=True)
            ):
                out.append(f"{layer.name}.{name}")
    return out


def _repriced_layer(layer: LayerProfile, old: _Prices, new: _Prices, derived: frozenset[str]) -> LayerProfile:
    if layer.operations is None:
        return layer
    ratios: dict[str, list[float]] = {"forward_ms": [], **{name: [] for name in _FIGURES}}
    for ops in layer.operations:
        t0, t1 = old(ops), new(ops)
        f = t1[0].forward / t0[0].forward if t0[0].forward > 0 else 1.0
        ratios["forward_ms"].append(f)
        for name in _FIGURES:
            before = _census_price(t0, name)
            own = f"{layer.name}.{name}" not in derived and before > 0
            ratios[name].append(_census_price(t1, name) / before if own else f)

    def times(values: list[float] | None, name: str) -> list[float] | None:
        return None if values is None else [x * r for x, r in zip(values, ratios[name], strict=True)]

    return layer.model_copy(
        update={
            "forward_ms": times(layer.forward_ms, "forward_ms"),
            "forward_ms_spread": times(layer.forward_ms_spread, "forward_ms"),
            "backward_ms_spread": times(layer.backward_ms_spread, "backward_ms"),
            **{name: times(getattr(layer, name), name) for name in _FIGURES},
        }
    )


def reprice(
    profile: Profile, *, device_type: str, old: DeviceConstants, new: DeviceConstants, derived: Sequence[str]
) -> Profile:
    """``profile``'s layers, priced with ``old`` constants, re-priced with ``new`` ones; the
    ``derived`` figures (:func:`derived_figures` at the profiled constants) scale with their
    layer's forward (see the module doc; ``measured_on`` and the calibration are left to the
    caller)."""
    if old == new:
        return profile
    before, after = _Prices(device_type, old), _Prices(device_type, new)
    keep = frozenset(derived)
    return profile.model_copy(
        update={"layers": [_repriced_layer(layer, before, after, keep) for layer in profile.layers]}
    )


# --------------------------------------------------------------------------- the fit


def fit_constants(
    profile: Profile, observations: Sequence[StageObservation], *, pricing: DevicePricing, noise: float
) -> ConstantsFit:
    """Fit the device model's constants of ``pricing.device_type`` to ``observations`` of
    ``profile`` (priced with ``pricing.constants``); see the module doc.  ``noise``: the relative
    noise of one stage's measured time."""
    if not observations:
        raise InputError(
            "no timed stage to fit the device model's constants to: run more steps (pipeplan run --steps 5 "
            "or more) and calibrate with that report"
        )
    bad = [o.measured_ms for o in observations if not (o.measured_ms > 0 and math.isfinite(o.measured_ms))]
    if bad:
        raise InputError(
            f"a timed stage measured {bad[0]!r} ms: stage times must be positive and finite; "
            "check the report (pipeplan run --report) it came from"
        )
    prior = pricing.constants
    derived = derived_figures(profile, device_type=pricing.device_type, constants=prior)
    measured = np.log(np.array([o.measured_ms for o in observations], dtype=np.float64))
    sizes = sorted({o.microbatch_size for o in observations})

    def residuals(x: NDArray[np.float64]) -> NDArray[np.float64]:
        c = DeviceConstants(*(float(v) for v in np.minimum(np.exp(x), 1.0)))
        priced = reprice(profile, device_type=pricing.device_type, old=prior, new=c, derived=derived)
        costs = {b: layer_costs(priced, b) for b in sizes}
        pred = np.array(
            [
                (
                    sum(costs[o.microbatch_size].forward_ms[i] for i in o.forward_layers)
                    + sum(costs[o.microbatch_size].backward_ms[i] for i in o.backward_layers)
                )
                / o.speed
                for o in observations
            ],
            dtype=np.float64,
        )
        return np.log(np.maximum(pred, 1e-300)) - measured

    lo = math.log(MIN_CONSTANT)
    x0 = np.log(np.array([prior.gemm_efficiency, prior.memory_efficiency], dtype=np.float64))
    r0 = residuals(x0)
    jac0 = _jacobian(residuals, x0, r0, [0, 1])
    active, why = identifiable_constants(jac0, noise)
    x = _levenberg_marquardt(residuals, x0, active, lo) if active else x0
    r1 = residuals(x)
    fitted = DeviceConstants(*(float(v) for v in np.minimum(np.exp(x), 1.0)))
    names = tuple(NAMES[i] for i in active)
    rms0 = float(np.sqrt(np.mean(np.expm1(np.abs(r0)) ** 2)))
    rms1 = float(np.sqrt(np.mean(np.expm1(np.abs(r1)) ** 2)))
    values = {NAMES[0]: fitted.gemm_efficiency, NAMES[1]: fitted.memory_efficiency}
    before = {NAMES[0]: prior.gemm_efficiency, NAMES[1]: prior.memory_efficiency}
    if names:
        shown = " and ".join(f"{n} {values[n]:.4g}" for n in names)
        source = (
            f"{pricing.device_type}: {shown} fitted to {len(observations)} timed stage(s) (the profile's "
            + ", ".join(f"{before[n]:g}" for n in names)
            + f"; rms stage error {rms0:.1%} -> {rms1:.1%})"
        )
        kept = [n for n in NAMES if n not in names]
        if kept:
            source += f"; {kept[0]} kept at the profile's {before[kept[0]]:g}: {why}"
    else:
        source = f"{pricing.device_type}: nothing fitted, the profile's constants kept: {why}"
    if any(v <= MIN_CONSTANT * 1.0001 for v in (values[n] for n in names)):
        source += (
            f"; a constant reached the bound {MIN_CONSTANT:g}: the runs are far slower than the device model can "
            "explain (another device than the preset, or not the plan that ran?)"
        )
    return ConstantsFit(
        constants=fitted, fitted=names, derived=tuple(derived), observations=len(observations), rms_before=rms0, rms_after=rms1, source=source
    )


def _jacobian(
    residuals: object, x: NDArray[np.float64], r: NDArray[np.float64], active: Sequence[int], *, h: float = 1e-5
) -> NDArray[np.float64]:
    """d residuals / d x[active], by finite differences (inwards at the upper bound 0)."""
    assert callable(residuals)
    cols = []
    for i in active:
        step = -h if x[i] + h > 0 else h
        y = x.copy()
        y[i] += step
        cols.append((residuals(y) - r) / step)
    return np.stack(cols, axis=1)


def identifiable_constants(jac: NDArray[np.float64], noise: float) -> tuple[list[int], str]:
    """The constants the observations determine (indices into :data:`NAMES`), and why a kept one
    is kept.  ``jac``: per observation (rows), d log(predicted) / d log(constant) for the two
    constants (columns); ``noise``: the relative noise of one observation.  ``pipeplan calibrate``
    and ``benchmarks/published.py`` fit only what this returns."""
    shares = -jac  # per stage, the share of its time each constant governs
    mean_share = [float(np.mean(shares[:, i])) for i in range(2)]
    max_share = [float(np.max(shares[:, i])) for i in range(2)]
    normal = jac.T @ jac / noise**2
    if abs(float(np.linalg.det(normal))) > 1e-12 * max(1.0, float(np.trace(normal))) ** 2:
        spread = np.sqrt(np.maximum(np.diag(np.linalg.inv(normal)), 0.0))
        if all(s <= CONSTANT_SPREAD for s in spread):
            return [0, 1], ""
    else:
        spread = np.array([math.inf, math.inf])
    alone = [noise / max(float(np.linalg.norm(jac[:, i])), 1e-300) for i in range(2)]
    best = int(np.argmin(alone))
    other = 1 - best
    if alone[best] > CONSTANT_SPREAD:
        return [], (
            f"the observed stage times hardly depend on them (at most {max(max_share):.1%} of a stage's time per "
            "constant: launch floors?); give reports of larger micro-batches or stages"
        )
    if max_share[other] < 0.02:
        why = (
            f"the runs' time hardly depends on it (at most {max_share[other]:.1%} of any stage's time, "
            f"{mean_share[other]:.1%} on average)"
        )
    else:
        why = (
            f"every timed stage mixes the two in about the same proportion ({mean_share[other]:.1%} of the time "
            f"on average), so only one of them is determined (the pair would be uncertain by "
            f"{float(max(spread)):.0%}); stages of other layer mixes (the embedding or the head alone) tell them apart"
        )
    return [best], why


def _levenberg_marquardt(
    residuals: object, x0: NDArray[np.float64], active: Sequence[int], lo: float
) -> NDArray[np.float64]:
    """Minimize ``|residuals(x)|^2`` over ``x[active]`` within [lo, 0]."""
    assert callable(residuals)
    x = x0.copy()
    r = residuals(x)
    cost = float(r @ r)
    damping = 1e-3
    for _ in range(60):
        jac = _jacobian(residuals, x, r, active)
        normal = jac.T @ jac
        grad = jac.T @ r
        accepted = False
        while damping <= 1e8:
            step = np.linalg.solve(normal + damping * (np.diag(np.diag(normal)) + 1e-12 * np.eye(len(active))), -grad)
            candidate = x.copy()
            candidate[list(active)] = np.clip(x[list(active)] + step, lo, 0.0)
            rc = residuals(candidate)
            value = float(rc @ rc)
            if value < cost:
                moved = float(np.max(np.abs(candidate - x)))
                x, r, improvement, cost = candidate, rc, cost - value, value
                damping = max(damping / 3, 1e-9)
                accepted = True
                break
            damping *= 10
        if not accepted or improvement <= 1e-14 * max(1.0, cost) or moved < 1e-9:
            break
    return x
