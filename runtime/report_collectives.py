"""The run report's communication figures (torch-free): what a rank measures of its collectives
per step (:data:`COMM_KEYS`), their medians per axis (:func:`collective_times`) and the
``collectives per step:`` note (:func:`collectives_note`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from planner.schema import AxisTime, CollectiveTimes, Plan

#: what a rank measures of its communication in a step (ms; ``*_calls``: counts): DTensor's
#: redistributions, the data-parallel gradient reduction (all of it: the flat all-reduce after
#: the schedule and DDP's buckets during the last backwards; its part exposed after the
#: backward's last gradient, its part hidden behind the backward, DDP's buckets), the tied-weight
#: sums, FSDP2's all-gathers and reduce-scatters, and the pipeline's transfers (posting and
#: waiting for sends; waiting for receives)
COMM_KEYS = (
    "tensor_parallel_ms", "tensor_parallel_calls", "data_parallel_ms", "data_parallel_exposed_ms",
    "data_parallel_hidden_ms", "data_parallel_buckets", "tied_weights_ms",
    "fsdp_all_gather_ms", "fsdp_reduce_scatter_ms", "fsdp_calls",
    "transfer_send_ms", "transfer_receive_ms", "transfer_calls",
)  # fmt: skip


def collective_times(
    plan: Plan, rows: Sequence[Sequence[Mapping[str, float]]], *, warmup_steps: int = 1
) -> CollectiveTimes | None:
    """The report's ``collectives``: for each axis the plan has, per step the slowest rank's time
    (``rows[rank][step]``, keys of :data:`COMM_KEYS`), the median over the steps after
    ``warmup_steps`` (all steps when there are no others), beside the plan's prediction."""
    n = min((len(r) for r in rows), default=0)
    if n == 0:
        return None
    first = warmup_steps if n > warmup_steps else 0
    # rows without the exposed/hidden split (all of the reduction after the schedule): all exposed
    rows = [
        [{**x, "data_parallel_exposed_ms": x.get("data_parallel_exposed_ms", x.get("data_parallel_ms", 0.0))} for x in r]
        for r in rows
    ]

    def busiest(*keys: str) -> float:
        return float(
            statistics.median(max(sum(r[i].get(k, 0.0) for k in keys) for r in rows) for i in range(first, n))
        )

    def axis(parts: Mapping[str, str], predicted: float | None, calls: str | None = None) -> AxisTime:
        """``parts``: part name -> key; with several, each part is the slowest rank's (by the
        sum) at each step, then the median over the steps."""
        keys = list(parts.values())
        slowest = [max(rows, key=lambda r: sum(r[i].get(k, 0.0) for k in keys)) for i in range(first, n)]
        return AxisTime(
            measured_ms=busiest(*keys),
            predicted_ms=predicted,
            calls=round(busiest(calls)) if calls else None,
            parts_ms={
                name: float(statistics.median(r[i].get(key, 0.0) for r, i in zip(slowest, range(first, n), strict=True)))
                for name, key in parts.items()
            }
            if len(parts) > 1
            else {},
        )

    p = plan.predicted
    d, zero, k = plan.data_parallel_degree, plan.zero_stage, plan.pipeline_degree
    tied = busiest("tied_weights_ms")
    return CollectiveTimes(
        tensor_parallel=axis({"": "tensor_parallel_ms"}, p.tensor_parallel_ms, "tensor_parallel_calls")
        if plan.tensor_parallel_degree > 1
        else None,
        data_parallel=axis(
            {"exposed": "data_parallel_exposed_ms", "hidden": "data_parallel_hidden_ms"},
            p.allreduce_ms,
            "data_parallel_buckets",
        )
        if d > 1
        else None,
        fsdp=axis(
            {"all_gather": "fsdp_all_gather_ms", "reduce_scatter": "fsdp_reduce_scatter_ms"}, p.zero_ms, "fsdp_calls"
        )
        if zero >= 2 and d > 1
        else None,
        pipeline_transfers=axis(
            {"send": "transfer_send_ms", "receive": "transfer_receive_ms"}, p.pipeline_transfer_ms, "transfer_calls"
        )
        if k > 1
        else None,
        tied_weights=axis({"": "tied_weights_ms"}, None) if tied > 0.0 and k > 1 else None,
    )


