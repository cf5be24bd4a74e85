"""Calibration: fit a profile to what runs measured (``pipeplan calibrate``; torch-free).

A run report (:class:`planner.schema.RunReport`, ``pipeplan run --report``) holds the plan that
ran and what it measured: each stage's forward and backward time per micro-batch, when every
action started (on one clock when every rank shared a host), and where each rank's step went
(schedule, all-reduces, optimizer).  :func:`calibrate` fits three things to one or more reports
and returns a new profile that records where each figure came from (``Profile.calibration``):

* **The device model's constants**, first, when the device model priced the profile from its
  operation census (``pipeplan synth``: ``measured_on.device`` ``synthetic:<preset>``; fake
  tensors: ``fake:<preset>``; not a flat ``--mfu`` profile) and the runs ran on that preset:
  ``gemm_efficiency`` and ``memory_efficiency`` are fitted to the timed stages (the same
  observations as the factors below) and the layers re-priced with them
  (:mod:`planner.calibrate_device`; ``Calibration.device_constants``, ``measured_on.pricing``).
  A constant the stages do not determine (all the time GEMM-bound, or every stage the same
  mix) keeps the profile's value and the provenance says so.  The per-layer factors are then
  fitted on top of the re-priced profile, so what the constants cannot explain (one layer
  slower than the model says) is still corrected; with a device model that explains the runs
  they come out near 1.  A measured profile skips this step.
* **Per-layer time scale factors.**  Every timed stage is an observation: its measured time
  per micro-batch against the sum of its layers' profiled times at the run's micro-batch size
  (a recomputing stage's backward includes its forward again).  The unknowns are a forward and
  a backward factor per layer, fitted in log space (relative errors, Gauss-Newton) with a prior
  that pulls each factor towards 1 with a weight proportional to the layer's share of the
  model's time.  So one stage's measurement is spread over its layers in proportion to the
  profile (all its layers get the same factor), several runs with different splits resolve the
  factors finer (each stage boundary of any run is a boundary of the fit), and a layer no run
  timed keeps its profiled figure.
* **Links.**  Each transfer the timeline shows a rank waiting for (the data arrived after that
  rank's previous action ended) is a sample of the link between the two devices: from the
  producer's end to the consumer's start, for the bytes the profile says cross that cut (its
  activations forward, their gradients back).  Each data-parallel all-reduce is a sample too
  (the fastest replica's time, ring formula of :func:`planner.cost.allreduce_ms`).
  Latency and bandwidth are fitted by non-negative least squares on relative errors; when every
  sample moved about the same number of bytes, the bandwidth cannot be told from the latency, so
  the cluster's bandwidth is kept and only the latency fitted (the provenance says so).
* **A fixed overhead per step** (optimizer step, launch, the tied-weight all-reduce): with the
  calibrated layers and links, each report's plan is re-estimated at that run's own fitted
  level (how busy its machine was: the overhead is what the layers leave unexplained, not a
  busier run's extra compute); the overhead is the median of measured minus predicted step
  time over the reports (never below zero).

Stage times are read from each report's median step (:func:`stage_means`), the step that the
report's step time is.

The cost model adds ``Profile.step_overhead_ms`` to every step (:func:`planner.cost.estimate`);
clusters built from command-line flags use the fitted links (:func:`calibrated_cluster`).
Calibrating a calibrated profile starts again from the profiled figures (its factors are divided
out, its layers re-priced with the profiled constants): pass every report that should count.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from planner.calibrate_device import (
    CONSTANT_SPREAD,
    ConstantsFit,
    DevicePricing,
    StageObservation,
    device_pricing,
    fit_constants,
    pricing_text,
    reprice,
)
from planner.cost import layer_costs, reestimate
from planner.cost.compute import DeviceConstants
from planner.errors import InputError
from planner.schema import (
    Calibration,
    CalibrationRun,
    Cluster,
    DeviceConstantsCalibration,
    Interconnect,
    LayerCalibration,
    LinkCalibration,
    Plan,
    Profile,
    RunReport,
)

#: relative noise of one stage's measured time (the observations' weight is 1 / this²)
STAGE_NOISE = 0.03
#: log-spread of a layer's factor around the level of all layers (prior weight 1 / this², times
#: the layer's share of the model's time)
LAYER_SPREAD = 0.15
#: log-spread of one run's own level around the runs' typical level (a busier machine)
RUN_SPREAD = 0.15
#: prior weight of the levels (forward, backward) towards 1: almost none
LEVEL_WEIGHT = 1e-2
#: the factors stay within [1 / MAX_FACTOR, MAX_FACTOR]
MAX_FACTOR = 1e4
#: bandwidths are kept within this (bytes/s): a fit that finds "no cost per byte" stops here
MAX_BANDWIDTH = 1e14
#: transfers of at least this spread of sizes (largest / smallest) tell bandwidth from latency
SIZE_SPREAD = 1.5

_METHOD = (
    "per-layer forward/backward factors: Gauss-Newton on log(measured / predicted) of every timed stage "
    f"(the median step's stage times, noise {STAGE_NOISE:.0%}), factor = level x layer deviation (log-spread {LAYER_SPREAD:g}, weighted by the "
    f"layer's time share) x the run's own level (log-spread {RUN_SPREAD:g}, 1 in predictions); "
    "links: non-negative least squares on waited transfers and all-reduces; step overhead: median of "
    "measured - predicted at each run's own level"
)
_CONSTANTS_METHOD = (
    "device model constants (synth / fake-tensor profiles): Levenberg-Marquardt on log(measured / predicted) of "
    "every timed stage over the log-constants, the census re-priced per evaluation; a constant is fitted when "
    f"the stages determine it within a log-spread of {CONSTANT_SPREAD:g} (noise {STAGE_NOISE:.0%}), else kept; "
    "the layers are re-priced with the fitted constants and the per-layer factors fitted on top"
)


@dataclass(frozen=True)
class LinkSample:
    """One measured transfer or all-reduce: ``ms = latencies * latency + bytes / bandwidth``."""

    link: str  # "intra_node" | "inter_node"
    bytes: float  # effective bytes on the wire (an all-reduce's 2(D-1)/D share)
    latencies: float  # latency multiplier: 1 for a transfer, 2(D-1) for a ring all-reduce
    ms: float
    collective: bool = False


@dataclass
class CalibrationResult:
    """The calibrated profile and what the fit saw."""

    profile: Profile
    runs: list[CalibrationRun]
    transfers: int = 0
    collectives: int = 0
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- entry point


def calibrate(profile: Profile, reports: Sequence[tuple[str, RunReport]]) -> CalibrationResult:
    """Fit ``profile`` to the run ``reports`` (``(name, report)`` pairs); see the module doc.

    Raises :class:`InputError` when a report ran a plan for another model or on another kind
    of device than the others, or when no report timed any stage.
    """
    if not reports:
        raise InputError("give at least one run report (pipeplan run --plan PLAN --model SPEC --report FILE)")
    base = uncalibrated(profile)
    _check_reports(base, reports)
    cluster0 = reports[0][1].plan.cluster
    device_type = _device_kind(cluster0)
    notes = []
    base, constants_entry, constants_source = _fit_device_constants(base, reports, device_type)
    if constants_source and constants_entry is None:
        notes.append(constants_source)
    fwd_scale, bwd_scale, seen, levels = _fit_layers(base, [r for _, r in reports])
    scaled = _scaled(base, fwd_scale, bwd_scale)
    layer_cal = [
        LayerCalibration(forward_scale=fwd_scale[i], backward_scale=bwd_scale[i], stages_seen=seen[i])
        for i in range(base.num_layers)
    ]
    samples = [s for _, r in reports for s in link_samples(scaled, r)]
    links = {
        name: _fit_link(
            [s for s in samples if s.link == name],
            getattr(cluster0, name),
            name.replace("_", "-"),
        )
        for name in ("intra_node", "inter_node")
    }
    draft = Calibration(
        device_type=device_type,
        intra_node=links["intra_node"],
        inter_node=links["inter_node"],
        layers=layer_cal,
        runs=[_run_entry(name, r, 0.0, 0.0) for name, r in reports],
        method=_METHOD if constants_entry is None else f"{_CONSTANTS_METHOD}; then {_METHOD}",
        device_constants=constants_entry,
        device_constants_source=constants_source,
    )
    with_links = scaled.model_copy(update={"calibration": draft})
    residuals = []
    for (_, r), level in zip(reports, levels, strict=True):
        if r.measured_step_ms is None:
            continue
        # the run's step as its own machine ran it (its fitted level): what the layers do not
        # explain is the overhead, not how busy that run's machine was
        own = _scaled(with_links, [level] * base.num_layers, [level] * base.num_layers)
        predicted = predict(r.plan, own).predicted.step_time_ms
        residuals.append(r.measured_step_ms - predicted)
    overhead, overhead_source = _overhead(residuals, [r for _, r in reports])
    final = draft.model_copy(update={"step_overhead_ms": overhead, "step_overhead_source": overhead_source})
    calibrated = scaled.model_copy(update={"calibration": final})
    runs = []
    for name, r in reports:
        before = predict(r.plan, profile).predicted.step_time_ms
        after = predict(r.plan, calibrated).predicted.step_time_ms
        runs.append(_run_entry(name, r, before, after))
    final = final.model_copy(update={"runs": runs})
    calibrated = scaled.model_copy(update={"calibration": final})
    # validate once more as a whole document (shapes, limits of every field)
    calibrated = Profile.model_validate(calibrated.model_dump())
    if not samples:
        notes.append(
            "no transfer was measured (one stage, or the ranks did not share a clock): the links are the cluster's"
        )
    return CalibrationResult(
        profile=calibrated,
        runs=runs,
        transfers=sum(1 for s in samples if not s.collective),
        collectives=sum(1 for s in samples if s.collective),
        notes=notes,
    )


def _fit_device_constants(
    profile: Profile, reports: Sequence[tuple[str, RunReport]], device_type: str | None
) -> tuple[Profile, DeviceConstantsCalibration | None, str]:
    """When the device model priced ``profile`` (synth, fake tensors) and the runs ran on that
    device preset: its two constants fitted to the timed stages (:mod:`planner.calibrate_device`),
    and ``profile`` re-priced with them.  Returns the (re-priced) profile, the calibration entry
    (``None``: nothing fitted) and what was done or why not (empty: a measured profile)."""
    pricing, why_not = device_pricing(profile)
    if pricing is None:
        return profile, None, why_not
    if device_type != pricing.device_type:
        return profile, None, (
            f"the device model's constants are not fitted: the profile was priced for {pricing.device_type!r} but "
            f"the runs ran on {device_type or 'mixed devices'!r}; calibrate with runs on {pricing.device_type} "
            "devices (pipeplan run ... --device-type), or profile the device the runs used"
        )
    observations = stage_observations(profile, [r for _, r in reports])
    fit = fit_constants(profile, observations, pricing=pricing, noise=STAGE_NOISE)
    if not fit.fitted:
        return profile, None, fit.source
    return _repriced(profile, pricing, fit), _constants_entry(profile, pricing, fit), fit.source


def _repriced(profile: Profile, pricing: DevicePricing, fit: ConstantsFit) -> Profile:
    out = reprice(
        profile, device_type=pricing.device_type, old=pricing.constants, new=fit.constants, derived=fit.derived
    )
    p = pricing.constants
    note = (
        f"fitted by pipeplan calibrate: {' and '.join(fit.fitted)} from {fit.observations} timed stage(s); "
        f"priced before with gemm efficiency {p.gemm_efficiency:g}, memory efficiency {p.memory_efficiency:g}"
    )
    measured_on = out.measured_on.model_copy(
        update={"pricing": pricing_text(pricing.device_type, fit.constants, note=note)}
    )
    return out.model_copy(update={"measured_on": measured_on})


def _constants_entry(profile: Profile, pricing: DevicePricing, fit: ConstantsFit) -> DeviceConstantsCalibration:
    return DeviceConstantsCalibration.model_validate({
        "device_type": pricing.device_type,
        "gemm_efficiency": fit.constants.gemm_efficiency,
        "memory_efficiency": fit.constants.memory_efficiency,
        "fitted": list(fit.fitted),
        "profiled_gemm_efficiency": pricing.constants.gemm_efficiency,
        "profiled_memory_efficiency": pricing.constants.memory_efficiency,
        "profiled_pricing": profile.measured_on.pricing,
        "stages": fit.observations,
        "derived": list(fit.derived),
    })


def stage_observations(profile: Profile, reports: Sequence[RunReport]) -> list[StageObservation]:
    """Every timed stage of ``reports`` (the median step's times, :func:`stage_means`): the
    same observations the per-layer factors are fitted to (a recomputing stage's backward
    counts its forward again)."""
    out = []
    for r in reports:
        costs = layer_costs(profile, r.plan.microbatch_size)
        means = stage_means(r)
        for st, sp in zip(r.stages, r.plan.stages, strict=True):
            speed = min(r.plan.cluster.devices[d].speed for d in sp.devices)
            idx = tuple(range(st.start, st.stop))
            measured_f, measured_b = means.get(st.index, (st.forward_ms, st.backward_ms))
            b = r.plan.microbatch_size
            if measured_f is not None and measured_f > 0 and sum(costs.forward_ms[i] for i in idx) > 0:
                out.append(StageObservation(b, idx, (), speed, measured_f))
            if measured_b is not None and measured_b > 0 and sum(costs.backward_ms[i] for i in idx) > 0:
                out.append(StageObservation(b, idx if st.recompute else (), idx, speed, measured_b))
    return out


def _scaled(profile: Profile, fwd_scale: Sequence[float], bwd_scale: Sequence[float]) -> Profile:
    """``profile`` with each layer's forward and backward times multiplied by its factors."""
    layers = [
        layer.model_copy(
            update={
                "forward_ms": [x * fwd_scale[i] for x in layer.forward_ms],
                "backward_ms": [x * bwd_scale[i] for x in layer.backward_ms],
                "forward_ms_spread": None
                if layer.forward_ms_spread is None
                else [x * fwd_scale[i] for x in layer.forward_ms_spread],
                "backward_ms_spread": None
                if layer.backward_ms_spread is None
                else [x * bwd_scale[i] for x in layer.backward_ms_spread],
                # selective recompute reruns part of the forward: it scales with the forward
                "selective_recompute_ms": None
                if layer.selective_recompute_ms is None
                else [x * fwd_scale[i] for x in layer.selective_recompute_ms],
            }
        )
        for i, layer in enumerate(profile.layers)
    ]
    return profile.model_copy(update={"layers": layers})


def uncalibrated(profile: Profile) -> Profile:
    """``profile`` with its calibration undone (its layer times divided by the factors, and
    re-priced with the profiled device constants when calibration fitted them)."""
    cal = profile.calibration
    if cal is None:
        return profile
    layers = []
    for layer, c in zip(profile.layers, cal.layers, strict=True):
        f, b = c.forward_scale, c.backward_scale
        layers.append(
            layer.model_copy(
                update={
                    "forward_ms": [x / f for x in layer.forward_ms],
                    "backward_ms": [x / b for x in layer.backward_ms],
                    "forward_ms_spread": None
                    if layer.forward_ms_spread is None
                    else [x / f for x in layer.forward_ms_spread],
                    "backward_ms_spread": None
                    if layer.backward_ms_spread is None
                    else [x / b for x in layer.backward_ms_spread],
                    "selective_recompute_ms": None
                    if layer.selective_recompute_ms is None
                    else [x / f for x in layer.selective_recompute_ms],
                }
            )
        )
    out = profile.model_copy(update={"layers": layers, "calibration": None})
    dc = cal.device_constants
    if dc is not None:  # re-price back to the constants the profile was priced with
        out = reprice(
            out,
            device_type=dc.device_type,
            old=DeviceConstants(dc.gemm_efficiency, dc.memory_efficiency),
            new=DeviceConstants(dc.profiled_gemm_efficiency, dc.profiled_memory_efficiency),
            derived=dc.derived,
        )
        out = out.model_copy(
            update={"measured_on": out.measured_on.model_copy(update={"pricing": dc.profiled_pricing})}
        )
    return out


def calibrated_cluster(
    cluster: Cluster, profile: Profile, *, links: Sequence[str] = ("intra_node", "inter_node")
) -> Cluster:
    """``cluster`` with the ``links`` ``profile``'s calibration fitted, when its devices are of
    the kind the runs used (else ``cluster`` itself)."""
    cal = profile.calibration
    if cal is None or cal.device_type is None or _device_kind(cluster) != cal.device_type:
        return cluster
    update = {}
    for name in links:
        link: LinkCalibration | None = getattr(cal, name)
        if link is not None:
            update[name] = Interconnect(bandwidth_bytes_per_s=link.bandwidth_bytes_per_s, latency_s=link.latency_s)
    return cluster.model_copy(update=update) if update else cluster


def predict(plan: Plan, profile: Profile) -> Plan:
    """``plan`` re-estimated with ``profile``, on its cluster with the profile's calibrated links."""
    return reestimate(plan, profile, cluster=calibrated_cluster(plan.cluster, profile))


# --------------------------------------------------------------------------- checks


def _device_kind(cluster: Cluster) -> str | None:
    names = {d.name for d in cluster.devices}
    return names.pop() if len(names) == 1 and "" not in names else None


def _check_reports(profile: Profile, reports: Sequence[tuple[str, RunReport]]) -> None:
    sha = profile.sha256()
    kinds: dict[str | None, str] = {}
    for name, r in reports:
        plan = r.plan
        if plan.profile_sha256 != sha or plan.num_layers != profile.num_layers:
            raise InputError(
                f"report {name!r} ran a plan for another model ({plan.model!r}, {plan.num_layers} layers, "
                f"profile_sha256 {plan.profile_sha256[:12]}...) than the profile ({profile.model!r}, "
                f"{profile.num_layers} layers, {sha[:12]}...): calibrate with the profile the plans were made from"
            )
        kinds.setdefault(_device_kind(plan.cluster), name)
    if len(kinds) > 1:
        shown = ", ".join(f"{k or 'mixed devices'} ({n!r})" for k, n in kinds.items())
        raise InputError(
            f"the reports ran on different kinds of devices: {shown}; calibrate one kind at a time "
            "(a profile's factors describe one device)"
        )
    if not any(st.forward_ms is not None or st.backward_ms is not None for _, r in reports for st in r.stages):
        raise InputError(
            "no report timed any stage (every stage's forward_ms and backward_ms is null): run more steps "
            "(pipeplan run --steps 5 or more) and calibrate with that report"
        )


def _run_entry(name: str, r: RunReport, before: float, after: float) -> CalibrationRun:
    p = r.plan
    split = ",".join(f"{s.start}:{s.stop}" for s in p.stages)
    rc = "".join("1" if s.recompute else "0" for s in p.stages)
    desc = (
        f"{p.schedule} K={p.pipeline_degree} D={p.data_parallel_degree}"
        + (f" v={p.virtual_stages}" if p.virtual_stages > 1 else "")
        + f" M={p.num_microbatches}x{p.microbatch_size} {split}"
        + (f" recompute {rc}" if "1" in rc else "")
    )
    return CalibrationRun(
        report=name,
        plan=desc,
        measured_step_ms=r.measured_step_ms or 0.0,
        predicted_before_ms=before,
        predicted_after_ms=after,
    )


# --------------------------------------------------------------------------- layer factors


@dataclass
class _Observations:
    """Timed stages: each a sum of terms ``coef * factor(layer, kind)`` over the 2L layer
    factors (forward factors first, then backward), measured in one run."""

    rows: list[NDArray[np.int64]] = field(default_factory=list)
    cols: list[NDArray[np.int64]] = field(default_factory=list)
    coef: list[NDArray[np.float64]] = field(default_factory=list)
    measured: list[float] = field(default_factory=list)
    run: list[int] = field(default_factory=list)

    def add(self, cols: NDArray[np.int64], coef: NDArray[np.float64], measured: float, run: int) -> None:
        self.rows.append(np.full(len(cols), len(self.measured), dtype=np.int64))
        self.cols.append(cols)
        self.coef.append(coef)
        self.measured.append(measured)
        self.run.append(run)


def _fit_layers(
    profile: Profile, reports: Sequence[RunReport]
) -> tuple[list[float], list[float], list[int], list[float]]:
    """Forward and backward factor per layer, how many timed stages held each layer, and each
    run's own level (a factor on all its layers: how much busier its machine was than typical)."""
    n = profile.num_layers
    obs = _Observations()
    share = np.zeros(2 * n)
    seen = np.zeros(n, dtype=np.int64)
    seen_kind = np.zeros(2 * n, dtype=bool)
    for run, r in enumerate(reports):
        costs = layer_costs(profile, r.plan.microbatch_size)
        fwd = np.asarray(costs.forward_ms, dtype=np.float64)
        bwd = np.asarray(costs.backward_ms, dtype=np.float64)
        means = stage_means(r)
        for st, sp in zip(r.stages, r.plan.stages, strict=True):
            speed = min(r.plan.cluster.devices[d].speed for d in sp.devices)
            idx = np.arange(st.start, st.stop, dtype=np.int64)
            measured_f, measured_b = means.get(st.index, (st.forward_ms, st.backward_ms))
            timed = False
            if measured_f is not None and measured_f > 0 and fwd[idx].sum() > 0:
                obs.add(idx, fwd[idx] / speed, measured_f, run)
                seen_kind[idx] = True
                timed = True
            if measured_b is not None and measured_b > 0 and bwd[idx].sum() > 0:
                if st.recompute:  # the backward runs the forward again first
                    cols = np.concatenate([idx, n + idx])
                    obs.add(cols, np.concatenate([fwd[idx], bwd[idx]]) / speed, measured_b, run)
                else:
                    obs.add(n + idx, bwd[idx] / speed, measured_b, run)
                seen_kind[n + idx] = True
                timed = True
            if timed:
                seen[idx] += 1
        share[:n] += fwd
        share[n:] += bwd
    total = share.sum()
    if not obs.measured or total <= 0:
        return [1.0] * n, [1.0] * n, [int(x) for x in seen], [1.0] * len(reports)
    log_factor, log_level = _gauss_newton(obs, share / total, len(reports))
    # a layer no run timed keeps its profiled figure
    factors = np.where(seen_kind, np.exp(log_factor), 1.0)
    return (
        [float(x) for x in factors[:n]],
        [float(x) for x in factors[n:]],
        [int(x) for x in seen],
        [float(math.exp(x)) for x in log_level],
    )


def stage_means(report: RunReport) -> dict[int, tuple[float | None, float | None]]:
    """Per stage: its forward and backward time per micro-batch, as the timeline says.

    Per step the mean over the step's micro-batches and replicas (a step is a sum of actions,
    and sums follow means, not medians), taken from the median step: the report's step time is
    the median step, and the stage times that go with it are that step's (the middle two
    averaged for an even count).  Per-stage medians over steps would mix stages from different
    steps, which a busy machine slowed unevenly, and simulate to another step than the one
    measured.  A report without step times takes the median over the timed steps per stage."""
    per_step: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
    for row in report.timeline:
        if row.step < report.warmup_steps:
            continue
        f, b = per_step.setdefault((row.stage, row.step), ([], []))
        f.extend(row.forward_ms)
        b.extend(row.backward_ms)
    timed = {step for _, step in per_step}
    ranked = sorted(
        (s.measured_ms, s.step) for s in report.steps if s.step in timed and s.measured_ms is not None and not s.warmup
    )
    middle = {step for _, step in ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]}
    acc: dict[int, tuple[list[float], list[float]]] = {}
    for (stage, step), (f, b) in per_step.items():
        if middle and step not in middle:
            continue
        fs, bs = acc.setdefault(stage, ([], []))
        if f:
            fs.append(statistics.fmean(f))
        if b:
            bs.append(statistics.fmean(b))
    return {
        s: (statistics.median(f) if f else None, statistics.median(b) if b else None) for s, (f, b) in acc.items()
    }


