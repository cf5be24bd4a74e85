"""The per-step log (``--log-file``): CSV or JSON lines, read back as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.steplog import FIELDS, StepLog, read_log


@pytest.mark.parametrize("name", ["log.csv", "log.jsonl"])
def test_the_log_reads_back_as_written(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    log = StepLog(path)
    rows = [
        dict(step=0, loss=4.5, lr=0.001, step_ms=12.5, samples_per_s=1280.0, grad_norm=2.0, loss_scale=None, skipped=False),
        dict(step=1, loss=None, lr=0.002, step_ms=11.0, samples_per_s=None, grad_norm=None, loss_scale=32768.0, skipped=True),
    ]
    log.write(**rows[0])
    assert len(read_log(path)) == 1  # flushed as each step ends
    log.write(**rows[1])
    log.close()
    assert read_log(path) == rows
    if name.endswith(".csv"):
        assert path.read_text().splitlines()[0] == ",".join(FIELDS)


def test_unknown_fields_are_refused(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "l.jsonl")
    with pytest.raises(ValueError, match="unknown log fields"):
        log.write(step=0, accuracy=1.0)
    log.close()
