"""Synthetic run reports from a known truth, for the calibration tests (torch-free).

A "truth" is the profile's layers scaled by known factors, links of a known latency and
bandwidth and a known fixed step overhead.  :func:`synthetic_report` runs a plan on that truth
with the planner's own schedule simulator and writes what ``pipeplan run --report`` would have
measured: per-stage times, every action's start on one clock, per-rank phases, the step time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost import Layout, allreduce_ms, estimate, reestimate, simulate_plan
from planner.schema import (
    Cluster,
    Interconnect,
    LayerProfile,
    MeasuredOn,
    Plan,
    Profile,
    RunReport,
    TrainingSetup,
)
from runtime.report import RankRecord, build_report

MiB = 2**20


def base_profile(layers: int = 8, *, sizes: tuple[int, ...] = (1, 2, 4), seed: int = 0) -> Profile:
    """A profile of ``layers`` similar layers (times and bytes proportional to the micro-batch)."""
    rng = random.Random(seed)
    out = []
    for i in range(layers):
        f = rng.uniform(2.0, 3.0)
        out.append(
            LayerProfile(
                name=f"l{i}",
                param_bytes=rng.randint(1, 4) * MiB,
                forward_ms=[f * b for b in sizes],
                backward_ms=[2 * f * b for b in sizes],
                activation_bytes=[MiB * b for b in sizes],
                output_bytes=[MiB // 4 * b for b in sizes],
            )
        )
    return Profile(
        model="synthetic",
        measured_on=MeasuredOn(device="cpu"),
        microbatch_sizes=list(sizes),
        input_bytes=[MiB // 8 * b for b in sizes],
        layers=out,
    )


def cpu_cluster(devices: int = 4) -> Cluster:
    return Cluster.model_validate({"devices": devices, "device_type": "cpu"})


def make_plan(
    profile: Profile,
    stages: Sequence[tuple[int, int]],
    *,
    schedule: str = "1f1b",
    microbatches: int = 4,
    microbatch_size: int = 2,
    data_parallel: int = 1,
    pipeline_degree: int | None = None,
    recompute: bool = False,
    devices: int = 4,
) -> Plan:
    """The plan (made with ``profile``'s predictions) that a run then executes."""
    training = TrainingSetup(global_batch_size=microbatch_size * microbatches * data_parallel, optimizer="sgd")
    return estimate(
        profile, cpu_cluster(devices), training,
        Layout(
            list(stages),
            num_microbatches=microbatches,
            schedule=schedule,
            data_parallel=data_parallel,
            pipeline_degree=pipeline_degree,
            recompute=recompute,
        ),
    )


@dataclass(frozen=True)
class Truth:
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    latency_s: float = 0.4e-3
    bandwidth: float = 2e8
    overhead_ms: float = 5.0

    def profile(self, base: Profile) -> Profile:
        layers = [
            layer.model_copy(
                update={
                    "forward_ms": [x * self.forward[i] for x in layer.forward_ms],
                    "backward_ms": [x * self.backward[i] for x in layer.backward_ms],
                }
            )
            for i, layer in enumerate(base.layers)
        ]
        return base.model_copy(update={"layers": layers})

    def cluster(self, cluster: Cluster) -> Cluster:
        link = Interconnect(bandwidth_bytes_per_s=self.bandwidth, latency_s=self.latency_s)
        return cluster.model_copy(update={"intra_node": link, "inter_node": link})

    def step_ms(self, plan: Plan, base: Profile) -> float:
        """What a run of ``plan`` measures per step."""
        return reestimate(plan, self.profile(base), cluster=self.cluster(plan.cluster)).predicted.step_time_ms + self.overhead_ms


def synthetic_report(
    plan: Plan, base: Profile, truth: Truth, *, steps: int = 4, noise: float = 0.0, level: float = 1.0, seed: int = 0
) -> RunReport:
    """What ``pipeplan run --report`` measures running ``plan`` where ``truth`` holds.

    ``level`` scales every compute time of this run (a busier machine); ``noise`` is the
    log-normal spread of each action's time.  Transfers wait exactly the truth's link time.
    """
    rng = random.Random(seed)
    true_profile = truth.profile(base)
    if level != 1.0:
        true_profile = Truth(tuple([level] * base.num_layers), tuple([level] * base.num_layers)).profile(true_profile)
    true_plan = reestimate(plan, true_profile, cluster=truth.cluster(plan.cluster))
    k, d_deg = plan.pipeline_degree, plan.data_parallel_degree
    sim = simulate_plan(true_plan)
    step_ms = true_plan.predicted.step_time_ms + truth.overhead_ms
    fwd: dict[int, list[list[float]]] = {s.index: [] for s in plan.stages}
    bwd: dict[int, list[list[float]]] = {s.index: [] for s in plan.stages}
    records = []
    grad_bytes = [sum(s.param_bytes for s in plan.stages if s.index % k == r) for r in range(k)]
    link = truth.cluster(plan.cluster).intra_node
    for d in range(d_deg):
        for r in range(k):
            rank = d * k + r
            events: dict[int, list[list[tuple[str, int, float, float]]]] = {s: [] for s in range(r, len(plan.stages), k)}
            phases = []
            for step in range(steps):
                t0 = 1000.0 * step  # seconds on the host clock (one clock: one host)
                rows: dict[int, list[tuple[str, int, float, float]]] = {s: [] for s in events}
                recompute_start: dict[tuple[int, int], float] = {}
                for e in sim.timelines[r]:
                    jitter = math.exp(rng.gauss(0, noise)) if noise else 1.0
                    start, end = e.start_ms, e.start_ms + (e.end_ms - e.start_ms) * jitter
                    if e.kind == "recompute":
                        recompute_start[(e.stage, e.microbatch)] = start
                    elif e.kind == "forward":
                        rows[e.stage].append(("F", e.microbatch, t0 + start / 1e3, t0 + end / 1e3))
                    elif e.kind == "backward":
                        start = recompute_start.get((e.stage, e.microbatch), start)
                        rows[e.stage].append(("B", e.microbatch, t0 + start / 1e3, t0 + end / 1e3))
                for s, row in rows.items():
                    events[s].append(row)
                    if d == 0:
                        fwd[s].append([])
                        bwd[s].append([])
                    fwd[s][step].extend((b - a) * 1e3 for op, _, a, b in row if op == "F")
                    bwd[s][step].extend((b - a) * 1e3 for op, _, a, b in row if op == "B")
                ar = allreduce_ms(grad_bytes[r], d_deg, link.bandwidth_bytes_per_s, link.latency_s)
                schedule = max((e.end_ms for e in sim.timelines[r]), default=0.0)
                phases.append([t0, schedule / 1e3, ar / 1e3, 0.0, max(0.0, step_ms - schedule - ar) / 1e3])
            records.append(
                RankRecord(
                    rank=rank,
                    replica=d,
                    host="node0",
                    stages=sorted(events),
                    allreduce_bytes=grad_bytes[r] if d_deg > 1 else 0,
                    phases=phases,
                    events=events,
                )
            )
    return build_report(
        plan,
        model="synthetic:truth",
        step_ms=[step_ms] * steps,
        losses=[1.0] * steps,
        stage_forward_ms=fwd,
        stage_backward_ms=bwd,
        peak_memory={},
        backend="gloo",
        device="cpu",
        optimizer="sgd",
        lr=0.1,
        seed=0,
        threads_per_rank=1,
        ranks=records,
    )


def holdout_error(calibrated: Profile, plan: Plan, base: Profile, truth: Truth) -> float:
    """|predicted / measured - 1| of ``plan`` with the calibrated profile."""
    from planner.calibrate import predict

    return abs(predict(plan, calibrated).predicted.step_time_ms / truth.step_ms(plan, base) - 1)
