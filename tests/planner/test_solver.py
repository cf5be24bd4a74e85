"""The solver: validity, optimality against brute force, baselines, determinism, options."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.baselines import evaluate_baselines
from planner.cost import Layout, estimate, reestimate
from planner.errors import InputError
from planner.schema import PlanOptions, StageRange, TrainingSetup
from planner.solver import solve
from tests.planner.helpers import assert_valid, brute_force, cluster, random_profile

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    layers=st.integers(2, 9),
    devices=st.sampled_from([1, 2, 3, 4]),
    batch=st.sampled_from([4, 8, 12]),
    memory=st.sampled_from(["64MiB", "128MiB", "1GiB"]),
    slow=st.booleans(),
)
def test_plan_is_valid_and_never_worse_than_baselines(
    seed: int, layers: int, devices: int, batch: int, memory: str, slow: bool
) -> None:
    profile = random_profile(seed, layers, unrepeated=seed % 3 == 0)
    speeds = [1.0 if i % 2 == 0 else 0.5 for i in range(devices)] if slow and devices > 1 else None
    cl = cluster(devices, memory, speeds=speeds)
    training = TrainingSetup(global_batch_size=batch, optimizer="sgd")
    try:
        plan = solve(profile, cl, training, PlanOptions(time_limit_s=2))
    except Exception as err:  # infeasible is fine, but it must be the domain error
        from planner.errors import InfeasibleError

        assert isinstance(err, InfeasibleError), err
        for r in evaluate_baselines(profile, cl, training):
            assert r.plan is None, f"baseline {r.name} fits but the solver found nothing"
        return
    assert_valid(plan, profile)
    for r in evaluate_baselines(profile, cl, training):
        if r.plan is not None:
            assert plan.predicted.step_time_ms <= r.plan.predicted.step_time_ms * (1 + 1e-9), r.name
    for r in evaluate_baselines(profile, cl, training, num_microbatches=plan.num_microbatches):
        if r.plan is not None:
            assert plan.predicted.step_time_ms <= r.plan.predicted.step_time_ms * (1 + 1e-9), r.name
    # the plan's numbers are estimate's numbers
    again = reestimate(plan, profile, cluster=cl, training=training)
    assert again.predicted == plan.predicted


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    layers=st.integers(3, 8),
    k=st.integers(2, 3),
    m=st.sampled_from([1, 2, 4, 8]),
    schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2", "planned"]),
    memory=st.sampled_from(["48MiB", "96MiB", "1GiB"]),
)
def test_optimal_against_brute_force(seed: int, layers: int, k: int, m: int, schedule: str, memory: str) -> None:
    profile = random_profile(seed, layers, unrepeated=seed % 3 == 0)
    cl = cluster(k, memory)
    training = TrainingSetup(global_batch_size=8, optimizer="sgd")
    if 8 % m:
        return
    options = PlanOptions(stages=k, num_microbatches=m, schedule=schedule, data_parallel=1, partial_recompute=False)  # type: ignore[arg-type]
    if schedule in ("1f1b", "zb-h1") and m < k:
        # the runtime's Schedule1F1B needs M >= K: no configuration, and the message names the rule
        from planner.errors import InputError

        with pytest.raises(InputError, match=f"cannot run with these options: .*M={m} < K={k}"):
            solve(profile, cl, training, options)
        return
    oracle = brute_force(profile, cl, training, k=k, m=m, schedule=schedule)  # type: ignore[arg-type]
    if math.isinf(oracle):
        from planner.errors import InfeasibleError

        with pytest.raises(InfeasibleError):
            solve(profile, cl, training, options)
        return
    plan = solve(profile, cl, training, options)
    assert_valid(plan, profile)
    assert plan.predicted.step_time_ms == pytest.approx(oracle, rel=1e-9)
    assert plan.solver.status == "optimal" and plan.solver.gap == 0


def test_optimal_against_brute_force_twelve_layers() -> None:
    profile = random_profile(7, 12)
    cl = cluster(3, "160MiB")
    training = TrainingSetup(global_batch_size=8, optimizer="sgd")
    oracle = brute_force(profile, cl, training, k=3, m=4, schedule="1f1b")
    plan = solve(profile, cl, training, PlanOptions(stages=3, num_microbatches=4, schedule="1f1b", data_parallel=1, partial_recompute=False))
    assert plan.predicted.step_time_ms == pytest.approx(oracle, rel=1e-9)


def test_deterministic() -> None:
    profile = random_profile(3, 40)
    cl = cluster(8, "320MiB")  # (256 MiB before the optimizer step's temporaries were counted)
    training = TrainingSetup(global_batch_size=32)
    a = solve(profile, cl, training, PlanOptions(time_limit_s=3))
    b = solve(profile, cl, training, PlanOptions(time_limit_s=3))
    assert a.model_dump(exclude={"solver"}) == b.model_dump(exclude={"solver"})


def test_gap_is_an_upper_bound_claim() -> None:
    """A reported gap g means no plan is faster than step x (1 - g): check on a brute-forceable case."""
    profile = random_profile(11, 7)
    cl = cluster(2, "1GiB")
    training = TrainingSetup(global_batch_size=4, optimizer="sgd")
    plan = solve(profile, cl, training, PlanOptions(schedule="1f1b", data_parallel=1, stages=2))
    best = min(
        brute_force(profile, cl, training, k=2, m=m, schedule="1f1b") for m in (2, 4)  # 1f1b needs M >= K
    )
    assert plan.predicted.step_time_ms * (1 - plan.solver.gap) <= best * (1 + 1e-9)
    assert plan.predicted.step_time_ms == pytest.approx(best, rel=1e-9)


def test_fixed_options_are_respected() -> None:
    profile = random_profile(5, 12)
    cl = cluster(4, "1GiB")
    training = TrainingSetup(global_batch_size=16)
    plan = solve(profile, cl, training, PlanOptions(stages=2, num_microbatches=4, schedule="gpipe", data_parallel=2))
    assert (plan.pipeline_degree, plan.num_microbatches, plan.schedule, plan.data_parallel_degree) == (2, 4, "gpipe", 2)
    ranges = [StageRange(start=0, stop=5), StageRange(start=5, stop=12)]
    plan = solve(profile, cl, training, PlanOptions(stages=ranges))
    assert [(s.start, s.stop) for s in plan.stages] == [(0, 5), (5, 12)]
    plan = solve(profile, cl, training, PlanOptions(recompute=False))
    assert not any(s.recompute for s in plan.stages)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (PlanOptions(stages=9), "stages=9 needs 9 devices"),
        (PlanOptions(data_parallel=3), "does not divide the global batch 16"),
        (PlanOptions(num_microbatches=5), "num_microbatches=5"),
        (PlanOptions(stages=[StageRange(start=0, stop=5), StageRange(start=6, stop=12)]), "leaves layers 5:6"),
        (PlanOptions(schedule="1f1b", virtual_stages=2), "does not suit schedule '1f1b'.*choose interleaved-1f1b"),
        (PlanOptions(schedule="zbv", virtual_stages=3), "does not suit schedule 'zbv', which runs two stages"),
        (PlanOptions(schedule="dualpipev", num_microbatches=4, stages=3), r"dualpipev needs .* M >= 2K"),
    ],
)
def test_contradictory_options(options: PlanOptions, needle: str) -> None:
    profile = random_profile(5, 12)
    with pytest.raises(InputError, match=needle):
        solve(profile, cluster(8, "1GiB"), TrainingSetup(global_batch_size=16), options)


def test_a_recompute_list_of_the_wrong_length_is_refused_when_the_options_are_read() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="recompute lists 3 flags but stages=2: give one per stage"):
        PlanOptions(stages=2, recompute=[True, False, True])
    with pytest.raises(ValidationError, match="recompute lists 2 flags for 3 stages: give one per stage"):
        PlanOptions(stages=[StageRange(start=0, stop=4), StageRange(start=4, stop=8), StageRange(start=8, stop=12)],
                    recompute=[True, False])  # fmt: skip
    PlanOptions(stages=2, virtual_stages=2, recompute=[True, False, True, False])  # one per chunk: fine


def test_heterogeneous_slow_device_gets_half_the_work() -> None:
    profile = random_profile(1, 2)
    from planner.schema import LayerProfile, Profile

    layers = [
        LayerProfile(name=f"l{i}", param_bytes=2**20, forward_ms=[1.0], backward_ms=[2.0],
                     activation_bytes=[2**20], output_bytes=[1024])
        for i in range(60)
    ]
    profile = Profile(model="uniform", measured_on=profile.measured_on, microbatch_sizes=[1], layers=layers)
    cl = cluster(2, "1GiB", speeds=[1.0, 0.5])
    training = TrainingSetup(global_batch_size=32)
    plan = solve(profile, cl, training, PlanOptions(stages=2, data_parallel=1, schedule="1f1b"))
    work = {}
    for s in plan.stages:
        speed = cl.devices[s.devices[0]].speed
        work[speed] = s.stop - s.start
    assert work[0.5] / work[1.0] == pytest.approx(0.5, abs=0.08)


def _between(profile, cl, training, tight: PlanOptions, loose: PlanOptions):  # type: ignore[no-untyped-def]
    """A memory size where ``loose`` fits and ``tight`` does not (both minima computed)."""
    from planner.infeasible import min_memory_bytes, with_memory

    (need_tight, exact_tight), (need_loose, exact_loose) = (
        min_memory_bytes(profile, cl, training, tight), min_memory_bytes(profile, cl, training, loose))  # type: ignore[misc]
    assert exact_tight and exact_loose  # (no deadline: the bisection finishes)
    assert need_loose < need_tight - 2**21, (need_loose, need_tight)
    return with_memory(cl, (need_loose + need_tight) // 2)


def test_recompute_is_what_makes_it_fit() -> None:
    from planner.errors import InfeasibleError

    profile = random_profile(2, 8)
    training = TrainingSetup(global_batch_size=8, optimizer="sgd")
    base = PlanOptions(schedule="1f1b", stages=2, num_microbatches=8)
    cl = _between(profile, cluster(2, "1GiB"), training, base.model_copy(update={"recompute": False}), base)
    with pytest.raises(InfeasibleError):
        solve(profile, cl, training, base.model_copy(update={"recompute": False}))
    plan = solve(profile, cl, training, base)
    assert any(s.recompute for s in plan.stages)
    assert_valid(plan, profile)


def test_1f1b_is_what_makes_it_fit() -> None:
    from planner.errors import InfeasibleError

    profile = random_profile(4, 8)
    training = TrainingSetup(global_batch_size=16, optimizer="sgd")
    opts = PlanOptions(recompute=False, stages=4, num_microbatches=16, data_parallel=1)
    gpipe = opts.model_copy(update={"schedule": "gpipe"})
    cl = _between(profile, cluster(4, "1GiB"), training, gpipe, opts)
    with pytest.raises(InfeasibleError):
        solve(profile, cl, training, gpipe)
    plan = solve(profile, cl, training, opts)
    # fewer micro-batches in flight than GPipe: 1F1B, or a zero-bubble or planned schedule
    assert plan.schedule != "gpipe"
    assert_valid(plan, profile)
    one = solve(profile, cl, training, opts.model_copy(update={"schedule": "1f1b"}))
    assert plan.predicted.step_time_ms <= one.predicted.step_time_ms * (1 + 1e-9)


def test_1f1b_stages_beside_a_slow_link_take_less_work() -> None:
    """In 1F1B two neighbouring ranks pass micro-batches back and forth, so a slow link
    between full stages stretches every micro-batch by its transfer time.  The planner gives
    the stages beside it less work and beats the evenly balanced split."""
    from planner.schema import Cluster, LayerProfile, MeasuredOn, Profile

    mib = 2**20
    sizes = [1, 2]
    profile = Profile(
        model="fine-layers", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=sizes,
        layers=[
            LayerProfile(name=f"l{i}", param_bytes=mib, forward_ms=[0.25 * b for b in sizes],
                         backward_ms=[0.5 * b for b in sizes], activation_bytes=[mib * b for b in sizes],
                         output_bytes=[64 * mib * b for b in sizes])
            for i in range(256)
        ],
    )
    # two nodes of two devices: the link between pipeline ranks 1 and 2 is 14x slower
    cl = Cluster.model_validate(
        {"devices": 4, "memory": "80GiB", "devices_per_node": 2, "intra_node": "nvlink4", "inter_node": "pcie4"}
    )
    training = TrainingSetup(global_batch_size=64)
    plan = solve(profile, cl, training, PlanOptions(schedule="1f1b", stages=4, num_microbatches=64, data_parallel=1))
    even = estimate(
        profile, cl, training,
        Layout(
            [(0, 64), (64, 128), (128, 192), (192, 256)],
            num_microbatches=64,
        ),
    )
    assert plan.predicted.step_time_ms < 0.99 * even.predicted.step_time_ms
    sizes_ = [s.stop - s.start for s in plan.stages]
    assert min(sizes_[1], sizes_[2]) < min(sizes_[0], sizes_[3])
    assert_valid(plan, profile)
    # the greedy split that keeps the transfer cycles in the period finds it without polishing
    from planner.search.model import StageModel, bisect_feasible, quick_step
    from planner.search.space import Config, make_groups
    from planner.search.state import SearchState
    from planner.splits.greedy import greedy_split

    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    cfg = Config(1, 4, 64, "1f1b")
    groups = make_groups(cl, training, 1, 4)
    sm = StageModel(search.costs_at(1), cfg, training)
    steps = {}
    for window in (False, True):
        t = bisect_feasible(lambda t, w=window: greedy_split(search, sm, groups, (0, 1, 2, 3), t, idle=True, window=w) is not None, 0.0)[1]
        split = greedy_split(search, sm, groups, (0, 1, 2, 3), t, idle=True, window=window)
        assert split is not None
        steps[window] = quick_step(sm, cl, groups, split)
    assert steps[True] < 0.99 * steps[False]


def test_deterministic_when_the_budget_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search budget counts work, not seconds: a cut-short search repeats exactly (the
    wall-clock safety net, a multiple of the time limit, is lifted: on a loaded machine it
    binds first, which is what it is for)."""
    import planner.search.axes as axes
    import planner.search.driver as driver

    monkeypatch.setattr(driver, "WALL_SAFETY", 1000.0)
    monkeypatch.setattr(axes, "WALL_SAFETY", 1000.0)
    profile = random_profile(9, 60)
    cl = cluster(16, "512MiB")
    training = TrainingSetup(global_batch_size=64)
    opts = PlanOptions(time_limit_s=0.2, zero_stage=0, tensor_parallel=1)  # the D x K search alone
    a = solve(profile, cl, training, opts)
    b = solve(profile, cl, training, opts)
    assert "time limit reached" in a.solver.message
    assert a.model_dump(exclude={"solver"}) == b.model_dump(exclude={"solver"})
    assert (a.solver.status, a.solver.gap, a.solver.message) == (b.solver.status, b.solver.gap, b.solver.message)


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    k=st.integers(2, 3),
    m=st.sampled_from([1, 2, 4, 8]),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    memory=st.sampled_from(["64MiB", "1GiB"]),
    slow=st.booleans(),
)
def test_relaxed_bound_is_below_the_optimum(seed: int, k: int, m: int, schedule: str, memory: str, slow: bool) -> None:
    """The configuration bound behind every reported gap never exceeds the true optimum."""
    from planner.bounds.relaxed import relaxed_bound
    from planner.search.model import StageModel
    from planner.search.space import Config, make_groups
    from planner.search.state import SearchState

    if schedule == "1f1b" and m < k:
        schedule = "gpipe"  # 1f1b needs M >= K
    profile = random_profile(seed, 7, unrepeated=seed % 3 == 0)
    cl = cluster(k, memory, speeds=[1.0] + [0.5] * (k - 1) if slow else None)
    training = TrainingSetup(global_batch_size=8, optimizer="sgd")
    cfg = Config(1, k, m, schedule)  # type: ignore[arg-type]
    search = SearchState(profile, cl, training, PlanOptions(), deadline=math.inf)
    groups = make_groups(cl, training, 1, k)
    sm = StageModel(search.costs_at(8 // m), cfg, training)
    bound = relaxed_bound(search, sm, groups, 0.0)
    if slow:
        from planner.search.space import device_orders

        oracle = math.inf
        for order in device_orders(groups):
            devices = [list(groups[i].devices) for i in order]
            oracle = min(oracle, _brute_with_devices(profile, cl, training, k, m, schedule, devices))
    else:
        oracle = brute_force(profile, cl, training, k=k, m=m, schedule=schedule)  # type: ignore[arg-type]
    if bound is None:
        assert math.isinf(oracle)
    elif not math.isinf(oracle):
        assert bound <= oracle * (1 + 1e-9)


def _brute_with_devices(profile, cl, training, k, m, schedule, devices) -> float:  # type: ignore[no-untyped-def]
    import itertools

    from planner.cost import plan_fits

    best = math.inf
    n = profile.num_layers
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        ranges = [(bounds[i], bounds[i + 1]) for i in range(k)]
        for rc in itertools.product((False, True), repeat=k):
            plan = estimate(
                profile, cl, training,
                Layout(
                    ranges,
                    num_microbatches=m,
                    schedule=schedule,
                    recompute=list(rc),
                    devices=devices,
                ),
            )
            if plan_fits(plan):
                best = min(best, plan.predicted.step_time_ms)
    return best