def collectives_note(plan: Plan, times: CollectiveTimes | None) -> str:
    """The report's ``collectives per step:`` note: each axis measured beside predicted."""
    if times is None:
        return ""

    def pred(a: AxisTime, what: str = "") -> str:
        if a.predicted_ms is None:
            return "the plan predicts none (made before per-axis predictions: plan again to get one)"
        return f"predicted {a.predicted_ms:.2f} ms" + (f" ({what})" if what else "")

    parts = []
    if (a := times.tensor_parallel) is not None:
        parts.append(
            f"tensor-parallel collectives (DTensor's, inside the layers' forward and backward, counted in the "
            f"stage times): measured {a.measured_ms:.2f} ms in {a.calls} redistributions, "
            + pred(a, "every layer's all-reduces, every micro-batch")
        )
    if (a := times.data_parallel) is not None:
        fsdp = plan.zero_stage >= 2
        if a.calls:  # DDP's buckets: bucketed, during the stages' last backwards
            overlap = plan.training.gradient_overlap
            predicted = (
                f"; predicted {a.predicted_ms:.2f} ms, exposed {a.predicted_ms * (1 - overlap):.2f} ms (the plan's "
                f"gradient_overlap {overlap:g})"
                if a.predicted_ms is not None
                else "; " + pred(a)
            )
            parts.append(
                f"data-parallel gradient reduction (DDP, {a.calls} bucket(s) during the last backwards): measured "
                f"{a.measured_ms:.2f} ms, exposed {a.parts_ms.get('exposed', 0.0):.2f} ms after the backward's last "
                f"gradient, hidden {a.parts_ms.get('hidden', 0.0):.2f} ms behind the backward" + predicted
            )
        else:
            parts.append(
                "data-parallel flat all-reduce" + (" of what FSDP2 does not shard" if fsdp else "")
                + f": measured {a.measured_ms:.2f} ms, " + pred(a, "the collective after the step")
            )  # fmt: skip
    if (a := times.fsdp) is not None:
        parts.append(
            f"FSDP2 all-gathers and reduce-scatters (ZeRO {plan.zero_stage}, inside the schedule's forward and "
            f"backward): measured {a.measured_ms:.2f} ms in {a.calls} collectives (all-gathers "
            f"{a.parts_ms.get('all_gather', 0.0):.2f} ms, reduce-scatters "
            f"{a.parts_ms.get('reduce_scatter', 0.0):.2f} ms), "
            + pred(a, "each layer's, every micro-batch, before overlap")
        )
    if (a := times.pipeline_transfers) is not None:
        parts.append(
            f"pipeline transfers (activations and gradients between stages): measured {a.measured_ms:.2f} ms in "
            f"{a.calls} sends and receives (posting them and waiting on sends {a.parts_ms.get('send', 0.0):.2f} "
            f"ms, waiting on receives {a.parts_ms.get('receive', 0.0):.2f} ms; the waits include the peer's "
            "readiness: a receive waits for the peer's compute before it sends, a send may wait for the peer "
            "to post its receive), " + pred(a, "link time of the busiest rank's sends and receives")
        )
    if (a := times.tied_weights) is not None:
        parts.append(f"tied-weight sums between pipeline ranks: measured {a.measured_ms:.2f} ms")
    if not parts:
        return ""
    return (
        "collectives per step: " + "; ".join(parts)
        + "; measured: the slowest rank's time, median after the first step; predicted: the plan's busiest pipeline rank"
    )  # fmt: skip
