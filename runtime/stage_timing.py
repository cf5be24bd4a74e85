"""Where a step's time went: each stage's actions, the loss, DDP's buckets, the collectives.

:func:`time_stage` wraps a ``PipelineStage``'s forward, backward and weight-gradient calls so
that every action is timed per micro-batch (the report's stage times and timeline, and the
calibration's); :func:`fold_loss` counts the loss in the last stage's forward, as the profile
does; :func:`last_backward` and :func:`bucket_rows` place DDP's buckets against the rank's last
backward; :func:`comm_step` turns the collective clocks (``runtime/_comm_timing.py``,
``runtime/_dtensor_timing.py``) into one step's communication.
"""

from __future__ import annotations

import time
from typing import Any

from runtime.fault_injection import Fault, inject
from runtime.faults import RankStatus

#: per stage of this rank: "forward", "backward" (ms per micro-batch, per step) and "events"
#: ((op, micro-batch, start, end) per step)
Timings = dict[int, dict[str, list[list[Any]]]]


def sync(device: Any) -> None:
    """Wait for the device (CUDA) so that the host's clock times its work."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def time_stage(
    stage: Any,
    record: dict[str, list[list[Any]]],
    step_box: list[int],
    device: Any,
    fault: Fault | None,
    status: RankStatus,
    streams: Any = None,
) -> None:
    """Time this stage's actions per micro-batch (and inject a fault when asked); tell the RNG
    streams which micro-batch a forward runs.  ``record["events"][step]`` keeps each action as
    ``(op, micro-batch, start, end)`` on ``time.perf_counter``'s clock, ``op`` one of ``F``,
    ``B``, ``I`` (input gradient) and ``W`` (weight gradient); ``record["backward"][step]``
    has one backward time per micro-batch, ``I + W`` for a split backward."""
    forward, backward, weight = (
        stage.forward_one_chunk,
        stage.backward_one_chunk,
        stage.backward_weight_one_chunk,
    )
    calls = [0]
    #: (step, micro-batch) -> index of its backward time, where its W adds to its I
    slot_of: dict[tuple[int, int], int] = {}

    def _slot(kind: str) -> list[Any]:
        rows = record[kind]
        while len(rows) <= step_box[0]:
            rows.append([])
        return rows[step_box[0]]

    def timed_forward(*a: Any, **kw: Any) -> Any:
        if streams is not None:
            streams.microbatch = int(a[0] if a else kw["fwd_chunk_id"])
        if fault is not None and step_box[0] == fault.step:
            calls[0] += 1
            if calls[0] == 2:  # mid-step: after one micro-batch went through
                inject(fault, status)
        sync(device)
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        sync(device)
        t1 = time.perf_counter()
        _slot("forward").append((t1 - t0) * 1e3)
        _slot("events").append(("F", int(a[0] if a else kw["fwd_chunk_id"]), t0, t1))
        return out

    def timed_backward(*a: Any, **kw: Any) -> Any:
        mb = int(a[0] if a else kw["bwd_chunk_id"])
        op = "B" if kw.get("full_backward", True) else "I"
        sync(device)
        t0 = time.perf_counter()
        out = backward(*a, **kw)
        sync(device)
        t1 = time.perf_counter()
        rows = _slot("backward")
        slot_of[(step_box[0], mb)] = len(rows)
        rows.append((t1 - t0) * 1e3)
        _slot("events").append((op, mb, t0, t1))
        return out

    def timed_weight(*a: Any, **kw: Any) -> Any:
        mb = int(a[0] if a else kw["bwd_chunk_id"])
        sync(device)
        t0 = time.perf_counter()
        out = weight(*a, **kw)
        sync(device)
        t1 = time.perf_counter()
        index = slot_of.pop((step_box[0], mb), None)
        if index is not None:
            _slot("backward")[index] += (t1 - t0) * 1e3
        _slot("events").append(("W", mb, t0, t1))
        return out

    stage.forward_one_chunk = timed_forward
    stage.backward_one_chunk = timed_backward
    stage.backward_weight_one_chunk = timed_weight


def fold_loss(record: dict[str, list[list[Any]]], step: int, t0: float, t1: float) -> None:
    """Count the loss, computed by the schedule right after the last stage's forward, in that
    forward (duration and end), as the profile counts it in the last layer's."""
    if step < len(record["events"]) and record["events"][step]:
        op, mb, start, _ = record["events"][step][-1]
        record["events"][step][-1] = (op, mb, start, t1)
        record["forward"][step][-1] += (t1 - t0) * 1e3


def last_backward(timings: Timings, step: int) -> tuple[float, float] | None:
    """``(start, end)`` of this rank's last backward action (``B`` or ``W``) of ``step``."""
    last = None
    for record in timings.values():
        events = record["events"][step] if step < len(record["events"]) else []
        for op, _, t0, t1 in events:
            if op in ("B", "W") and (last is None or t1 > last[1]):
                last = (t0, t1)
    return last


def bucket_rows(events: list[Any], backward: tuple[float, float] | None) -> dict[str, Any] | None:
    """The report's record of one step's DDP buckets (``runtime._ddp.BucketEvent``), times in ms
    from the start of the rank's last backward (``backward``): when each bucket was launched
    (its last gradient ready) and done, and when that backward ended."""
    if not events or backward is None:
        return None
    t0, t1 = backward
    rows = []
    for e in sorted(events, key=lambda e: e.launched):
        rows.append({
            "index": e.index,
            "layers": list(dict.fromkeys(e.names)),
            "bytes": e.nbytes,
            "launched_ms": (e.launched - t0) * 1e3,
            "done_ms": ((e.done if e.done is not None else e.launched) - t0) * 1e3,
        })  # fmt: skip
    return {"backward_ms": (t1 - t0) * 1e3, "buckets": rows}


def comm_step(before: tuple[Any, Any, Any], after: tuple[Any, Any, Any]) -> dict[str, float]:
    """One step's communication inside the schedule, from the clocks before and after it
    (:data:`runtime.report.COMM_KEYS`; the report's ``collectives per step:`` note and
    ``collectives`` field are made from every rank's, :func:`runtime.report.collective_times`)."""
    (tp0, fs0, tr0), (tp1, fs1, tr1) = before, after
    return {
        "tensor_parallel_ms": (tp1.seconds - tp0.seconds) * 1e3,
        "tensor_parallel_calls": tp1.calls - tp0.calls,
        "fsdp_all_gather_ms": (fs1.all_gather_s - fs0.all_gather_s) * 1e3,
        "fsdp_reduce_scatter_ms": (fs1.reduce_scatter_s - fs0.reduce_scatter_s) * 1e3,
        "fsdp_calls": fs1.all_gathers + fs1.reduce_scatters - fs0.all_gathers - fs0.reduce_scatters,
        "transfer_send_ms": (tr1.post_s + tr1.send_wait_s - tr0.post_s - tr0.send_wait_s) * 1e3,
        "transfer_receive_ms": (tr1.recv_wait_s - tr0.recv_wait_s) * 1e3,
        "transfer_calls": tr1.posted - tr0.posted,
    }
