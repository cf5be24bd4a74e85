"""The per-step training log of ``pipeplan run --log FILE``: CSV or JSON lines.

One record per step: ``step``, ``loss`` (the mean over the step's micro-batches and
replicas), ``lr``, ``step_ms`` (the slowest rank), ``samples_per_s`` (global batch / step
time), ``grad_norm`` (the global gradient norm before clipping), ``loss_scale`` (float16
only) and ``skipped`` (a float16 step skipped for inf/NaN gradients).  ``*.csv`` gets a
header line and empty cells for missing values; anything else one JSON object per line
(``null`` for missing values).  Rank 0 writes and flushes each line as its step ends, so a
plotting tool can follow a running job.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

FIELDS = ("step", "loss", "lr", "step_ms", "samples_per_s", "grad_norm", "loss_scale", "skipped")


class StepLog:
    """Append one record per step to ``path`` (created or truncated)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.csv = self.path.suffix.lower() == ".csv"
        self._file = self.path.open("w", encoding="utf-8", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=FIELDS) if self.csv else None
        if self._writer is not None:
            self._writer.writeheader()
            self._file.flush()

    def write(self, **record: Any) -> None:
        unknown = set(record) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown log fields {sorted(unknown)}")
        row = {k: record.get(k) for k in FIELDS}
        if self._writer is not None:
            self._writer.writerow({k: "" if v is None else v for k, v in row.items()})
        else:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a log written by :class:`StepLog` (numbers as numbers, missing as None)."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() != ".csv":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for row in csv.DictReader(text.splitlines()):
        rec: dict[str, Any] = {}
        for k in FIELDS:
            v = row.get(k, "")
            if v == "" or v is None:
                rec[k] = None
            elif k == "skipped":
                rec[k] = v == "True"
            elif k == "step":
                rec[k] = int(v)
            else:
                rec[k] = float(v)
        out.append(rec)
    return out


def log_step(
    log: Any,
    step: int,
    loss: float | None,
    ms: float,
    lr: float,
    norm: float | None,
    loss_scale: float | None,
    skipped: bool,
    global_batch: int,
    world: int,
    device: Any,
) -> None:
    """Every rank sends (loss, has loss, step ms); rank 0 writes the step's line: the mean loss
    of the replicas and the slowest rank's time."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([loss or 0.0, 1.0 if loss is not None else 0.0, ms], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if log is None:
        return
    rows = [t.tolist() for t in every]
    count = sum(r[1] for r in rows)
    step_ms = max(r[2] for r in rows)
    log.write(
        step=step,
        loss=sum(r[0] for r in rows) / count if count else None,
        lr=lr,
        step_ms=step_ms,
        samples_per_s=global_batch / (step_ms / 1e3) if step_ms > 0 else None,
        grad_norm=norm,
        loss_scale=loss_scale,
        skipped=skipped,
    )
