"""Per-rank status files and the diagnosis of a failed job (torch-free).

Every worker keeps ``<run_dir>/rank<N>.json`` up to date: its pid, its stages, the step it is
in, and, when it fails, the cause.  After the launcher has stopped the job it reads these
files together with the exit codes torchrun reports and names the rank that caused the
failure: a rank that raised (not a communication error), a rank whose watchdog saw it hang,
a rank that died, or, when the others only timed out waiting, the rank they waited for.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PipeplanError


class JobFailedError(PipeplanError):
    """The distributed job stopped before finishing; the message names the rank and cause."""

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class CheckFailedError(PipeplanError):
    """``--check``: the pipelined run does not reproduce the single-process reference."""


#: words in an error message that mean "a peer went away or did not answer"
_COMM_PATTERNS = re.compile(
    r"timed out|timeout|connection closed|connection reset|broken pipe|peer|"
    r"DistBackendError|DistNetworkError|gloo|nccl|socket|Connection refused|closed by",
    re.IGNORECASE,
)


def is_communication_error(kind: str, message: str) -> bool:
    """True for errors that are a symptom of another rank failing (timeouts, closed sockets)."""
    return bool(_COMM_PATTERNS.search(kind) or _COMM_PATTERNS.search(message))


@dataclass
class RankStatus:
    """What one worker last wrote about itself."""

    rank: int
    pid: int = 0
    host: str = ""
    state: str = "starting"  # starting | running | done | failed | hung
    phase: str = "start-up"
    step: int | None = None
    stages: list[int] = field(default_factory=list)
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    communication: bool = False
    time: float = 0.0

    def where(self) -> str:
        return f"step {self.step}" if self.step is not None else self.phase


def status_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / f"rank{rank}.json"


def write_status(run_dir: str | os.PathLike[str] | None, status: RankStatus) -> None:
    """Atomically replace the rank's status file (no-op without a run directory)."""
    if run_dir is None:
        return
    status.time = time.time()
    path = status_path(run_dir, status.rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status.__dict__), encoding="utf-8")
    os.replace(tmp, path)


def read_statuses(run_dir: str | os.PathLike[str], world_size: int) -> dict[int, RankStatus]:
    """Status of each rank that wrote one (ranks on other hosts are absent)."""
    out: dict[int, RankStatus] = {}
    for rank in range(world_size):
        path = status_path(run_dir, rank)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        known = {k: v for k, v in data.items() if k in RankStatus.__dataclass_fields__}
        out[rank] = RankStatus(**known)
    return out


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


def diagnose(
    statuses: Mapping[int, RankStatus],
    exit_codes: Mapping[int, int],
    *,
    world_size: int,
    timeout_s: float,
    stage_of: Mapping[int, str] | None = None,
) -> tuple[str, list[int]]:
    """The message naming the rank(s) that caused a failed job, and those ranks.

    ``exit_codes`` holds the non-zero exit codes of the ranks torchrun saw fail (negative:
    killed by that signal).  ``stage_of`` labels ranks, e.g. ``{1: "stages 1,3, replica 0"}``.
    """

    def label(rank: int) -> str:
        extra = stage_of.get(rank) if stage_of else None
        return f"rank {rank}" + (f" ({extra})" if extra else "")

    raised = [s for s in statuses.values() if s.state == "failed" and not s.communication]
    hung = [s for s in statuses.values() if s.state == "hung"]
    waited = [s for s in statuses.values() if s.state == "failed" and s.communication]
    lines: list[str] = []
    culprits: list[int] = []
    if raised:
        by_message: dict[str, list[RankStatus]] = {}
        for s in sorted(raised, key=lambda s: (s.time, s.rank)):
            by_message.setdefault(f"{s.error_type}: {s.error}", []).append(s)
        for message, group in by_message.items():
            ranks = [s.rank for s in group]
            who = "every rank" if len(ranks) == world_size > 1 else ", ".join(label(r) for r in ranks)
            lines.append(f"{who} raised {message} (during {group[0].where()})")
            culprits.extend(ranks)
    for s in hung:
        lines.append(f"{label(s.rank)} hung: {s.error} (during {s.where()})")
        culprits.append(s.rank)
    silent = [
        r
        for r in range(world_size)
        if r not in culprits and (r not in statuses or statuses[r].state in ("starting", "running"))
    ]
    if not culprits:
        # nobody reported a cause: a rank that died on its own, or that hung while others waited
        died = [r for r in silent if r in exit_codes and exit_codes[r] not in (-signal.SIGTERM, -signal.SIGINT)]
        for r in died:
            where = statuses[r].where() if r in statuses else "start-up"
            lines.append(f"{label(r)} died ({describe_exit(exit_codes[r])}) during {where} without reporting an error")
            culprits.append(r)
        if not died and waited:
            suspects = [r for r in silent if r in statuses or r in exit_codes] or silent
            for r in suspects:
                where = statuses[r].where() if r in statuses else "start-up"
                lines.append(
                    f"{label(r)} stopped responding during {where}: the other ranks timed out "
                    f"waiting for it (collective timeout {timeout_s:g} s, --timeout)"
                )
                culprits.append(r)
    if not culprits:
        for r, code in sorted(exit_codes.items()):
            lines.append(f"{label(r)} ended with {describe_exit(code)}")
            culprits.append(r)
    for s in waited:
        if s.rank not in culprits:
            lines.append(f"  then {label(s.rank)} gave up: {s.error_type}: {_short(s.error)}")
    stopped = [r for r in exit_codes if r not in culprits and r not in {s.rank for s in waited}]
    if stopped:
        lines.append(f"  the launcher stopped rank(s) {', '.join(map(str, sorted(stopped)))}")
    if not lines:
        lines.append("the job failed without any rank reporting a cause")
    return "\n".join(lines), culprits


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_summary(err: BaseException) -> dict[str, Any]:
    """Type and message of an exception, as a status file stores them."""
    message = str(err) or repr(err)
    return {
        "error_type": type(err).__name__,
        "error": message,
        "communication": is_communication_error(type(err).__name__, message),
    }
