"""Process memory for the run report (torch-free; CPU runs have no allocator figure: the resident
set stands in for it): this process's resident set and peak, and the report's ``resident set
per rank`` note, written (:func:`rss_note`) and read back (:func:`parse_rss_note`)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

# ---- process memory (CPU runs have no allocator figure: the resident set stands in for it)

#: the note's opening words; :func:`parse_rss_note` finds the note by them
RSS_NOTE = "resident set per rank"
_MIB = 1 << 20
_RSS_ROW = re.compile(
    r"rank (\d+) \[stages ([\d,]+)\]: ([\d.]+) MiB peak (in training|of the run) "
    r"\(([\d.]+|\?) MiB at the first step, ([\d.]+|\?) MiB before the model\)"
)


@dataclass(frozen=True)
class RssRow:
    """One rank's resident set (bytes): its peak in training (from the first step on, where
    the peak can be reset; else over the whole run), its size at the first step (the model,
    its stages and the process group built) and just before it built the model (the
    interpreter, torch and the launcher's share)."""

    rank: int
    stages: tuple[int, ...]
    peak_bytes: int
    first_step_bytes: int | None
    before_model_bytes: int | None
    peak_in_training: bool = True


def current_rss_bytes() -> int | None:
    """This process's resident set now (Linux ``/proc/self/statm``); None where there is none."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def reset_peak_rss() -> bool:
    """Start this process's peak resident set again from now (Linux ``clear_refs`` 5, which
    resets ``VmHWM``); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int | None:
    """This process's peak resident set so far: Linux ``VmHWM`` (which counts the resident set
    now, where ``getrusage`` may lag it), else ``getrusage``; None where there is neither."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB elsewhere


def _mib(x: int | None) -> str:
    return "?" if x is None else f"{x / _MIB:.1f}"


def rss_note(rows: Sequence[RssRow]) -> str:
    """The report's note on every rank's resident set (read back by :func:`parse_rss_note`)."""
    cells = [
        f"rank {r.rank} [stages {','.join(map(str, r.stages))}]: {_mib(r.peak_bytes)} MiB peak "
        f"{'in training' if r.peak_in_training else 'of the run'} ({_mib(r.first_step_bytes)} MiB at the first "
        f"step, {_mib(r.before_model_bytes)} MiB before the model)"
        for r in sorted(rows, key=lambda r: r.rank)
    ]
    return (
        f"{RSS_NOTE} (whole process; every rank builds and traces the whole model before keeping its "
        "stages): " + "; ".join(cells)
    )


def parse_rss_note(notes: Sequence[str]) -> list[RssRow]:
    """The rows of a report's :func:`rss_note` (MiB rounded to 0.1), [] when the report has none."""
    note = next((n for n in notes if n.startswith(RSS_NOTE)), None)
    if note is None:
        return []

    def size(text: str) -> int | None:
        return None if text == "?" else round(float(text) * _MIB)

    return [
        RssRow(
            rank=int(m.group(1)),
            stages=tuple(int(x) for x in m.group(2).split(",")),
            peak_bytes=round(float(m.group(3)) * _MIB),
            first_step_bytes=size(m.group(5)),
            before_model_bytes=size(m.group(6)),
            peak_in_training=m.group(4) == "in training",
        )
        for m in _RSS_ROW.finditer(note)
    ]