def _gauss_newton(
    obs: _Observations, share: NDArray[np.float64], runs: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The log-factors of the 2L (layer, kind) pairs, ``g[kind] + delta[layer, kind]``, and the
    runs' own log-levels ``v``.

    Minimizes ``sum_o (log yhat_o - log y_o)^2 / STAGE_NOISE^2`` (``yhat_o = exp(v[run]) *
    sum of coef * exp(g + delta)`` over the stage's layers) plus the priors: ``delta`` towards
    0 with weight ``share / LAYER_SPREAD^2`` (share: the layer's part of the model's time, so one
    stage's deviation spreads over its layers in proportion to their times; at least half the
    average share), ``v`` (each run's
    own level: a busier machine, another clock) towards 0 with weight ``1 / RUN_SPREAD^2``, and
    the levels ``g`` almost free.  Predictions use ``v = 0``: the runs' typical level.
    """
    rows = np.concatenate(obs.rows)
    cols = np.concatenate(obs.cols)
    coef = np.concatenate(obs.coef)
    n2 = len(share)
    kinds = (cols >= n2 // 2).astype(np.int64)
    run_of = np.asarray(obs.run, dtype=np.int64)
    log_y = np.log(np.asarray(obs.measured, dtype=np.float64))
    n_obs = len(obs.measured)
    weight = 1.0 / STAGE_NOISE**2
    size = 2 + n2 + runs  # [g_forward, g_backward, delta (2L), v (runs)]
    # a layer's prior weight follows its share of the time, but no less than half the average
    # share: a tiny layer (an embedding) must not bend far to absorb what other layers disagree on
    layer_weight = np.maximum(share, 0.5 / n2) / LAYER_SPREAD**2
    prior = np.concatenate([np.full(2, LEVEL_WEIGHT), layer_weight, np.full(runs, 1.0 / RUN_SPREAD**2)])
    ridge = prior + 1e-9
    bound = math.log(MAX_FACTOR)

    def split(x: NDArray[np.float64]) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
        return x[:2], x[2 : 2 + n2], x[2 + n2 :]

    def residuals(x: NDArray[np.float64]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        g, delta, v = split(x)
        terms = coef * np.exp(g[kinds] + delta[cols])
        total = np.maximum(np.bincount(rows, terms, minlength=n_obs), 1e-300)
        return np.log(total) + v[run_of] - log_y, terms / total[rows]

    def objective(x: NDArray[np.float64]) -> float:
        resid, _ = residuals(x)
        return float(weight * resid @ resid + prior @ (x * x))

    x = np.zeros(size)
    current = objective(x)
    damping = 1e-3
    for _ in range(50):
        resid, p = residuals(x)

        def jac(y: NDArray[np.float64], p: NDArray[np.float64] = p) -> NDArray[np.float64]:
            g, delta, v = split(y)
            return np.bincount(rows, p * (g[kinds] + delta[cols]), minlength=n_obs) + v[run_of]

        def jac_t(z: NDArray[np.float64], p: NDArray[np.float64] = p) -> NDArray[np.float64]:
            pz = p * z[rows]
            return np.concatenate([
                np.bincount(kinds, pz, minlength=2),
                np.bincount(cols, pz, minlength=n2),
                np.bincount(run_of, z, minlength=runs),
            ])

        def normal(y: NDArray[np.float64], damping: float = damping) -> NDArray[np.float64]:
            return weight * jac_t(jac(y)) + (ridge + damping) * y

        grad = weight * jac_t(resid) + prior * x
        step = _conjugate_gradient(normal, -grad, iterations=min(4 * size + 20, 2000))
        candidate = np.clip(x + step, -bound, bound)
        value = objective(candidate)
        if value <= current:
            improvement = current - value
            x, current = candidate, value
            damping = max(damping / 3, 1e-9)
            if improvement <= 1e-12 * max(1.0, current):
                break
        else:
            damping *= 10
            if damping > 1e9:
                break
    g, delta, v = split(x)
    return np.clip(g[(np.arange(n2) >= n2 // 2).astype(np.int64)] + delta, -bound, bound), v


def _conjugate_gradient(
    apply: object, rhs: NDArray[np.float64], *, iterations: int, tolerance: float = 1e-12
) -> NDArray[np.float64]:
    """Solve ``apply(x) = rhs`` for a symmetric positive definite operator."""
    assert callable(apply)
    x = np.zeros_like(rhs)
    r = rhs.copy()
    p = r.copy()
    rr = float(r @ r)
    stop = tolerance * max(1.0, rr)
    for _ in range(iterations):
        if rr <= stop:
            break
        ap = apply(p)
        denom = float(p @ ap)
        if denom <= 0:
            break
        alpha = rr / denom
        x += alpha * p
        r -= alpha * ap
        new = float(r @ r)
        p = r + (new / rr) * p
        rr = new
    return x


# --------------------------------------------------------------------------- links


def link_samples(profile: Profile, report: RunReport) -> list[LinkSample]:
    """The transfers and all-reduces ``report`` measured, with the bytes ``profile`` says moved.

    Transfers need start times on one clock (``shared_clock``): a transfer counts when the
    consumer's rank was idle when the data was produced (so it waited for it), from the
    producer's end to the consumer's start.  An all-reduce counts once per step and pipeline
    rank, at the fastest replica (the others also waited for the slowest replica's schedule).
    """
    plan = report.plan
    out: list[LinkSample] = []
    k, d_deg = plan.pipeline_degree, plan.data_parallel_degree
    stages = plan.stages
    costs = layer_costs(profile, plan.microbatch_size)
    cluster = plan.cluster

    def link_name(a: int, b: int) -> str:
        return "intra_node" if cluster.same_node(a, b) else "inter_node"

    if report.shared_clock and len(stages) > 1:
        rows = {(t.stage, t.replica, t.step): t for t in report.timeline}
        steps = sorted({t.step for t in report.timeline})
        for step in steps:
            for d in range(d_deg):
                if not all((s, d, step) in rows for s in range(len(stages))):
                    continue
                # every action of this replica's ranks, in order, to know when each rank went idle
                prev_end: dict[tuple[str, int, int], float] = {}
                for r in range(k):
                    actions = []
                    for s in range(r, len(stages), k):
                        t = rows[(s, d, step)]
                        for mb in range(plan.num_microbatches):
                            actions.append((t.forward_start_ms[mb], t.forward_start_ms[mb] + t.forward_ms[mb], ("F", s, mb)))
                            actions.append((t.backward_start_ms[mb], t.backward_start_ms[mb] + t.backward_ms[mb], ("B", s, mb)))
                    actions.sort()
                    last = -math.inf
                    for _, end, key in actions:
                        prev_end[key] = last
                        last = max(last, end)
                for s in range(len(stages)):
                    t = rows[(s, d, step)]
                    for mb in range(plan.num_microbatches):
                        if s > 0:  # forward waits for the previous stage's forward
                            p = rows[(s - 1, d, step)]
                            produced = p.forward_start_ms[mb] + p.forward_ms[mb]
                            start = t.forward_start_ms[mb]
                            if produced > prev_end[("F", s, mb)] and start >= produced:
                                nbytes = costs.cut_bytes[stages[s - 1].stop - 1]
                                out.append(
                                    LinkSample(link_name(stages[s - 1].devices[d], stages[s].devices[d]), nbytes, 1.0, start - produced)
                                )
                        if s < len(stages) - 1:  # backward waits for the next stage's backward
                            p = rows[(s + 1, d, step)]
                            produced = p.backward_start_ms[mb] + p.backward_ms[mb]
                            start = t.backward_start_ms[mb]
                            if produced > prev_end[("B", s, mb)] and start >= produced:
                                nbytes = costs.cut_bytes[stages[s].stop - 1]
                                out.append(
                                    LinkSample(link_name(stages[s + 1].devices[d], stages[s].devices[d]), nbytes, 1.0, start - produced)
                                )
    if d_deg > 1:
        by_rank = {info.rank: info for info in report.ranks}
        per: dict[tuple[int, int], list[float]] = {}
        for rs in report.rank_steps:
            if rs.step < report.warmup_steps:
                continue
            per.setdefault((rs.rank % k, rs.step), []).append(rs.allreduce_ms)
        for (r, _step), times in per.items():
            info = by_rank.get(r)
            if info is None or info.allreduce_bytes <= 0 or len(times) < d_deg:
                continue
            devices = stages[r].devices
            same = all(cluster.same_node(devices[0], x) for x in devices)
            steps_ring = 2 * (d_deg - 1)
            out.append(
                LinkSample(
                    "intra_node" if same else "inter_node",
                    steps_ring / d_deg * info.allreduce_bytes,
                    float(steps_ring),
                    min(times),
                    collective=True,
                )
            )
    return out


def _fit_link(samples: Sequence[LinkSample], prior: Interconnect, label: str) -> LinkCalibration | None:
    """Latency and bandwidth from ``samples`` (``None`` when there are none)."""
    if not samples:
        return None
    transfers = sum(1 for s in samples if not s.collective)
    collectives = len(samples) - transfers
    # median per distinct (bytes, latencies): robust points to fit a line through
    groups: dict[tuple[float, float], list[float]] = {}
    for s in samples:
        groups.setdefault((s.bytes, s.latencies), []).append(s.ms)
    points = [(b, c, statistics.median(v), len(v)) for (b, c), v in groups.items()]
    per_latency = [b / c for b, c, _, _ in points if c > 0]
    spread = max(per_latency) / max(min(per_latency), 1.0) if per_latency else 1.0
    what = f"{transfers} transfer(s)" + (f" and {collectives} all-reduce(s)" if collectives else "")
    if spread >= SIZE_SPREAD and len(points) >= 2:
        latency_ms, ms_per_byte = _nnls_line(points)
        bandwidth = min(MAX_BANDWIDTH, 1e3 / ms_per_byte) if ms_per_byte > 0 else MAX_BANDWIDTH
        source = f"{label}: latency and bandwidth fitted to {what}"
    else:
        bandwidth = prior.bandwidth_bytes_per_s
        per_byte = 1e3 / bandwidth
        weights = [float(cnt) for _, _, _, cnt in points]
        values = [max(0.0, (ms - b * per_byte) / c) for b, c, ms, _ in points]
        latency_ms = _weighted_median(values, weights)
        source = (
            f"{label}: latency fitted to {what}; bandwidth kept from the cluster "
            f"({bandwidth:.3g} B/s): every sample moved about the same bytes"
        )
    return LinkCalibration(
        bandwidth_bytes_per_s=bandwidth,
        latency_s=max(0.0, latency_ms) / 1e3,
        transfers=transfers,
        collectives=collectives,
        source=source,
    )


def _nnls_line(points: Sequence[tuple[float, float, float, int]]) -> tuple[float, float]:
    """``ms ~ c * latency + bytes * per_byte`` with both >= 0, least squares on relative errors
    (each point weighted by its sample count)."""
    a = np.array([[c, b] for b, c, _, _ in points], dtype=np.float64)
    y = np.array([ms for _, _, ms, _ in points], dtype=np.float64)
    w = np.sqrt(np.array([cnt for _, _, _, cnt in points], dtype=np.float64)) / np.maximum(y, 1e-9)
    aw, yw = a * w[:, None], y * w
    best: tuple[float, float] | None = None
    best_err = math.inf
    candidates: list[tuple[float, float]] = []
    sol, *_ = np.linalg.lstsq(aw, yw, rcond=None)
    candidates.append((float(sol[0]), float(sol[1])))
    for j in range(2):  # one parameter at zero, the other fitted alone
        col = aw[:, 1 - j]
        denom = float(col @ col)
        value = float(col @ yw) / denom if denom > 0 else 0.0
        candidates.append((0.0, value) if j == 0 else (value, 0.0))
    for lat, per_byte in candidates:
        if lat < 0 or per_byte < 0:
            continue
        err = float(np.sum((aw @ np.array([lat, per_byte]) - yw) ** 2))
        if err < best_err:
            best, best_err = (lat, per_byte), err
    return best if best is not None else (0.0, 0.0)


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    pairs = sorted(zip(values, weights, strict=True))
    half = sum(weights) / 2
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]


# --------------------------------------------------------------------------- step overhead


def step_tails(report: RunReport) -> list[float]:
    """Per timed step: what the rank whose schedule ended last spent after it (all-reduces and
    optimizer), the part of the step that follows the pipeline on the critical rank."""
    last: dict[int, tuple[float, float]] = {}
    for rs in report.rank_steps:
        if rs.step < report.warmup_steps:
            continue
        end = rs.start_ms + rs.schedule_ms
        tail = rs.allreduce_ms + rs.tied_ms + rs.optimizer_ms
        if rs.step not in last or end > last[rs.step][0]:
            last[rs.step] = (end, tail)
    return [tail for _, tail in last.values()]


def _overhead(residuals: Sequence[float], reports: Sequence[RunReport]) -> tuple[float, str]:
    if not residuals:
        return 0.0, "no report measured a step time: no overhead"
    median = statistics.median(residuals)
    shown = ", ".join(f"{x:+.2f}" for x in residuals)
    tail = [x for r in reports for x in step_tails(r)]
    measured = (
        f"; after the last rank's schedule, the all-reduces and the optimizer took {statistics.median(tail):.2f} ms "
        "(median over steps)"
        if tail
        else ""
    )
    if median < 0:
        return 0.0, (
            f"none: the runs were faster than the calibrated prediction (measured - predicted {shown} ms over "
            f"{len(residuals)} run(s)){measured}"
        )
    return median, f"median of measured - predicted step time over {len(residuals)} run(s) ({shown} ms){measured}"

