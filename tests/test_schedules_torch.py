"""Our templates are torch.distributed.pipelining's own orders, action for action.

For every schedule with a torch class (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) the per-rank compute actions torch 2.13 computes
(its ``_calculate_single_rank_operations``, idle steps dropped, an overlapped forward+backward
pair as its two actions in turn) equal :func:`planner.schedules.schedule_actions`, so the
runtime may run the class or load our list.  This reads private torch attributes: if torch
changes them the test fails here, naming what moved.
"""

from __future__ import annotations

import pytest

from planner.schedules import Action, ScheduleError, check_schedule_shape, schedule_actions

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

CLASSES = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def torch_orders(cls_name: str, k: int, m: int, v: int) -> list[list[Action]]:
    cls = getattr(schedules, cls_name)
    obj = object.__new__(cls)
    # the attributes torch's constructors set before computing the order
    obj.pp_group_size = k
    obj.n_local_stages = v
    obj._n_microbatches = m
    obj.num_stages = obj._num_stages = k * v
    obj.number_of_rounds = max(1, m // k)
    obj.microbatches_per_round = m // obj.number_of_rounds
    out = []
    for r in range(k):
        obj.rank = r
        acts = []
        for a in obj._calculate_single_rank_operations(r):
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                acts.append(Action(sub.stage_index, sub.computation_type.value, sub.microbatch_index))
        out.append(acts)
    return out


@pytest.mark.parametrize("schedule", sorted(CLASSES))
def test_templates_match_torch(schedule: str) -> None:
    compared = 0
    for k in range(1, 7):
        for m in range(1, 17):
            for v in (1, 2, 3):
                try:
                    check_schedule_shape(schedule, k, m, v)  # type: ignore[arg-type]
                except ScheduleError:
                    continue
                if schedule == "zb-h1" and m % max(1, m // k):
                    continue  # torch's class refuses these M (our one-stage list has no rounds)
                ours = schedule_actions(schedule, k, m, v)  # type: ignore[arg-type]
                assert ours == torch_orders(CLASSES[schedule], k, m, v), (schedule, k, m, v)
                compared += 1
    assert compared >= 10


def test_our_csv_is_what_torch_loads_and_validates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``pipeplan show --actions`` writes torch's compute-only CSV: every cell parses with
    ``_Action.from_str``, and ``_validate_schedule`` accepts the lists and maps each stage to
    the rank our placement gives (loop, V), for every schedule, planned included."""
    import csv

    from planner.cost import Layout, estimate, plan_orders
    from planner.schedules import placement_of, stage_rank, to_csv
    from planner.schema import SCHEDULES, TrainingSetup
    from tests.planner.helpers import cluster, random_profile

    profile = random_profile(3, 8, split_backward=True)
    training = TrainingSetup(global_batch_size=16)
    for schedule in SCHEDULES:
        v = {"zbv": 2, "dualpipev": 2, "interleaved-1f1b": 2, "interleaved-zb": 2}.get(schedule, 1)
        k, m = 2, 8
        n = k * v
        bounds = [round(i * 8 / n) for i in range(n + 1)]
        plan = estimate(
            profile, cluster(k, "4GiB"), training,
            Layout(
                [(bounds[i], bounds[i + 1]) for i in range(n)],
                num_microbatches=m,
                schedule=schedule,
                pipeline_degree=k,
            ),
        )
        path = tmp_path / f"{schedule}.csv"
        path.write_text(to_csv(plan_orders(plan)))
        with open(path, newline="") as f:
            actions = {r: [schedules._Action.from_str(cell) for cell in row] for r, row in enumerate(csv.reader(f))}
        mapping = schedules._validate_schedule(actions, k, n, m)
        assert mapping == {s: stage_rank(placement_of(schedule), s, k, v) for s in range(n)}, schedule  # type: ignore[arg-type]
