"""The worker's watchdog: a daemon thread that ends the rank when its main thread makes no
progress (a hang no peer would see), after writing why to the rank's status file."""

from __future__ import annotations

import os
import sys
import threading
import time

from runtime.faults import RankStatus, write_status
from runtime.rank_state import Progress

#: exit code of a rank whose watchdog saw it make no progress
EXIT_HUNG = 124


def start_watchdog(progress: Progress, status: RankStatus, run_dir: str | None, timeout_s: float) -> None:
    """Watch ``progress`` from a daemon thread (:func:`watchdog`) until ``progress.done``."""
    threading.Thread(
        target=watchdog, args=(progress, status, run_dir, timeout_s), daemon=True, name="pipeplan-watchdog"
    ).start()


def watchdog(progress: Progress, status: RankStatus, run_dir: str | None, timeout_s: float) -> None:
    """End this process if the main thread makes no progress (a hang no peer would see).

    The limit is 2 x the collective timeout during training (peers normally notice first)
    and max(4 x timeout, 300 s) during start-up (imports and model building can be slow).
    """
    while not progress.done:
        limit_s = 2 * timeout_s if progress.training else max(4 * timeout_s, 300.0)
        time.sleep(min(1.0, limit_s / 4))
        idle = time.monotonic() - progress.beat
        if idle > limit_s and not progress.done:
            status.state = "hung"
            status.error = f"no progress for {idle:.0f} s (watchdog limit {limit_s:g} s, see --timeout)"
            write_status(run_dir, status)
            print(f"[rank{status.rank}] error: {status.error} during {status.where()}", file=sys.stderr, flush=True)
            os._exit(EXIT_HUNG)
