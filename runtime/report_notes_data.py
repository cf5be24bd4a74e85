"""The report's notes on the data-parallel gradients: which path reduced them
(:func:`data_parallel_note`, part of the mesh note) and when DDP's buckets of the last step ran
(:func:`bucket_note`).
"""

from __future__ import annotations

from typing import Any


def data_parallel_note(spec: Any, gathered: list[Any], *, context: int = 1) -> list[str]:
    """The mesh note's part on which path reduced the data-parallel gradients (empty for D = 1
    and ZeRO 2/3, whose note says FSDP2); ``context``: C, folded into the data axis."""
    meshes = [g["mesh"] for g in gathered]
    path = meshes[0].get("dp_path", "none")
    if path == "ddp":
        left: dict[str, int] = {}
        for m in (g["mesh"] for g in gathered if g["replica"] == 0 and g["tp_rank"] == 0 and g["cp_rank"] == 0):
            for why, n in m["dp_left"].items():
                left[why] = left.get(why, 0) + n
        tensors = sum(g["mesh"]["dp_ddp_tensors"] for g in gathered if g["replica"] == 0 and g["tp_rank"] == 0
                      and g["cp_rank"] == 0)  # fmt: skip
        n = spec.data_parallel_degree
        over = f"ranks of each stage's data axis (D x C = {n // context} x {context})" if context > 1 else "replicas of each stage"
        left_note = ", ".join(f"{k} tensor(s) {why}" for why, k in sorted(left.items()))
        return [
            f"data-parallel gradients: torch DDP over the {n} {over} ({tensors} tensor(s)), bucketed "
            f"({meshes[0]['dp_bucket_mb']:g} MiB buckets, built on the first step's gradient order: the first step "
            "reduces one bucket) and all-reduced during each stage's last micro-batch's backward"
            + (f"; left to the runtime's reductions after the schedule: {left_note}" if left else "")
        ]
    if path == "all-reduce":
        return [f"data-parallel gradients: the runtime's flat all-reduce after the schedule ({meshes[0]['dp_why']})"]
    return []


def bucket_note(gathered: list[Any]) -> str:
    """The report's note on the DDP buckets of each rank's last step: when each was launched and
    done, in ms from the start of the rank's last backward, beside that backward's end (the
    evidence that the reduction ran during the backward)."""
    parts = []
    for g in gathered:
        if g["tp_rank"] != 0 or g["cp_rank"] != 0:
            continue
        rec = g["mesh"].get("dp_last_buckets")
        if not rec:
            continue
        buckets = "; ".join(
            f"#{b['index']} [{', '.join(b['layers'])}] {b['bytes']} B launched {b['launched_ms']:.3f} done "
            f"{b['done_ms']:.3f}"
            for b in rec["buckets"]
        )
        parts.append(f"rank {g['rank']}: {buckets}; backward ended {rec['backward_ms']:.3f}")
    if not parts:
        return ""
    return (
        "data-parallel buckets of the last step (ms from the start of the rank's last backward; a bucket is "
        "launched when its last gradient is ready): " + " | ".join(parts)
    )
