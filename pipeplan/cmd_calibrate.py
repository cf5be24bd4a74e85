"""``pipeplan calibrate``: fit a profile to what runs measured (``planner/calibrate.py``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.calibrate import CalibrationResult
    from planner.schema import Calibration


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit a profile to run reports: per-layer time factors, links, step overhead (and the device "
        "model's constants of a synthesized profile)",
        description="Fit the cost model to what runs measured: per-layer time scale factors from the "
        "stages' measured times, link latency and bandwidth from measured transfers and all-reduces, and "
        "a fixed overhead per step; for a profile the device model priced (pipeplan synth, fake tensors), "
        "first the device model's gemm and memory efficiencies, re-pricing the layers with them.  Writes a new "
        "profile that records where each figure came from; plan with it (pipeplan plan CALIBRATED ...).  "
        "Reports of plans with different splits combine.",
    )
    p.add_argument("profile", help="the profile the plans were made from")
    p.add_argument("reports", nargs="+", metavar="REPORT", help="run reports (pipeplan run --report FILE)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="write the calibrated profile here")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the line that says where it went")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.calibrate import calibrate
    from planner.limits import MAX_REPORTS, check_count
    from planner.schema import Profile, RunReport, load_document

    check_count("run reports", len(args.reports), MAX_REPORTS, by="one calibration reads", fix="calibrate with fewer")
    profile: Profile = load_document("profile", args.profile)
    reports: list[tuple[str, RunReport]] = [(path, load_document("report", path)) for path in args.reports]
    result = calibrate(profile, reports)
    text = result.profile.model_dump_json(indent=1)
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    if not args.quiet:
        print("\n".join(summary_lines(result)))
    print(f"calibrated profile of {result.profile.num_layers} layers written to {args.output}")
    return 0


def summary_lines(result: CalibrationResult) -> list[str]:
    """What the calibration found, run by run and figure by figure."""
    cal = result.profile.calibration
    assert cal is not None
    width = max(len("report"), *(len(r.report) for r in result.runs))
    pwidth = max(len("plan"), *(len(r.plan) for r in result.runs))
    out = [
        f"{result.profile.model}: calibrated from {len(result.runs)} run(s)",
        "",
        f"{'report':<{width}}  {'plan':<{pwidth}}  {'measured ms':>11}  {'before ms':>9} {'meas/pred':>9}  "
        f"{'after ms':>9} {'meas/pred':>9}",
    ]
    for r in result.runs:
        before = r.measured_step_ms / r.predicted_before_ms if r.predicted_before_ms > 0 else float("nan")
        after = r.measured_step_ms / r.predicted_after_ms if r.predicted_after_ms > 0 else float("nan")
        out.append(
            f"{r.report:<{width}}  {r.plan:<{pwidth}}  {r.measured_step_ms:>11.2f}  {r.predicted_before_ms:>9.2f} "
            f"{before:>9.3f}  {r.predicted_after_ms:>9.2f} {after:>9.3f}"
        )
    timed = [c for c in cal.layers if c.stages_seen]
    out.append("")
    if timed:
        fwd = [c.forward_scale for c in timed]
        bwd = [c.backward_scale for c in timed]
        out.append(
            f"layers: forward x{min(fwd):.3g}..{max(fwd):.3g}, backward x{min(bwd):.3g}..{max(bwd):.3g} "
            f"({len(timed)} of {len(cal.layers)} layers timed; the others keep their profiled times)"
        )
    out.extend(constants_lines(cal))
    for link in (cal.intra_node, cal.inter_node):
        if link is not None:
            out.append(
                f"link {link.source}: {link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, latency {link.latency_s * 1e3:.3f} ms"
            )
    if cal.intra_node is None and cal.inter_node is None:
        out.append("links: none measured; the clusters' links are kept")
    out.append(f"step overhead: {cal.step_overhead_ms:.2f} ms ({cal.step_overhead_source})")
    out.extend(f"note: {n}" for n in result.notes)
    return out


def constants_lines(cal: Calibration) -> list[str]:
    """The device model's fitted constants, and how to synthesize with them (nothing for a
    measured profile)."""
    dc = cal.device_constants
    if dc is None:  # a measured profile, or nothing fitted (a note says why)
        return []
    fitted = set(dc.fitted)

    def shown(name: str, value: float, before: float) -> str:
        what = f"{value:.4g} (profiled {before:g})" if name in fitted else f"{value:g} (kept)"
        return f"{name.replace('_', ' ')} {what}"

    return [
        f"device model {dc.device_type}: {shown('gemm_efficiency', dc.gemm_efficiency, dc.profiled_gemm_efficiency)}, "
        f"{shown('memory_efficiency', dc.memory_efficiency, dc.profiled_memory_efficiency)}",
        f"  {cal.device_constants_source}",
        f"  synthesize with them: pipeplan synth transformer ... --device-type {dc.device_type} "
        f"--gemm-efficiency {dc.gemm_efficiency:.4g} --memory-efficiency {dc.memory_efficiency:.4g}",
    ]
