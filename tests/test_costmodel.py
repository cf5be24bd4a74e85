"""The cost model: interpolation, time, memory and validation of a given plan."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import (
    Layout,
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
    plan = estimate(
        p, c, train,
        Layout(
            [(0, 2), (2, 4), (4, 6), (6, 8)],
            num_microbatches=m,
            schedule="gpipe",
        ),
    )
    f, b = 2.0, 4.0  # two layers per stage, micro-batch size 1
    xfer = (100 / 1e9 + 1e-3) * 1e3
    assert plan.stages[0].send_ms == pytest.approx(xfer)
    assert plan.predicted.step_time_ms == pytest.approx((m + k - 1) * (f + b) + 2 * (k - 1) * xfer)
    assert plan.microbatch_size == 1
    assert simulate_plan(plan).makespan_ms == pytest.approx(plan.predicted.step_time_ms)


def test_speed_scales_time() -> None:
    p = uniform_profile(4)
    fast = estimate(
        p, cluster(2), TrainingSetup(global_batch_size=4),
        Layout(
            [(0, 2), (2, 4)],
            num_microbatches=4,
        ),
    )
    slow_cluster = Cluster.model_validate(
        {"devices": [{"memory_bytes": "1GiB", "speed": 0.5}] * 2, "intra_node": "pcie4", "inter_node": "ib-hdr"}
    )
    slow = estimate(
        p, slow_cluster, TrainingSetup(global_batch_size=4),
        Layout(
            [(0, 2), (2, 4)],
            num_microbatches=4,
        ),
    )
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
    plan = estimate(
        p, c, TrainingSetup(global_batch_size=2),
        Layout(
            [(0, 2), (2, 4)],
            num_microbatches=2,
        ),
    )
    assert plan.stages[0].send_ms == pytest.approx((10**6 / 1e9 + 1e-5) * 1e3)


def test_memory_per_schedule_and_recompute() -> None:
    params, act, out = 10_000, 1000, 100
    p = uniform_profile(8, act=act, out=out, params=params)
    # (fused kernels: the walk's activations, not the optimizer step's temporaries, make the peaks)
    train = TrainingSetup(global_batch_size=8, optimizer="adam", memory_margin=0.0, fused_optimizer=True)
    ranges = [(0, 2), (2, 4), (4, 6), (6, 8)]
    static = static_bytes(2 * params, train)
    assert static == 2 * params * (1 + 1 + 2)
    g = estimate(p, cluster(4), train, Layout(ranges, num_microbatches=8, schedule="gpipe"))
    assert [s.memory_bytes for s in g.stages] == [static + 8 * 2 * act] * 4
    o = estimate(p, cluster(4), train, Layout(ranges, num_microbatches=8, schedule="1f1b"))
    assert [s.memory_bytes for s in o.stages] == [static + (4 - k) * 2 * act for k in range(4)]
    r = estimate(
        p, cluster(4), train,
        Layout(
            ranges,
            num_microbatches=8,
            schedule="gpipe",
            recompute=True,
        ),
    )
    # checkpointed layer by layer: each of a stage's two layers keeps its input per micro-batch
    # in flight (the model input is 0 bytes here, every cut 100 B per sample), and the backward
    # re-materialises one layer at a time (act), not the stage's two (2 act)
    assert r.stages[0].memory_bytes == static + 8 * (0 + out) + act
    assert r.stages[1].memory_bytes == static + 8 * (out + out) + act
    # checkpointing only the first layer of each stage: it keeps that layer's input and the second
    # layer's activations; the second layer's backward frees its activations before the first
    # re-runs, so re-materialising it adds nothing to the peak
    h = estimate(
        p, cluster(4), train,
        Layout(
            ranges,
            num_microbatches=8,
            schedule="gpipe",
            recompute_layers=[1] * 4,
        ),
    )
    assert h.stages[1].memory_bytes == static + 8 * (out + act)
    # the model's last layer keeps its activations (its loss holds them) even when checkpointed
    assert r.stages[3].memory_bytes == static + 8 * (out + out + act) + act
    assert h.stages[1].recompute_layers == 1 and h.stages[1].recompute
    assert h.stages[1].backward_ms == pytest.approx(o.stages[1].backward_ms + o.stages[1].forward_ms / 2)
    assert [s.recompute_ms for s in h.stages] == pytest.approx([s.forward_ms / 2 for s in h.stages])
    # recompute adds one forward to the backward
    assert r.stages[1].backward_ms == pytest.approx(o.stages[1].backward_ms + o.stages[1].forward_ms)


def test_memory_margin_and_fit() -> None:
    p = uniform_profile(2, params=400 * 2**20)
    c = cluster(2, memory="3GiB")
    tight = TrainingSetup(global_batch_size=2, optimizer="adam", memory_margin=0.1)
    plan = estimate(p, c, tight, Layout([(0, 1), (1, 2)], num_microbatches=2))
    assert plan.stages[0].memory_limit_bytes == int(3 * 2**30 * 0.9)
    assert plan_fits(plan)  # 1.56 GiB of weights, gradients and Adam state fit 2.7 GiB
    one = estimate(p, cluster(1, memory="3GiB"), tight, Layout([(0, 2)], num_microbatches=2))
    assert not plan_fits(one)  # 3.125 GiB do not


def test_data_parallel_allreduce() -> None:
    params = 10**6
    p = uniform_profile(4, params=params)
    c = cluster(4, bw=1e9, lat=0.0)
    train = TrainingSetup(global_batch_size=8, optimizer="sgd")
    plan = estimate(p, c, train, Layout([(0, 2), (2, 4)], num_microbatches=2, data_parallel=2))
    assert plan.data_parallel_degree == 2 and plan.microbatch_size == 2
    assert [s.devices for s in plan.stages] == [[0, 2], [1, 3]]
    ar = allreduce_ms(2 * params, 2, 1e9, 0.0)
    assert ar == pytest.approx(2 * 1 / 2 * 2 * params / 1e9 * 1e3)
    assert plan.predicted.allreduce_ms == pytest.approx(ar)
    no_dp = estimate(
        p, c, TrainingSetup(global_batch_size=4, optimizer="sgd"),
        Layout(
            [(0, 2), (2, 4)],
            num_microbatches=2,
        ),
    )
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
        plan = estimate(p, cluster(4), train, Layout(stages, **args))
        assert plan.virtual_stages == 2 and plan.pipeline_degree == 2
        return
    with pytest.raises(InputError) as info:
        estimate(
            p, cluster(4), TrainingSetup(global_batch_size=4) if "split" in fragment else train,
            Layout(
                stages,
                **args,
            ),
        )
    assert fragment in str(info.value)


def test_lower_bound_is_a_bound() -> None:
    p = uniform_profile(8)
    c = cluster(4)
    train = TrainingSetup(global_batch_size=16)
    lb = lower_bound_ms(p, c, train)
    assert lb == pytest.approx(16 * 8 * 3.0 / 4)
    plan = estimate(p, c, train, Layout([(0, 2), (2, 4), (4, 6), (6, 8)], num_microbatches=16))
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
    plan = estimate(
        p, cluster(k), TrainingSetup(global_batch_size=m),
        Layout(
            ranges,
            num_microbatches=m,
            schedule=schedule,
        ),
    )  # type: ignore[arg-type]
    busiest = max((s.forward_ms + s.backward_ms) * m for s in plan.stages)
    assert plan.predicted.step_time_ms >= busiest - 1e-9
    assert plan.predicted.step_time_ms >= plan.predicted.lower_bound_ms - 1e-9
    assert 0 <= plan.predicted.bubble_fraction < 1
    costs = layer_costs(p, 1)
    assert sum(s.forward_ms for s in plan.stages) == pytest.approx(costs.prefix_forward[-1])


def test_reestimate_reproduces_a_plan_and_follows_a_new_profile() -> None:
    from planner.cost import reestimate

    p = uniform_profile(4)
    plan = estimate(
        p, cluster(2), TrainingSetup(global_batch_size=4),
        Layout(
            [(0, 1), (1, 4)],
            num_microbatches=2,
            recompute=[True, False],
        ),
    )
    assert reestimate(plan, p) == plan
    slower = uniform_profile(4, f=2.0, b=4.0)
    again = reestimate(plan, slower)
    assert [s.forward_ms for s in again.stages] == pytest.approx([2 * s.forward_ms for s in plan.stages])
    assert [s.recompute for s in again.stages] == [True, False]
    assert again.predicted.step_time_ms > 1.9 * plan.predicted.step_time_ms


# --------------------------------------------------------------------------- zero-bubble


def _zb_plan(schedule: str, *, k: int = 2, m: int = 8, recompute: bool = False, split: bool = True):  # type: ignore[no-untyped-def]
    from planner.cost import Layout, estimate
    from planner.schema import SCHEDULE_CHUNKS, TrainingSetup
    from tests.planner.helpers import cluster, random_profile

    v = 2 if SCHEDULE_CHUNKS[schedule] != "1" else 1  # type: ignore[index]
    n = k * v
    layers = 2 * n
    profile = random_profile(11, layers, split_backward=split)
    bounds = [round(i * layers / n) for i in range(n + 1)]
    plan = estimate(
        # fused optimizer kernels: the memory tests below check the walk, which foreach Adam's
        # step temporaries (larger than these random layers' activations) would hide
        profile, cluster(k, "8GiB"), TrainingSetup(global_batch_size=2 * m, fused_optimizer=True),
        Layout(
            [(bounds[i], bounds[i + 1]) for i in range(n)],
            num_microbatches=m,
            schedule=schedule,
            pipeline_degree=k,
            recompute=recompute,
        ),
    )
    return profile, plan


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev", "interleaved-zb", "planned"])
def test_plan_carries_the_actions_it_predicted(schedule: str) -> None:
    """The plan lists what each rank runs; simulating exactly that gives the predicted step,
    the JSON round trip keeps it, and re-estimating with those actions changes nothing."""
    from planner.cost import plan_orders, reestimate, simulate_plan
    from planner.schedules import parse_actions, schedule_actions
    from planner.schema import Plan

    profile, plan = _zb_plan(schedule)
    assert plan.actions is not None and len(plan.actions) == plan.pipeline_degree
    if schedule != "planned":
        assert parse_actions(plan.actions) == schedule_actions(schedule, 2, 8, plan.virtual_stages)  # type: ignore[arg-type]
    sim = simulate_plan(plan)
    assert sim.makespan_ms == pytest.approx(plan.predicted.step_time_ms, rel=1e-12)
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan and plan_orders(again) == plan_orders(plan)
    assert reestimate(again, profile).predicted == plan.predicted
    kinds = {e.kind for t in sim.timelines for e in t}
    if schedule in ("zb-h1", "zb-h2", "zbv", "interleaved-zb", "planned"):
        assert {"backward_input", "backward_weight"} <= kinds and "backward" not in kinds


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("recompute", [False, True])
def test_memory_from_the_walk_equals_the_closed_forms_for_gpipe_and_1f1b(schedule: str, recompute: bool) -> None:
    """GPipe holds M micro-batches, 1F1B K - k on stage k; with recompute only its layers'
    inputs each, plus one layer's activations during its backward: the walk gives exactly that."""
    from planner.cost import layer_costs, static_bytes

    profile, plan = _zb_plan(schedule, k=3, m=6, recompute=recompute, split=False)
    costs = layer_costs(profile, plan.microbatch_size)
    for st_ in plan.stages:
        n = 6 if schedule == "gpipe" else 3 - st_.index
        acts = costs.prefix_activation[st_.stop] - costs.prefix_activation[st_.start]
        # checkpointed layer by layer: every layer's input (the stage input, then each cut
        # inside the stage) per micro-batch, and the largest one layer during the backward
        inputs = costs.stage_input_bytes(st_.start) + sum(costs.cut_bytes[i - 1] for i in range(st_.start + 1, st_.stop))
        if st_.stop == profile.num_layers:  # the loss keeps the last layer's activations
            inputs += costs.activation_bytes[-1]
        largest = max(costs.activation_bytes[st_.start:st_.stop])
        stash = inputs if recompute else acts
        closed = static_bytes(st_.param_bytes, plan.training) + n * stash + (largest if recompute else 0.0)
        assert st_.memory_bytes == math.ceil(closed)


