"""The run report as text (torch-free): the printed tables and summary (:func:`render_lines`), and
reading a written report back (:func:`load_report`)."""

from __future__ import annotations

from planner.limits import loads_strict
from planner.schema import RunReport, parse_document
from planner.units import format_bytes
from runtime.report_check import _fmt, check_category_lines


def _recompute_mark(report: RunReport, stage: int) -> str:
    """The ``rc`` column: ``y`` (every layer checkpointed), ``n`` (none), ``s`` (Megatron's
    selective recompute: attention's core in each block), or how many of the stage's first
    layers are checkpointed (a partial recompute)."""
    st = report.plan.stages[stage]
    n = st.checkpointed_layers
    if n == 0:
        return "s" if report.plan.selective_recompute else "n"
    return "y" if n == st.stop - st.start else str(n)


def render_lines(report: RunReport) -> list[str]:
    """The report as plain text lines (two tables and a summary)."""
    out = [
        f"{report.model}: {report.schedule}, K={report.pipeline_degree} x D={report.data_parallel_degree}"
        + (f" x T={report.plan.tensor_parallel_degree}" if report.plan.tensor_parallel_degree > 1 else "")
        + (f", ZeRO {report.plan.zero_stage}" if report.plan.zero_stage else "")
        + (f" (v={report.virtual_stages})" if report.virtual_stages > 1 else "")
        + f", M={report.num_microbatches} x {report.microbatch_size} (global batch "
        f"{report.global_batch_size}), {report.world_size} rank(s), {report.backend} on {report.device}, "
        f"{report.optimizer} lr={report.lr:g}",
        "",
        f"{'step':>4}  {'measured ms':>12}  {'predicted ms':>12}  {'ratio':>6}  {'loss':>12}",
    ]
    for s in report.steps:
        loss = "-" if s.loss is None else f"{s.loss:.6g}"
        mark = " (warm-up)" if s.warmup else ""
        out.append(
            f"{s.step:>4}  {s.measured_ms:>12.2f}  {s.predicted_ms:>12.2f}  {_fmt(s.ratio):>6}  {loss:>12}{mark}"
        )
    mem = any(st.peak_memory_bytes is not None for st in report.stages)
    out += [
        "",
        f"{'stage':>5} {'rank':>4}  {'layers':<28} {'rc':>2}  {'fwd ms/mb':>9} {'pred':>8} {'ratio':>5}  "
        f"{'bwd ms/mb':>9} {'pred':>8} {'ratio':>5}" + ("  peak mem / predicted" if mem else ""),
    ]
    for st in report.stages:
        line = (
            f"{st.index:>5} {st.pipeline_rank:>4}  {st.layers[:28]:<28} {_recompute_mark(report, st.index):>2}  "
            f"{_fmt(st.forward_ms):>9} {st.predicted_forward_ms:>8.2f} {_fmt(st.forward_ratio):>5}  "
            f"{_fmt(st.backward_ms):>9} {st.predicted_backward_ms:>8.2f} {_fmt(st.backward_ratio):>5}"
        )
        if mem:
            peak = "-" if st.peak_memory_bytes is None else format_bytes(st.peak_memory_bytes)
            line += f"  {peak} / {format_bytes(st.predicted_memory_bytes)}"
        out.append(line)
    out += [
        "",
        f"step time: measured {_fmt(report.measured_step_ms)} ms (median after warm-up), predicted "
        f"{report.predicted_step_ms:.2f} ms, measured/predicted {_fmt(report.ratio)}",
    ]
    if any(b is not None for b in report.rank_busy_fraction):
        out.append(
            "compute share of the step: "
            + ", ".join(
                f"rank {r} {b:.0%}" for r, b in enumerate(report.rank_busy_fraction) if b is not None
            )
            + " (the rest: waiting for other stages, communication, optimizer)"
        )
    if report.check is not None:
        c = report.check
        verdict = "PASSED" if c.passed else "FAILED"
        grads = (
            f"{_fmt(c.max_grad_rel_diff, '.2e')} in gradients (worst {c.worst_grad}), "
            if c.max_grad_rel_diff is not None
            else ""
        )
        out.append(
            f"check {verdict}: vs the unsplit model in one process, max relative difference "
            f"{_fmt(c.max_loss_rel_diff, '.2e')} in losses, {grads}{_fmt(c.max_param_rel_diff, '.2e')} in "
            f"{c.params_compared} parameter tensors (worst {c.worst_param}; tolerance {c.tolerance:g}"
            + (f", {c.grad_tolerance:g} for gradients" if c.grad_tolerance not in (None, c.tolerance) else "")
            + ")"
        )
        out.extend(check_category_lines(c))
    out.extend(f"note: {n}" for n in report.notes)
    return out


def load_report(text: str | bytes, *, source: str = "") -> RunReport:
    """Read a report strictly (no NaN or Infinity) and validate it against the schema."""
    report: RunReport = parse_document("report", loads_strict(text, what=f"report {source}".strip()), source=source)
    return report
