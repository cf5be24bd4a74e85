"""Charts of a plan, drawn with matplotlib from the simulator's timeline.

* :func:`gantt_figure` - one row per pipeline rank (device; data-parallel replicas run the
  same timeline): forward, backward (or its input- and weight-gradient halves, I and W) and
  recompute boxes labelled and shaded by micro-batch,
  the transfers each rank sends as a thin strip under its row, the idle time (the bubble)
  hatched, and the bubble fraction in the title.
* :func:`memory_figure` - per device, stacked parameters, gradients, optimizer state and
  activations against the usable-memory limit.
* :func:`sweep_figure` - a sweep's throughput and scaling efficiency against devices.
* :func:`gantt_svg` / :func:`memory_svg` - the same as SVG text (the API serves these);
  :func:`save_chart` writes a figure or a chart kind to ``.svg`` or ``.png``.

Torch-free.  matplotlib is imported inside the functions (it is the ``viz`` extra) and
figures are built with ``matplotlib.figure.Figure`` directly, never through ``pyplot``: no
global figure registry, no GUI backend, safe in a server thread.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

from planner.errors import InputError
from planner.schema import Plan, StagePlan, SweepResult
from planner.simulator import Simulation

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ChartKind = Literal["gantt", "memory"]
CHART_KINDS: tuple[ChartKind, ...] = ("gantt", "memory")

#: base colour of each box kind (matplotlib "tab" palette)
KIND_COLOURS: Mapping[str, str] = MappingProxyType({
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "backward_input": "#bcbd22",
    "backward_weight": "#17becf",
    "recompute": "#ff7f0e",
    "send_forward": "#9467bd",
    "send_backward": "#8c564b",
    "idle": "#d62728",
    "allreduce": "#7f7f7f",
})
MEMORY_COLOURS: Mapping[str, str] = MappingProxyType({
    "parameters": "#1f77b4",
    "gradients": "#aec7e8",
    "optimizer state": "#ff7f0e",
    "activations": "#2ca02c",
    "optimizer step": "#ffbb78",
})
#: above this many compute boxes the micro-batch numbers are not written in the boxes
MAX_LABELLED_BOXES = 400
#: above this many boxes the rows are embedded in the SVG as an image (a small file, fast)
MAX_VECTOR_BOXES = 3000
GIB = float(1 << 30)
MIB = float(1 << 20)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise InputError(
            "charts need matplotlib, which is not installed: pip install 'pipeplan[viz]' "
            "(or pip install matplotlib), or use `pipeplan show plan.json` for the text grid"
        ) from None


def _new_figure(width_in: float, height_in: float, dpi: float) -> Figure:
    _require_matplotlib()
    from matplotlib.figure import Figure

    if not (width_in > 0 and height_in > 0 and dpi > 0):
        raise InputError(f"figure size and dpi must be positive, got {width_in}x{height_in} in at {dpi} dpi")
    return Figure(figsize=(width_in, height_in), dpi=dpi, layout="constrained")


def _shade(hex_colour: str, microbatch: int, num_microbatches: int) -> tuple[float, float, float]:
    """The kind's colour, lightened a little more for each later micro-batch."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(hex_colour)
    t = 0.55 * (microbatch % max(1, num_microbatches)) / max(1, num_microbatches - 1) if num_microbatches > 1 else 0.0
    return (r + (1 - r) * t, g + (1 - g) * t, b + (1 - b) * t)


# --------------------------------------------------------------------------- Gantt


def allreduce_per_rank(plan: Plan) -> list[float]:
    """Each pipeline rank's gradient all-reduce after its last backward (ms), as the cost
    model counts it: ring all-reduce of the rank's gradient bytes over its D replicas, on the
    intra-node link when all replicas share a node."""
    from planner.cost import allreduce_ms

    k, d = plan.pipeline_degree, plan.data_parallel_degree
    out = []
    for r in range(k):
        own = rank_stage_plans(plan, r)
        grad_bytes = sum(s.param_bytes for s in own) * plan.training.gradient_bytes_per_param_byte
        replicas = own[0].devices
        cluster = plan.cluster
        same = all(cluster.same_node(replicas[0], x) for x in replicas)
        link = cluster.intra_node if same else cluster.inter_node
        # what adds to the step: the share that does not overlap the last backward
        out.append(allreduce_ms(grad_bytes, d, link.bandwidth_bytes_per_s, link.latency_s)
                   * (1.0 - plan.training.gradient_overlap))
    return out


