"""A stored plan's charts as SVG: the API's ``/v1/plans/{id}/gantt.svg`` and the plan pages
draw them here, with :mod:`planner.charts` (matplotlib, the ``viz`` extra).

The Gantt chart's compute boxes carry ids: each pipeline rank's boxes are one SVG group
``<g id="actions-rank{r}">`` with one shape per action (forward, backward, input or weight
gradient, recompute) of that rank, so a page, a browser test or a script can find and count
them.  The groups are found by geometry (the boxes of a rank's row are exactly the spans of
its timeline), not by colour or drawing order.

:class:`ChartRenderer` (one per app) draws one chart at a time (matplotlib's first import
and its font cache are not thread-safe: two first requests at once broke the import) and
keeps the latest charts, up to a byte budget: a stored plan never changes, so neither do its
charts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import HTTPException

from planner.errors import InputError
from planner.schema import Plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from planner.simulator import Simulation

ChartKind = Literal["gantt", "memory"]

#: tolerance (ms, and rows) when matching drawn boxes to timeline spans
_TOLERANCE = 1e-6


def _tag_action_boxes(fig: Figure, sim: Simulation) -> int:
    """Give each rank's compute-box collection the gid ``actions-rank{r}``; return how many
    ranks were tagged."""
    ax = fig.axes[0]
    k = len(sim.timelines)
    wanted: dict[int, list[tuple[float, float]]] = {}
    for r, timeline in enumerate(sim.timelines):
        wanted[r] = sorted((e.start_ms, e.end_ms) for e in timeline if e.end_ms > e.start_ms)
    tagged = 0
    for collection in ax.collections:
        paths = collection.get_paths()
        if not paths:
            continue
        boxes = []
        centres = set()
        for path in paths:
            vertices = np.asarray(path.vertices, dtype=float)
            xs, ys = vertices[:, 0], vertices[:, 1]
            boxes.append((float(xs.min()), float(xs.max())))
            centres.add(round(float(ys.min() + ys.max()) / 2, 6))
        if len(centres) != 1:
            continue
        row = k - 1 - round(centres.pop())
        spans = wanted.get(row)
        if spans is None or len(spans) != len(boxes) or collection.get_gid():
            continue
        if all(abs(a - c) <= _TOLERANCE * max(1.0, abs(c)) and abs(b - d) <= _TOLERANCE * max(1.0, abs(d))
               for (a, b), (c, d) in zip(sorted(boxes), spans, strict=True)):
            collection.set_gid(f"actions-rank{row}")
            wanted.pop(row)
            tagged += 1
    return tagged


def chart_svg(kind: ChartKind, plan_json: str) -> str:
    """The ``"gantt"`` or ``"memory"`` chart of a stored plan as SVG text.  501 when the server
    cannot draw (matplotlib missing)."""
    plan = Plan.model_validate_json(plan_json)
    try:
        from planner import charts
        from planner.cost import simulate_plan
    except ImportError as err:
        raise HTTPException(
            status_code=501, detail=f"charts are not available in this build ({err}): install pipeplan[viz]"
        ) from None
    try:
        if kind == "gantt":
            sim = simulate_plan(plan)
            fig = charts.gantt_figure(plan, simulation=sim)
            _tag_action_boxes(fig, sim)
        else:
            fig = charts.memory_figure(plan)
        text: str = charts.figure_svg(fig)
    except (InputError, ImportError) as err:  # e.g. matplotlib missing on the server
        raise HTTPException(status_code=501, detail=f"cannot draw the chart: {err}: install pipeplan[viz]") from None
    return text


class ChartRenderer:
    """Draws charts one at a time and keeps the most recent ones (``max_bytes`` of SVG text)."""

    def __init__(self, *, max_bytes: int = 32 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._draw = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._bytes = 0

    def svg(self, kind: ChartKind, plan_id: str, plan_json: str) -> str:
        """The chart of the stored plan ``plan_id`` (whose text is ``plan_json``)."""
        key = (plan_id, kind)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        with self._draw:
            with self._lock:  # drawn by another thread while this one waited
                cached = self._cache.get(key)
            if cached is not None:
                return cached
            text = chart_svg(kind, plan_json)
        with self._lock:
            if key not in self._cache and len(text) <= self.max_bytes:
                self._cache[key] = text
                self._bytes += len(text)
                while self._bytes > self.max_bytes:
                    _, dropped = self._cache.popitem(last=False)
                    self._bytes -= len(dropped)
        return text