def test_interleaved_memory_is_at_most_the_old_closed_form() -> None:
    """Interleaved 1F1B: the walk never exceeds the old closed form (in-flight count x the
    largest chunk) and equals it when the chunks are alike."""
    from planner.cost import layer_costs, static_bytes

    for split in (False, True):
        profile, plan = _zb_plan("interleaved-1f1b", k=2, m=4, split=split)
        costs = layer_costs(profile, plan.microbatch_size)
        for r in range(2):
            own = [s for s in plan.stages if s.index % 2 == r]
            n = min((2 - r - 1) * 2 + 2 + 1, 8)
            acts = [costs.prefix_activation[s.stop] - costs.prefix_activation[s.start] for s in own]
            closed = static_bytes(sum(s.param_bytes for s in own), plan.training) + n * max(acts)
            assert own[0].memory_bytes <= math.ceil(closed)


def test_old_profiles_split_the_backward_in_half_and_hold_everything_until_w() -> None:
    from planner.cost import layer_costs
    from tests.planner.helpers import random_profile

    costs = layer_costs(random_profile(2, 5), 2)
    assert costs.input_ms == pytest.approx([b / 2 for b in costs.backward_ms])
    assert costs.weight_ms == pytest.approx([b / 2 for b in costs.backward_ms])
    assert costs.weight_grad_bytes == costs.activation_bytes
    measured = layer_costs(random_profile(2, 5, split_backward=True), 2)
    for b, i, w in zip(measured.backward_ms, measured.input_ms, measured.weight_ms, strict=True):
        assert i + w >= b * (1 - 1e-12)  # never cheaper than the whole backward


