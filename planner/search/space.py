"""The configuration space: which (D, K, M, schedule, v) the search visits, and on which devices.

A *configuration* (:class:`Config`) fixes the data-parallel degree D, the pipeline degree K,
the micro-batch count M (and so the micro-batch size), the schedule (gpipe, 1f1b,
interleaved-1f1b) and the chunks per device v.  :func:`enumerate_configs` lists every one the
options allow (and rejects contradictory options with an :class:`InputError` that names the
fix); :func:`fixed_ranges` reads user-fixed stage ranges.

The D x K devices of a configuration form K *groups* (:class:`Group`, :func:`make_groups`): the
D data-parallel replicas of one pipeline rank.  On heterogeneous clusters which group takes
which pipeline position is part of the search too: :func:`device_orders` lists the orders tried.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost.collectives import replica_link
from planner.cost.memory import usable_bytes
from planner.errors import InputError
from planner.schedules import ScheduleError, check_schedule_shape
from planner.schema import (
    SCHEDULE_CHUNKS,
    SCHEDULES,
    Cluster,
    Interconnect,
    PlanOptions,
    Profile,
    Schedule,
    TrainingSetup,
    check_coverage,
    recompute_count_problem,
)

#: largest number of chunks per device tried for interleaved-1f1b when v is free
MAX_VIRTUAL_STAGES = 4
#: micro-batch sizes beyond this multiple of the largest measured one are not tried (unless M is fixed)
MAX_EXTRAPOLATION = 2
#: configurations whose schedule has more actions (2 x M x stages) are not simulated
SIM_ACTION_LIMIT = 300_000


@dataclass(frozen=True, order=True)
class Config:
    """One point of the outer search: D, K, M, schedule, v (stage placement: the schedule's)."""

    data_parallel: int
    pipeline_degree: int
    num_microbatches: int
    schedule: Schedule
    virtual_stages: int = 1

    @property
    def num_stages(self) -> int:
        return self.pipeline_degree * self.virtual_stages

    @property
    def shape(self) -> tuple[Schedule, int, int, int]:
        """(schedule, K, M, v): what its compiled schedule depends on."""
        return (self.schedule, self.pipeline_degree, self.num_microbatches, self.virtual_stages)

    def microbatch_size(self, global_batch_size: int) -> int:
        return global_batch_size // (self.data_parallel * self.num_microbatches)

    def describe(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (
            f"D={self.data_parallel} K={self.pipeline_degree} M={self.num_microbatches} "
            f"{self.schedule}{v}"
        )


@dataclass(frozen=True)
class Group:
    """The D devices that hold one pipeline rank (its data-parallel replicas)."""

    devices: tuple[int, ...]
    speed: float
    limit_bytes: int
    link: Interconnect

    @property
    def kind(self) -> tuple[float, int]:
        return (self.speed, self.limit_bytes)




def make_groups(
    cluster: Cluster, training: TrainingSetup, data_parallel: int, pipeline_degree: int, *, default_layout: bool = False
) -> list[Group]:
    """The K device groups of a D x K mesh.

    Homogeneous clusters use :func:`planner.cost.default_devices` (replica d of rank k is
    device d·K + k).  Heterogeneous ones sort devices by speed, then memory (fastest and
    largest first), keep the first D·K and give each rank D consecutive ones, so a rank's
    replicas are alike; which rank takes which pipeline position is the solver's choice.
    ``default_layout`` keeps the homogeneous layout (what the baselines use).
    """
    k, d = pipeline_degree, data_parallel
    if cluster.homogeneous or default_layout:
        groups_devs = [tuple(r + j * k for j in range(d)) for r in range(k)]
    else:
        order = sorted(
            range(cluster.num_devices),
            key=lambda i: (-cluster.devices[i].speed, -cluster.devices[i].memory_bytes, i),
        )[: d * k]
        groups_devs = [tuple(sorted(order[r * d : (r + 1) * d])) for r in range(k)]
    out = []
    for devs in groups_devs:
        speed = min(cluster.devices[i].speed for i in devs)
        limit = min(usable_bytes(cluster.devices[i], training) for i in devs)
        out.append(Group(devs, speed, limit, replica_link(cluster, devs)))
    return out


def fixed_ranges(options: PlanOptions) -> list[tuple[int, int]] | None:
    if isinstance(options.stages, list):
        return [(r.start, r.stop) for r in options.stages]
    return None


def enumerate_configs(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions
) -> list[Config]:
    """Every (D, K, M, schedule, v) the options allow; :class:`InputError` if they contradict."""
    n, num_layers, g = cluster.num_devices, profile.num_layers, training.global_batch_size
    ranges = fixed_ranges(options)
    if ranges is not None:
        try:
            check_coverage(ranges, num_layers)
        except ValueError as err:
            raise InputError(f"invalid --stages: {err}") from None
    v_opt = options.virtual_stages
    if v_opt is not None and options.schedule is not None:
        chunks = SCHEDULE_CHUNKS[options.schedule]
        if (chunks == "1" and v_opt != 1) or (chunks == "2" and v_opt != 2):
            runs = "one stage" if chunks == "1" else "two stages"
            raise InputError(
                f"virtual_stages={v_opt} does not suit schedule {options.schedule!r}, which runs {runs} per "
                "device: drop the virtual stages, or choose interleaved-1f1b or interleaved-zb (any number), "
                "zbv or dualpipev (two)"
            )
    if isinstance(options.stages, int):
        k = options.stages
        if k > n:
            raise InputError(
                f"stages={k} needs {k} devices but the cluster has {n}: use --stages {n} or fewer, "
                "or add devices"
            )
        if k > num_layers:
            raise InputError(
                f"stages={k} but the model has only {num_layers} layers: use --stages {num_layers} or fewer"
            )
    if options.data_parallel is not None:
        d = options.data_parallel
        if d > n:
            raise InputError(f"data_parallel={d} exceeds the {n} devices: use --data-parallel {n} or less")
        if g % d:
            raise InputError(
                f"data_parallel={d} does not divide the global batch {g}: choose one of {_divisors(g)[:12]}"
            )
    if options.num_microbatches is not None:
        m = options.num_microbatches
        ds = [options.data_parallel] if options.data_parallel else _divisors(g)
        if not any(g % (d * m) == 0 for d in ds):
            raise InputError(
                f"num_microbatches={m} does not split the global batch {g}"
                + (f" over data_parallel={options.data_parallel}" if options.data_parallel else "")
                + f": choose M dividing {g // (options.data_parallel or 1)}, e.g. "
                f"{_divisors(g // (options.data_parallel or 1))[:10]}"
            )
    problem = recompute_count_problem(options)  # (options changed by model_copy are not validated again)
    if problem:
        raise InputError(problem)
    # micro-batches larger than twice the largest measured size would be extrapolated far
    max_b = MAX_EXTRAPOLATION * profile.microbatch_sizes[-1]
    schedules: tuple[Schedule, ...] = (options.schedule,) if options.schedule else SCHEDULES
    if options.schedules is not None and options.schedule is None:
        schedules = tuple(x for x in SCHEDULES if x in options.schedules)
    if v_opt is not None and v_opt > 1:
        schedules = tuple(x for x in schedules if SCHEDULE_CHUNKS[x] == "n" or (SCHEDULE_CHUNKS[x] == "2" and v_opt == 2))
    out: list[Config] = []
    refused: str | None = None  # why a fixed schedule's shape cannot run, for the error
    for d in ([options.data_parallel] if options.data_parallel else _divisors(g)):
        if d > n:
            continue
        for sched in schedules:
            for k, v in _pipeline_shapes(options, sched, n // d, num_layers, ranges):
                if k * d > n:
                    continue
                ms = [options.num_microbatches] if options.num_microbatches else [
                    x for x in _divisors(g // d) if g // (d * x) <= max_b
                ]
                for m in ms:
                    if g % (d * m):
                        continue
                    if SCHEDULE_CHUNKS[sched] == "n" and k < 2:
                        continue  # interleaving needs K >= 2 ranks
                    try:
                        check_schedule_shape(sched, k, m, v)  # M >= K for 1F1B, M % K, M >= 2K, ...
                    except ScheduleError as err:
                        refused = refused or str(err)
                        continue
                    if k == 1 and options.schedule is None and sched != "1f1b" and "1f1b" in schedules:
                        continue  # one stage: no pipeline, 1f1b keeps the least in flight
                    out.append(Config(d, k, m, sched, v))
    if not out:
        if options.schedule is not None and refused is not None:
            raise InputError(f"schedule {options.schedule!r} cannot run with these options: {refused}")
        raise InputError(_no_config_message(options, n, num_layers, g))
    return sorted(set(out))


def _pipeline_shapes(
    options: PlanOptions, sched: Schedule, max_k: int, num_layers: int, ranges: list[tuple[int, int]] | None
) -> list[tuple[int, int]]:
    """(K, v) pairs for a schedule."""
    v_opt = options.virtual_stages
    rc_len = len(options.recompute) if isinstance(options.recompute, list) else None
    shapes = []
    chunks = SCHEDULE_CHUNKS[sched]
    if chunks == "1":
        if v_opt not in (None, 1):
            return []
        if ranges is not None:
            return [(len(ranges), 1)]
        ks = [options.stages] if isinstance(options.stages, int) else range(1, min(max_k, num_layers) + 1)
        return [(k, 1) for k in ks if rc_len is None or rc_len == k]
    if chunks == "2":
        vs = [2] if v_opt in (None, 2) else []
    else:
        vs = [v_opt] if v_opt else list(range(2, MAX_VIRTUAL_STAGES + 1))
    for v in vs:
        if ranges is not None:
            if len(ranges) % v == 0:
                shapes.append((len(ranges) // v, v))
            continue
        ks = [options.stages] if isinstance(options.stages, int) else range(2, min(max_k, num_layers // v) + 1)
        for k in ks:
            if k * v <= num_layers and (rc_len is None or rc_len == k * v):
                shapes.append((k, v))
    return shapes


def _divisors(x: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(x) + 1) if x % i == 0]
    return sorted(set(small + [x // i for i in small]))


def _no_config_message(options: PlanOptions, n: int, num_layers: int, g: int) -> str:
    fixed = {k: v for k, v in options.model_dump().items() if v is not None and k != "time_limit_s"}
    hint = "relax one of them"
    if options.schedule is not None and SCHEDULE_CHUNKS[options.schedule] != "1":
        hint = (
            f"{options.schedule} needs K >= 2 devices per pipeline and at least "
            f"{'2' if SCHEDULE_CHUNKS[options.schedule] == '2' else '2 (or --virtual-stages)'} chunks of "
            "layers per device: relax --microbatches or --stages, or choose 1f1b"
        )
    return (
        f"no configuration satisfies the options {fixed} on {n} devices, {num_layers} layers and "
        f"global batch {g}: {hint}"
    )


def device_orders(groups: Sequence[Group]) -> list[tuple[int, ...]]:
    """Device-group orders to try for the pipeline positions (heterogeneous clusters)."""
    k = len(groups)
    base = tuple(range(k))
    if len({g.kind for g in groups}) == 1:
        return [base]
    by_speed = tuple(sorted(base, key=lambda i: (-groups[i].speed, -groups[i].limit_bytes, i)))
    by_memory = tuple(sorted(base, key=lambda i: (-groups[i].limit_bytes, -groups[i].speed, i)))
    orders = [by_speed, tuple(reversed(by_speed)), by_memory, tuple(reversed(by_memory))]
    # alternate kinds (slow devices spread out)
    kinds = sorted({g.kind for g in groups}, reverse=True)
    buckets = [[i for i in by_speed if groups[i].kind == kd] for kd in kinds]
    mixed = []
    while any(buckets):
        for bucket in buckets:
            if bucket:
                mixed.append(bucket.pop(0))
    orders.append(tuple(mixed))
    distinct_perms = distinct_orders(groups, limit=24)
    return list(dict.fromkeys(orders + distinct_perms))


def distinct_orders(groups: Sequence[Group], *, limit: int) -> list[tuple[int, ...]]:
    """All orders that differ in the kinds of device at each position, if there are few."""
    kinds = [g.kind for g in groups]
    count = math.factorial(len(kinds))
    for kd in set(kinds):
        count //= math.factorial(kinds.count(kd))
    if count > limit:
        return []
    seen: dict[tuple[tuple[float, int], ...], tuple[int, ...]] = {}
    for perm in itertools.permutations(range(len(groups))):
        key = tuple(kinds[i] for i in perm)
        seen.setdefault(key, perm)
    return sorted(seen.values())