def gantt_figure(
    plan: Plan,
    *,
    simulation: Simulation | None = None,
    width_in: float = 12.0,
    height_in: float | None = None,
    dpi: float = 100.0,
    title: str | None = None,
) -> Figure:
    """The schedule of ``plan`` as a Gantt chart (see the module doc).

    ``simulation`` defaults to :func:`planner.cost.simulate_plan` of the plan.  The
    height defaults to 1.6 in plus 0.45 in per rank (capped at 16 in).
    """
    from matplotlib.patches import Patch

    from planner.cost import simulate_plan

    sim = simulation if simulation is not None else simulate_plan(plan)
    k = len(sim.timelines)
    if height_in is None:
        height_in = min(16.0, 1.6 + 0.45 * k)
    fig = _new_figure(width_in, height_in, dpi)
    ax = fig.add_subplot()
    m = plan.num_microbatches
    allreduce = allreduce_per_rank(plan) if len(plan.stages) == len(sim.timelines) * plan.virtual_stages else []
    finish = [max((e.end_ms for e in t), default=0.0) for t in sim.timelines]
    makespan = max([sim.makespan_ms, *(f + a for f, a in zip(finish, allreduce, strict=False))])
    total_boxes = sum(len(t) for t in sim.timelines)
    label_boxes = total_boxes <= MAX_LABELLED_BOXES
    rasterize = total_boxes > MAX_VECTOR_BOXES
    bar_h = 0.62
    strip_h = 0.14
    # rows top to bottom: rank 0 first
    for r, timeline in enumerate(sim.timelines):
        y = k - 1 - r
        # idle gaps: the bubble
        busy = sorted((e.start_ms, e.end_ms) for e in timeline if e.end_ms > e.start_ms)
        gaps: list[tuple[float, float]] = []
        t = 0.0
        for a, b in busy:
            if a > t:
                gaps.append((t, a - t))
            t = max(t, b)
        if makespan > t:
            gaps.append((t, makespan - t))
        if gaps:
            ax.broken_barh(
                gaps,
                (y - bar_h / 2, bar_h),
                facecolors="#f6d5d5" if rasterize else "#f7f7f7",
                edgecolors=KIND_COLOURS["idle"],
                hatch=None if rasterize else "///",  # hatching thousands of gaps is slow
                linewidth=0.0,
                alpha=0.5,
                rasterized=rasterize,
            )
        spans: list[tuple[float, float]] = []
        colours: list[tuple[float, float, float]] = []
        for e in timeline:
            width = e.end_ms - e.start_ms
            if width <= 0:
                continue
            spans.append((e.start_ms, width))
            colours.append(_shade(KIND_COLOURS[e.kind], e.microbatch, m))
            if label_boxes and makespan > 0 and width / makespan * width_in * 72 >= 9:
                text = str(e.microbatch) if plan.virtual_stages == 1 else f"{e.microbatch}.{e.stage // k}"
                ax.text(
                    e.start_ms + width / 2, y, text, ha="center", va="center", fontsize=6, color="black", clip_on=True
                )
        if spans:
            # one collection per row; with thousands of boxes it is drawn as an image inside the SVG
            ax.broken_barh(
                spans,
                (y - bar_h / 2, bar_h),
                facecolors=colours,
                edgecolors="white",
                linewidth=0.4 if label_boxes else 0.0,
                rasterized=rasterize,
            )
    # the gradient all-reduce of data-parallel replicas, after each rank's last backward
    for r, ar in enumerate(allreduce):
        if ar > 0:
            ax.broken_barh([(finish[r], ar)], (k - 1 - r - bar_h / 2, bar_h), facecolors=KIND_COLOURS["allreduce"])
    # transfers: a thin strip under the sending rank's row
    for kind in ("send_forward", "send_backward"):
        by_rank: dict[int, list[tuple[float, float]]] = {}
        for e in sim.transfers:
            if e.kind == kind and e.end_ms > e.start_ms:
                by_rank.setdefault(e.rank, []).append((e.start_ms, e.end_ms - e.start_ms))
        for r, spans in by_rank.items():
            y = k - 1 - r
            off = -bar_h / 2 - strip_h if kind == "send_forward" else -bar_h / 2 - 2 * strip_h
            ax.broken_barh(
                spans, (y + off, strip_h), facecolors=KIND_COLOURS[kind], linewidth=0.0, alpha=0.8, rasterized=rasterize
            )
    step = -(-k // 48)  # at most about 48 row labels
    rows = [r for r in range(k) if r % step == 0]
    ax.set_yticks([k - 1 - r for r in rows])
    ax.set_yticklabels([_rank_label(plan, r) for r in rows], fontsize=8 if k <= 24 else 6)
    ax.set_ylim(-0.5 - 2 * strip_h, k - 0.5)
    ax.set_xlim(0, makespan if makespan > 0 else 1.0)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    if title is None:
        chunks = f", v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
        title = (
            f"{plan.model}: {plan.schedule}, K={plan.pipeline_degree}{chunks}, M={plan.num_microbatches}, "
            f"D={plan.data_parallel_degree} - step {makespan:.4g} ms, bubble {sim.bubble_fraction:.1%}"
        )
    ax.set_title(title, fontsize=10)
    present = {e.kind for t in sim.timelines for e in t}
    handles = [
        Patch(facecolor=KIND_COLOURS["forward"], label="forward"),
        *[
            Patch(facecolor=KIND_COLOURS[kind], label=label)
            for kind, label in (
                ("backward", "backward"),
                ("backward_input", "input gradient (I)"),
                ("backward_weight", "weight gradient (W)"),
            )
            if kind in present or (kind == "backward" and not present & {"backward_input", "backward_weight"})
        ],
        Patch(facecolor=KIND_COLOURS["recompute"], label="recompute"),
        Patch(facecolor=KIND_COLOURS["send_forward"], label="send activations"),
        Patch(facecolor=KIND_COLOURS["send_backward"], label="send gradients"),
        Patch(facecolor=KIND_COLOURS["allreduce"], label="gradient all-reduce"),
        Patch(facecolor="#f7f7f7", edgecolor=KIND_COLOURS["idle"], hatch="///", label="idle (bubble)"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=7, frameon=False)
    return fig


def rank_stage_plans(plan: Plan, rank: int) -> list[StagePlan]:
    """The stages pipeline rank ``rank`` runs (the plan's placement)."""
    from planner.schedules import stage_rank

    k, v = plan.pipeline_degree, plan.virtual_stages
    return [s for s in plan.stages if stage_rank(plan.placement, s.index, k, v) == rank]


def _rank_label(plan: Plan, rank: int) -> str:
    stages = rank_stage_plans(plan, rank)
    devices = stages[0].devices if stages else []
    shown = ",".join(str(d) for d in devices[:4]) + (",..." if len(devices) > 4 else "")
    return f"rank {rank} (dev {shown})"


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryBreakdown:
    """One device's predicted peak, split in five (bytes): its static parts, and its activations
    or, when the peak is the optimizer step, that step's temporaries."""

    rank: int
    stages: tuple[int, ...]
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    limit: int
    optimizer_step: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.optimizer_step


def memory_breakdown(plan: Plan) -> list[MemoryBreakdown]:
    """Per pipeline rank: parameters, gradients, optimizer state and activations.

    ``memory_bytes`` of a stage is the peak of the device that runs it (for interleaved
    plans, the whole device with all its chunks), so the static parts sum the parameters of
    every chunk on the device and the activations are what remains of that peak (or the
    optimizer step's temporaries, where the plan's ``memory_parts`` say the peak is the step).
    """
    k = plan.pipeline_degree
    grad_f = plan.training.gradient_bytes_per_param_byte
    opt_f = plan.training.optimizer_state_factor
    out = []
    for r in range(k):
        own = rank_stage_plans(plan, r)
        params = float(sum(s.param_bytes for s in own))
        peak = float(max(s.memory_bytes for s in own))
        static = params * (1 + grad_f + opt_f)
        parts = own[0].memory_parts
        at_step = parts is not None and parts.optimizer_step > 0
        out.append(
            MemoryBreakdown(
                rank=r,
                stages=tuple(s.index for s in own),
                parameters=params,
                gradients=params * grad_f,
                optimizer_state=params * opt_f,
                activations=0.0 if at_step else max(0.0, peak - static),
                limit=min(s.memory_limit_bytes for s in own),
                optimizer_step=max(0.0, peak - static) if at_step else 0.0,
            )
        )
    return out


def memory_figure(
    plan: Plan,
    *,
    width_in: float = 10.0,
    height_in: float = 5.0,
    dpi: float = 100.0,
    title: str | None = None,
) -> Figure:
    """Predicted peak memory per device, stacked by kind, against each device's limit."""
    parts = memory_breakdown(plan)
    fig = _new_figure(width_in, height_in, dpi)
    ax = fig.add_subplot()
    xs = list(range(len(parts)))
    largest = max([p.total for p in parts] + [float(p.limit) for p in parts])
    unit, unit_name = (GIB, "GiB") if largest >= 2 * GIB else (MIB, "MiB")
    bottom = [0.0] * len(parts)
    for label, attr in (
        ("parameters", "parameters"),
        ("gradients", "gradients"),
        ("optimizer state", "optimizer_state"),
        ("activations", "activations"),
        ("optimizer step", "optimizer_step"),
    ):
        if attr == "optimizer_step" and not any(p.optimizer_step for p in parts):
            continue  # drawn only where the step makes a device's peak
        values = [getattr(p, attr) / unit for p in parts]
        ax.bar(xs, values, bottom=bottom, color=MEMORY_COLOURS[label], label=label, width=0.7)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    limits = [p.limit / unit for p in parts]
    ax.hlines(limits, [x - 0.45 for x in xs], [x + 0.45 for x in xs], colors="#d62728", linestyles="--",
              linewidth=1.5, label="usable memory (limit)")
    over = [p.rank for p in parts if p.total > p.limit]
    for p in parts:
        if p.total > p.limit:
            ax.text(p.rank, p.total / unit, "over", ha="center", va="bottom", color="#d62728", fontsize=8)
    chunked = plan.virtual_stages > 1
    if len(parts) <= 16:
        ax.set_xticks(xs)
        ax.set_xticklabels(
            [(f"dev {p.rank}\n(stages {','.join(map(str, p.stages))})" if chunked else f"stage {p.rank}") for p in parts],
            fontsize=8,
        )
    else:  # many devices: numbers only, at most about 32 of them
        step = -(-len(parts) // 32)
        ax.set_xticks(xs[::step])
        ax.set_xticklabels([str(x) for x in xs[::step]], fontsize=7)
        ax.set_xlabel("device (pipeline rank)" if chunked else "stage")
    ax.set_ylabel(unit_name)
    ax.set_ylim(0, max(max(bottom, default=0.0), max(limits, default=0.0)) * 1.12 or 1.0)
    ax.grid(axis="y", linestyle=":", linewidth=0.5)
    fig.legend(loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    if title is None:
        peak = max((p.total for p in parts), default=0.0)
        fits = "fits" if not over else f"DOES NOT FIT on device(s) {', '.join(map(str, over))}"
        title = (
            f"{plan.model}: predicted peak memory per device ({plan.schedule}, M={plan.num_microbatches}) - "
            f"max {peak / unit:.4g} {unit_name}, {fits}"
        )
    ax.set_title(title, fontsize=10)
    return fig


# --------------------------------------------------------------------------- output


def figure_svg(fig: Figure) -> str:
    """A figure as SVG text."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    return buf.getvalue()


def figure_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def chart_figure(kind: str, plan: Plan) -> Figure:
    """``"gantt"`` or ``"memory"`` figure of a plan."""
    if kind == "gantt":
        return gantt_figure(plan)
    if kind == "memory":
        return memory_figure(plan)
    raise InputError(f"unknown chart {kind!r}: choose one of {', '.join(CHART_KINDS)}")


def gantt_svg(plan: Plan) -> str:
    """The Gantt chart of ``plan`` as SVG text (``GET /v1/plans/{id}/gantt.svg``)."""
    return figure_svg(gantt_figure(plan))


def memory_svg(plan: Plan) -> str:
    """The memory chart of ``plan`` as SVG text (``GET /v1/plans/{id}/memory.svg``)."""
    return figure_svg(memory_figure(plan))


def save_chart(fig_or_kind: Figure | str, path: str | Path, *, plan: Plan | None = None) -> Path:
    """Write a figure (or the ``"gantt"``/``"memory"`` chart of ``plan``) to ``.svg`` or ``.png``.

    The format follows the file suffix.  Returns the path written.
    """
    out = Path(path)
    suffix = out.suffix.lower()
    if suffix not in (".svg", ".png"):
        raise InputError(f"cannot write a chart to {str(out)!r}: the file name must end in .svg or .png")
    if isinstance(fig_or_kind, str):
        if plan is None:
            raise InputError(f"save_chart({fig_or_kind!r}, ...) needs the plan: pass plan=...")
        fig = chart_figure(fig_or_kind, plan)
    else:
        fig = fig_or_kind
    if not out.parent.exists():
        raise InputError(f"cannot write {str(out)!r}: directory {str(out.parent)!r} does not exist")
    try:
        fig.savefig(out, format=suffix[1:])
    except OSError as err:
        raise InputError(f"cannot write chart {str(out)!r}: {err}") from None
    return out


def sweep_figure(result: SweepResult, *, dpi: float = 100.0) -> Figure:
    """Throughput and scaling efficiency against devices, one line per device kind; Pareto
    points filled, infeasible points marked on the axis."""
    _require_matplotlib()
    fig = _new_figure(10.0, 4.0, dpi)
    ax_t, ax_e = fig.subplots(1, 2)
    kinds = list(dict.fromkeys(p.device_kind for p in result.points))
    for kind in kinds:
        pts = sorted((p for p in result.points if p.device_kind == kind), key=lambda p: p.devices)
        ok = [p for p in pts if p.status == "ok"]
        label = kind or result.model
        if ok:
            line = ax_t.plot([p.devices for p in ok], [p.throughput_samples_per_s for p in ok], marker="o",
                             mfc="none", label=label)[0]
            front = [p for p in ok if p.pareto]
            ax_t.plot([p.devices for p in front], [p.throughput_samples_per_s for p in front], "o",
                      color=line.get_color())
            ax_e.plot([p.devices for p in ok], [p.scaling_efficiency for p in ok], marker="o",
                      color=line.get_color(), label=label)
        bad = [p for p in pts if p.status != "ok"]
        if bad:
            ax_t.plot([p.devices for p in bad], [0] * len(bad), "x", color="#d62728",
                      label=f"{label}: does not fit")
    counts = sorted({p.devices for p in result.points})
    for ax in (ax_t, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.set_xlabel("devices")
        ax.grid(True, alpha=0.3)
    ax_t.set_ylabel("samples / s (filled: Pareto front)")
    ax_e.set_ylabel("scaling efficiency")
    ax_e.set_ylim(bottom=0)
    ax_t.legend(fontsize="small")
    fig.suptitle(f"{result.model}: best plan per cluster size")
    return fig