def test_plan_documents_refuse_inconsistent_schedules() -> None:
    from planner.errors import InputError
    from planner.schema import parse_document

    _, plan = _zb_plan("zbv")
    data = plan.model_dump(mode="json")
    with pytest.raises(InputError, match="placement 'loop' does not suit schedule 'zbv'"):
        parse_document("plan", {**data, "placement": "loop"})
    _, planned = _zb_plan("planned")
    with pytest.raises(InputError, match="'planned' needs its actions"):
        parse_document("plan", {**planned.model_dump(mode="json"), "actions": None})
    with pytest.raises(InputError, match="actions lists 1 ranks but pipeline_degree is 2"):
        parse_document("plan", {**data, "actions": data["actions"][:1]})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_shared_schedule_templates_price_the_same(schedule: str) -> None:
    """An estimate that reuses a search's schedule templates (planner.cost.ScheduleTemplates)
    is the estimate without them, to the byte and the nanosecond; a shape is made once, and a
    plan's own actions (given, or a planned schedule's) never come from it."""
    from planner.cost import ScheduleTemplates

    prof = uniform_profile(8)
    cl = Cluster.model_validate({"devices": 4, "memory": "1GiB"})
    tr = TrainingSetup(global_batch_size=8)
    stages = [(0, 2), (2, 4), (4, 6), (6, 8)] if schedule != "interleaved-1f1b" else [(i, i + 1) for i in range(8)]
    kw = {"num_microbatches": 4, "schedule": schedule, "pipeline_degree": 4}
    templates = ScheduleTemplates()
    plain = estimate(prof, cl, tr, Layout(stages, **kw))  # type: ignore[arg-type]
    first = estimate(prof, cl, tr, Layout(stages, **kw), templates=templates)  # type: ignore[arg-type]
    again = estimate(prof, cl, tr, Layout(stages, recompute=True, **kw), templates=templates)  # type: ignore[arg-type]
    assert first.model_dump() == plain.model_dump()
    assert again.model_dump() == estimate(prof, cl, tr, Layout(stages, recompute=True, **kw)).model_dump()  # type: ignore[arg-type]
    assert list(templates.orders) == [(schedule, 4, 4, plain.virtual_stages)] and len(templates.compiled) == 1
    # given actions are the plan's own: the template is not used for them
    given = estimate(prof, cl, tr, Layout(stages, actions=plain.actions, **kw), templates=templates)  # type: ignore[arg-type]
    assert given.predicted == plain.predicted and len(templates.compiled) == 1
