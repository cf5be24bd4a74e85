"""The cost model: interpolation, time, memory and validation of a given plan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costmodel import (
    allreduce_ms,
    estimate,
    interpolate,
    layer_costs,
    lower_bound_ms,
    plan_fits,
    simulate_plan,
    static_bytes,
)
from planner.errors import InputError
from planner.schema import Cluster, LayerProfile, MeasuredOn, Profile, TrainingSetup


def uniform_profile(n: int, *, f: float = 1.0, b: float = 2.0, act: int = 1000, out: int = 100, params: int = 10_000) -> Profile:
    """n identical layers measured at micro-batch sizes 1 and 2 (costs linear through zero)."""
    return Profile(
        model="uniform",
        measured_on=MeasuredOn(device="cpu"),
        microbatch_sizes=[1, 2],
        layers=[
            LayerProfile(
                name=f"l{i}",
                param_bytes=params,
                forward_ms=[f, 2 * f],
                backward_ms=[b, 2 * b],
                activation_bytes=[act, 2 * act],
                output_bytes=[out, 2 * out],
            )
            for i in range(n)
        ],
    )


def cluster(n: int, *, memory: str = "1GiB", per_node: int | None = None, bw: float = 1e9, lat: float = 0.0) -> Cluster:
    link = {"bandwidth_bytes_per_s": bw, "latency_s": lat}
    return Cluster.model_validate(
        {"devices": n, "memory": memory, "devices_per_node": per_node or n, "intra_node": link, "inter_node": link}
    )


def test_interpolate() -> None:
    sizes, values = [2, 4, 8], [10.0, 14.0, 26.0]  # physical: read as measured, linear between
    assert interpolate(sizes, values, 4) == 14.0
    assert interpolate(sizes, values, 3) == 12.0  # between two measured sizes
    assert interpolate(sizes, values, 16) == 50.0  # beyond: along the last segment
    assert interpolate(sizes, values, 1) == 8.0  # below: along the first segment
    assert interpolate([4], [8.0], 2) == 4.0  # one size: in proportion
    # noise (size 2 measured faster than size 1) is fitted, never extrapolated to zero
    assert interpolate([1, 2], [5.0, 1.0], 10) == 3.0


def test_uniform_step_time_matches_closed_form() -> None:
    k, m = 4, 8
    p = uniform_profile(8)
    # 100 bytes per sample crossing each cut at 1e9 B/s + 1 ms latency
    c = cluster(k, bw=1e9, lat=1e-3)
    train = TrainingSetup(global_batch_size=m, optimizer="sgd")
    plan = estimate(p, c, train, [(0, 2), (2, 4), (4, 6), (6, 8)], num_microbatches=m, schedule="gpipe")
    f, b = 2.0, 4.0  # two layers per stage, micro-batch size 1
    xfer = (100 / 1e9 + 1e-3) * 1e3
    assert plan.stages[0].send_ms == pytest.approx(xfer)
    assert plan.predicted.step_time_ms == pytest.approx((m + k - 1) * (f + b) + 2 * (k - 1) * xfer)
    assert plan.microbatch_size == 1
    assert simulate_plan(plan).makespan_ms == pytest.approx(plan.predicted.step_time_ms)


def test_speed_scales_time() -> None:
    p = uniform_profile(4)
    fast = estimate(p, cluster(2), TrainingSetup(global_batch_size=4), [(0, 2), (2, 4)], num_microbatches=4)
    slow_cluster = Cluster.model_validate(
        {"devices": [{"memory_bytes": "1GiB", "speed": 0.5}] * 2, "intra_node": "pcie4", "inter_node": "ib-hdr"}
    )
    slow = estimate(p, slow_cluster, TrainingSetup(global_batch_size=4), [(0, 2), (2, 4)], num_microbatches=4)
    assert slow.stages[0].forward_ms == pytest.approx(2 * fast.stages[0].forward_ms)
    assert slow.predicted.lower_bound_ms == pytest.approx(2 * fast.predicted.lower_bound_ms)


def test_inter_node_links_cost_more() -> None:
    p = uniform_profile(4, out=10**6)
    c = Cluster.model_validate(
        {
            "devices": 2,
            "memory": "1GiB",
            "devices_per_node": 1,
            "intra_node": {"bandwidth_bytes_per_s": 1e11},
            "inter_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5},
        }
    )
    plan = estimate(p, c, TrainingSetup(global_batch_size=2), [(0, 2), (2, 4)], num_microbatches=2)
    assert plan.stages[0].send_ms == pytest.approx((10**6 / 1e9 + 1e-5) * 1e3)


def test_memory_per_schedule_and_recompute() -> None:
    params, act, out = 10_000, 1000, 100
    p = uniform_profile(8, act=act, out=out, params=params)
    train = TrainingSetup(global_batch_size=8, optimizer="adam", memory_margin=0.0)
    ranges = [(0, 2), (2, 4), (4, 6), (6, 8)]
    static = static_bytes(2 * params, train)
    assert static == 2 * params * (1 + 1 + 2)
    g = estimate(p, cluster(4), train, ranges, num_microbatches=8, schedule="gpipe")
    assert [s.memory_bytes for s in g.stages] == [static + 8 * 2 * act] * 4
    o = estimate(p, cluster(4), train, ranges, num_microbatches=8, schedule="1f1b")
    assert [s.memory_bytes for s in o.stages] == [static + (4 - k) * 2 * act for k in range(4)]
    r = estimate(p, cluster(4), train, ranges, num_microbatches=8, schedule="gpipe", recompute=True)
    # stage 0 keeps the model input (0 bytes here); others keep the cut (100 B per sample)
    assert r.stages[0].memory_bytes == static + 2 * act
    assert r.stages[1].memory_bytes == static + 8 * out + 2 * act
    # recompute adds one forward to the backward
    assert r.stages[1].backward_ms == pytest.approx(o.stages[1].backward_ms + o.stages[1].forward_ms)


def test_memory_margin_and_fit() -> None:
    p = uniform_profile(2, params=400 * 2**20)
    c = cluster(2, memory="3GiB")
    tight = TrainingSetup(global_batch_size=2, optimizer="adam", memory_margin=0.1)
    plan = estimate(p, c, tight, [(0, 1), (1, 2)], num_microbatches=2)
    assert plan.stages[0].memory_limit_bytes == int(3 * 2**30 * 0.9)
    assert plan_fits(plan)  # 1.56 GiB of weights, gradients and Adam state fit 2.7 GiB
    one = estimate(p, cluster(1, memory="3GiB"), tight, [(0, 2)], num_microbatches=2)
    assert not plan_fits(one)  # 3.125 GiB do not


def test_data_parallel_allreduce() -> None:
    params = 10**6
    p = uniform_profile(4, params=params)
    c = cluster(4, bw=1e9, lat=0.0)
    train = TrainingSetup(global_batch_size=8, optimizer="sgd")
    plan = estimate(p, c, train, [(0, 2), (2, 4)], num_microbatches=2, data_parallel=2)
    assert plan.data_parallel_degree == 2 and plan.microbatch_size == 2
    assert [s.devices for s in plan.stages] == [[0, 2], [1, 3]]
    ar = allreduce_ms(2 * params, 2, 1e9, 0.0)
    assert ar == pytest.approx(2 * 1 / 2 * 2 * params / 1e9 * 1e3)
    assert plan.predicted.allreduce_ms == pytest.approx(ar)
    no_dp = estimate(p, c, TrainingSetup(global_batch_size=4, optimizer="sgd"), [(0, 2), (2, 4)], num_microbatches=2)
    assert plan.predicted.step_time_ms == pytest.approx(no_dp.predicted.step_time_ms + ar)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"stages": [(0, 2), (3, 4)]}, "leaves layers 2:3"),
        ({"num_microbatches": 3}, "does not split into 1 replica(s) x 3 micro-batches"),
        ({"data_parallel": 2, "stages": [(0, 1), (1, 2), (2, 4)]}, "needs pipeline degree 3 x data-parallel degree 2"),
        ({"recompute": [True]}, "recompute has 1 entries for 2 stages"),
        ({"schedule": "interleaved-1f1b", "pipeline_degree": 2, "num_microbatches": 2, "stages": [(0, 1), (1, 2), (2, 3), (3, 4)]}, None),
        ({"schedule": "interleaved-1f1b", "pipeline_degree": 2, "num_microbatches": 3, "stages": [(0, 1), (1, 2), (2, 3), (3, 4)]}, "multiple of the pipeline degree"),
        ({"devices": [[0], [0]]}, "given to two pipeline ranks"),
        ({"devices": [[0], [9]]}, "placed on device 9"),
    ],
)
def test_estimate_validation(kwargs: dict, fragment: str | None) -> None:
    p = uniform_profile(4)
    args = {"stages": [(0, 2), (2, 4)], "num_microbatches": 2}
    args.update(kwargs)
    stages = args.pop("stages")
    train = TrainingSetup(global_batch_size=6 if args.get("num_microbatches") == 3 else 4)
    if fragment is None:
        plan = estimate(p, cluster(4), train, stages, **args)
        assert plan.virtual_stages == 2 and plan.pipeline_degree == 2
        return
    with pytest.raises(InputError) as info:
        estimate(p, cluster(4), TrainingSetup(global_batch_size=4) if "split" in fragment else train, stages, **args)
    assert fragment in str(info.value)


def test_lower_bound_is_a_bound() -> None:
    p = uniform_profile(8)
    c = cluster(4)
    train = TrainingSetup(global_batch_size=16)
    lb = lower_bound_ms(p, c, train)
    assert lb == pytest.approx(16 * 8 * 3.0 / 4)
    plan = estimate(p, c, train, [(0, 2), (2, 4), (4, 6), (6, 8)], num_microbatches=16)
    assert plan.predicted.step_time_ms >= lb


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.1, 5.0), min_size=2, max_size=10),
    st.integers(1, 4),
    st.sampled_from(["gpipe", "1f1b"]),
)
def test_step_time_bounds(times: list[float], k: int, schedule: str) -> None:
    """Any plan: step >= the busiest stage's total work and >= the lower bound; bubble in [0, 1)."""
    n = len(times)
    k = min(k, n)
    p = Profile(
        model="random",
        measured_on=MeasuredOn(device="cpu"),
        microbatch_sizes=[1],
        layers=[
            LayerProfile(name=f"l{i}", param_bytes=1, forward_ms=[t], backward_ms=[2 * t], activation_bytes=[1], output_bytes=[1])
            for i, t in enumerate(times)
        ],
    )
    cuts = [round(i * n / k) for i in range(k + 1)]
    ranges = [(cuts[i], cuts[i + 1]) for i in range(k)]
    m = 4
    plan = estimate(p, cluster(k), TrainingSetup(global_batch_size=m), ranges, num_microbatches=m, schedule=schedule)  # type: ignore[arg-type]
    busiest = max((s.forward_ms + s.backward_ms) * m for s in plan.stages)
    assert plan.predicted.step_time_ms >= busiest - 1e-9
    assert plan.predicted.step_time_ms >= plan.predicted.lower_bound_ms - 1e-9
    assert 0 <= plan.predicted.bubble_fraction < 1
    costs = layer_costs(p, 1)
    assert sum(s.forward_ms for s in plan.stages) == pytest.approx(costs.prefix_forward[-1])


def test_reestimate_reproduces_a_plan_and_follows_a_new_profile() -> None:
    from planner.costmodel import reestimate

    p = uniform_profile(4)
    plan = estimate(p, cluster(2), TrainingSetup(global_batch_size=4), [(0, 1), (1, 4)], num_microbatches=2, recompute=[True, False])
    assert reestimate(plan, p) == plan
    slower = uniform_profile(4, f=2.0, b=4.0)
    again = reestimate(plan, slower)
    assert [s.forward_ms for s in again.stages] == pytest.approx([2 * s.forward_ms for s in plan.stages])
    assert [s.recompute for s in again.stages] == [True, False]
    assert again.predicted.step_time_ms > 1.9 * plan.predicted.step_time_ms
