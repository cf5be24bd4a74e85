"""``--inject-fault RANK:STEP:MODE``: make one rank fail or compute wrongly, for tests.

The worker's hidden flag: :class:`Fault` parses it; :func:`inject` stops the rank mid-step
(raise, exit, hang: the launcher's diagnosis, :mod:`runtime.faults`, must name it);
:func:`drop_gradient`, :func:`layer_to_skip` and :func:`corrupt_restore` make it compute or
resume wrongly (``--check`` must fail).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from planner.errors import InputError
from runtime.faults import RankStatus

#: --inject-fault modes (test-only): raise, exit and hang stop the rank mid-step (the launcher's
#: diagnosis); drop-grad zeroes the gradient of the rank's first parameter at that step, before
#: any reduction (a lost gradient); skip-layer skips, from that step on, the rank's first layer
#: whose outputs are shaped like its inputs (a wrong split); wrong-expert (E > 1) sends, from that
#: step on, the rank's tokens to the next rank's experts (runtime/experts.py); no-kv-gather (C > 1)
#: attends to the rank's own keys and values only (runtime/context_parallel.py); bad-restore
#: (--resume, STEP the checkpoint's) doubles the first moment (Adam's exp_avg, SGD's momentum
#: buffer) of the rank's first parameter that has one, as loaded (a wrong restore): --check must fail
FAULT_MODES = ("raise", "exit", "hang", "drop-grad", "skip-layer", "wrong-expert", "no-kv-gather", "bad-restore")


@dataclass(frozen=True)
class Fault:
    """``--inject-fault RANK:STEP:MODE`` (:data:`FAULT_MODES`), for tests."""

    rank: int
    step: int
    mode: str

    @staticmethod
    def parse(text: str) -> Fault:
        try:
            rank, step, mode = text.split(":")
            fault = Fault(int(rank), int(step), mode)
        except ValueError:
            raise InputError(f"--inject-fault {text!r}: write RANK:STEP:MODE, e.g. 1:1:raise") from None
        if fault.mode not in FAULT_MODES:
            raise InputError(f"--inject-fault mode {fault.mode!r}: choose one of {', '.join(FAULT_MODES)}")
        return fault


def layer_to_skip(plan: Any, my_stages: list[int], examples: Any, fault: Fault) -> int | None:
    """``--inject-fault R:S:skip-layer``: this rank's first layer whose outputs are shaped like
    its inputs, which :class:`runtime.modules.SkipFrom` will skip (a layer lost from step S on);
    None for the other modes."""
    if fault.mode != "skip-layer":
        return None

    def shapes(values: Any) -> list[Any]:
        return [(tuple(t.shape), t.dtype) for t in values]

    for s in my_stages:
        for u in range(plan.stages[s].start, plan.stages[s].stop):
            if shapes(examples[u][0]) == shapes(examples[u][1]):
                return u
    raise InputError(
        f"--inject-fault {fault.rank}:{fault.step}:skip-layer: rank {fault.rank} has no layer whose outputs "
        "are shaped like its inputs; inject it on another rank"
    )


def drop_gradient(params: list[Any]) -> None:
    """``--inject-fault R:S:drop-grad``: zero this rank's first gradient (a lost gradient)."""
    for p in params:
        if p.grad is not None:
            p.grad.zero_()
            return


def corrupt_restore(fault: Fault, first_step: int, named: list[tuple[str, Any]], optimizer: Any) -> str:
    """``--inject-fault R:S:bad-restore``: double the restored first moment of this rank's first
    parameter that has one (a checkpoint restored wrongly); returns that parameter's name."""
    if fault.step != first_step:
        raise InputError(
            f"--inject-fault {fault.rank}:{fault.step}:bad-restore: this run resumes at step {first_step}; "
            f"give {fault.rank}:{first_step}:bad-restore"
        )
    state = getattr(getattr(optimizer, "optim", optimizer), "state", {})
    for name, p in named:
        for key in ("exp_avg", "momentum_buffer"):
            moment = state.get(p, {}).get(key)
            if moment is not None:
                moment.mul_(2.0)
                return name
    raise InputError(f"--inject-fault {fault.rank}:{fault.step}:bad-restore: rank {fault.rank} restored no moment")


def inject(fault: Fault, status: RankStatus) -> None:
    """``--inject-fault R:S:raise|exit|hang``: stop this rank mid-step."""
    if fault.mode == "raise":
        raise RuntimeError(f"injected fault on rank {fault.rank} at step {fault.step}")
    if fault.mode == "exit":
        os._exit(17)
    time.sleep(10**6)  # hang
