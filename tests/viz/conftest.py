"""Plans for the chart tests, built in code from the bundled tiny profile."""

from __future__ import annotations

import pytest

from planner.cost import Layout, estimate
from planner.schema import Cluster, Plan, Profile, TrainingSetup

#: (schedule, stage ranges, recompute per stage, data-parallel degree, pipeline degree)
CASES = {
    "gpipe": ("gpipe", [(0, 2), (2, 4), (4, 6), (6, 8)], [True, False, False, False], 1, 4),
    "1f1b": ("1f1b", [(0, 3), (3, 8)], [False, True], 2, 2),
    "interleaved-1f1b": ("interleaved-1f1b", [(i, i + 1) for i in range(8)], [False] * 8, 1, 4),
    "zb-h1": ("zb-h1", [(0, 2), (2, 4), (4, 6), (6, 8)], [False, False, True, False], 1, 4),
    "zbv": ("zbv", [(i, i + 1) for i in range(8)], [False] * 8, 1, 4),
    "planned": ("planned", [(0, 3), (3, 8)], [False, True], 2, 2),
}


def make_plan(profile: Profile, case: str, *, memory: str = "1GiB", microbatches: int = 4) -> Plan:
    schedule, stages, recompute, dp, k = CASES[case]
    return estimate(
        profile, Cluster.model_validate({"devices": 4, "memory": memory}), TrainingSetup(global_batch_size=8 * dp),
        Layout(
            stages,
            num_microbatches=microbatches,
            schedule=schedule,
            recompute=recompute,
            data_parallel=dp,
            pipeline_degree=k,
        ),
    )


@pytest.fixture(params=sorted(CASES))
def any_plan(request: pytest.FixtureRequest, tiny_profile: Profile) -> Plan:
    return make_plan(tiny_profile, request.param)
