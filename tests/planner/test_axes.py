"""The mesh search (planner/search/axes.py): D x T x K, sequence parallelism and ZeRO chosen
jointly; its proven bound against brute force over every mesh, plans within memory, and the
infeasibility message naming the mesh fixes."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cost import Layout, estimate, plan_fits
from planner.errors import InfeasibleError, InputError
from planner.schema import Cluster, LayerProfile, MeasuredOn, PlanOptions, Profile, TrainingSetup
from planner.solver import solve
from tests.planner.helpers import MiB, assert_valid


def sharded_profile(seed: int, layers: int, *, selective: bool = False) -> Profile:
    """Random layers, most of them Megatron blocks that shard (some replicated); with
    ``selective``, the blocks also give selective recompute's bytes and time."""
    rng = random.Random(seed)
    sizes = (1, 2)
    out = []
    for i in range(layers):
        f = rng.uniform(0.5, 3.0)
        act = rng.randint(1, 8) * MiB
        shards = rng.random() < 0.75
        extra: dict[str, object] = {}
        if shards:
            extra = {
                "tensor_parallel": "block",
                "tp_compute_fraction": rng.uniform(0.6, 1.0),
                "tp_forward_bytes": [rng.randint(1, 8) * MiB * b for b in sizes],
                "tp_replicated_activation_bytes": [act * b // 4 for b in sizes],
            }
            if selective:
                share = rng.uniform(0.2, 0.7)
                extra["selective_recompute_bytes"] = [round(act * b * share) for b in sizes]
                extra["selective_recompute_ms"] = [f * b * rng.uniform(0.05, 0.4) for b in sizes]
        out.append(LayerProfile(
            name=f"l{i}", param_bytes=rng.randint(1, 24) * MiB, forward_ms=[f * b for b in sizes],
            backward_ms=[2 * f * b for b in sizes], activation_bytes=[act * b for b in sizes],
            output_bytes=[MiB * b for b in sizes], **extra,  # type: ignore[arg-type]
        ))
    return Profile(model=f"sharded-{seed}", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=list(sizes),
                   layers=out)


def _cluster(n: int, memory: int) -> Cluster:
    return Cluster.model_validate({"devices": n, "memory": memory, "intra_node": "nvlink4",
                                   "inter_node": "ib-hdr", "devices_per_node": n})


def brute_force_mesh(profile: Profile, cl: Cluster, training: TrainingSetup, *, zeros: tuple[int, ...] = (0, 1, 2, 3),
                     selective: tuple[bool, ...] = (False,), tensor_parallel: tuple[int, ...] = (1, 2, 4)) -> float:
    """Best fitting 1F1B step over every T (powers of two inside the node), sequence parallelism,
    ZeRO stage, D, K, M, split and recompute choice (full per stage, or ``selective`` everywhere)."""
    n_dev, n, g = cl.num_devices, profile.num_layers, training.global_batch_size
    best = math.inf
    for t, sr in itertools.product(tensor_parallel, selective):
        if t > n_dev:
            continue
        for sp in ((False, True) if t > 1 else (False,)):
            for z in zeros:
                for d in range(1, n_dev // t + 1):
                    if g % d:
                        continue
                    for k in range(1, n_dev // (t * d) + 1):
                        for m in range(k, g // d + 1):
                            if (g // d) % m or g // (d * m) > 4:
                                continue
                            for cuts in itertools.combinations(range(1, n), k - 1):
                                b = (0, *cuts, n)
                                for rc in itertools.product((False, True), repeat=0 if sr else k):
                                    plan = estimate(
                                        profile, cl, training,
                                        Layout(
                                            [(b[i], b[i + 1]) for i in range(k)],
                                            num_microbatches=m,
                                            schedule="1f1b",
                                            recompute=list(rc) or False,
                                            data_parallel=d,
                                            pipeline_degree=k,
                                            tensor_parallel=t,
                                            zero_stage=z,
                                            sequence_parallel=sp,
                                            selective_recompute=sr,
                                        ),
                                    )
                                    if plan_fits(plan):
                                        best = min(best, plan.predicted.step_time_ms)
    return best


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), memory_mib=st.sampled_from([40, 70, 120, 400]), overlap=st.sampled_from([0.0, 0.5]))
def test_mesh_search_bound_is_valid_against_brute_force(seed: int, memory_mib: int, overlap: float) -> None:
    profile = sharded_profile(seed, 4)
    cl = _cluster(4, memory_mib * MiB)
    training = TrainingSetup(global_batch_size=4, zero_overlap=overlap)
    optimum = brute_force_mesh(profile, cl, training)
    options = PlanOptions(schedule="1f1b", time_limit_s=2.0)  # the wall-clock net (3x) must not bind on a busy CI machine
    if optimum == math.inf:
        with pytest.raises(InfeasibleError):
            solve(profile, cl, training, options)
        return
    plan = solve(profile, cl, training, options)
    assert_valid_mesh(plan, profile)
    if "ZeRO 1-3 not searched" in plan.solver.message:
        optimum = brute_force_mesh(profile, cl, training, zeros=(0,))  # the space the gap covers
    step = plan.predicted.step_time_ms
    assert step >= optimum * (1 - 1e-9) or "not searched" in plan.solver.message
    bound = step * (1 - plan.solver.gap)
    assert bound <= optimum * (1 + 1e-9), (bound, optimum, plan.solver.message)
    if plan.solver.status == "optimal":
        assert step == pytest.approx(optimum)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), memory_mib=st.sampled_from([40, 60, 90, 400]))
def test_selective_recompute_bound_is_valid_against_brute_force(seed: int, memory_mib: int) -> None:
    """Selective recompute is one more mesh family: the bound covers it and full recompute (ZeRO 0)."""
    profile = sharded_profile(seed, 4, selective=True)
    cl = _cluster(4, memory_mib * MiB)
    training = TrainingSetup(global_batch_size=4, optimizer="sgd")  # (memory for activations: recompute matters)
    optimum = brute_force_mesh(profile, cl, training, zeros=(0,), selective=(False, True))
    options = PlanOptions(schedule="1f1b", zero_stage=0, time_limit_s=2.0)
    if optimum == math.inf:
        with pytest.raises(InfeasibleError):
            solve(profile, cl, training, options)
        return
    plan = solve(profile, cl, training, options)
    assert_valid_mesh(plan, profile)
    assert not (plan.selective_recompute and any(s.recompute for s in plan.stages))
    if "selective recompute not searched" in plan.solver.message:  # the space the gap covers
        optimum = brute_force_mesh(profile, cl, training, zeros=(0,))
    step = plan.predicted.step_time_ms
    assert step >= optimum * (1 - 1e-9)
    assert step * (1 - plan.solver.gap) <= optimum * (1 + 1e-9), plan.solver.message
    if plan.solver.status == "optimal":
        assert step == pytest.approx(optimum)


def test_selective_recompute_is_what_makes_it_fit() -> None:
    # big attention scores: only dropping them (selective) or full recompute fits; selective is
    # cheaper than recomputing the whole forward, and the search finds it
    layers = []
    for i in range(4):
        layers.append(LayerProfile(
            name=f"block{i}", param_bytes=4 * MiB, forward_ms=[4.0], backward_ms=[8.0],
            activation_bytes=[40 * MiB], output_bytes=[MiB], selective_recompute_bytes=[30 * MiB],
            selective_recompute_ms=[0.5],
        ))
    profile = Profile(model="attn", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=[1], layers=layers)
    cl = _cluster(2, 130 * MiB)
    training = TrainingSetup(global_batch_size=4, optimizer="sgd")
    options = PlanOptions(schedule="1f1b", data_parallel=1, stages=2, num_microbatches=4, time_limit_s=1.0)
    with pytest.raises(InfeasibleError, match="--selective-recompute fits"):
        solve(profile, cl, training, options.model_copy(update={"selective_recompute": False, "recompute": False}))
    plan = solve(profile, cl, training, options)
    assert plan.selective_recompute and not any(s.recompute for s in plan.stages) and plan_fits(plan)
    full = solve(profile, cl, training, options.model_copy(update={"selective_recompute": False}))
    assert any(s.recompute for s in full.stages)  # (the last stage holds one micro-batch: it fits)
    assert plan.predicted.step_time_ms < full.predicted.step_time_ms
    with pytest.raises(InputError, match="exclude each other"):
        solve(profile, cl, training, options.model_copy(update={"selective_recompute": True, "recompute": True}))
    with pytest.raises(InputError, match="selective_recompute_bytes"):
        solve(sharded_profile(1, 4), cl, training, options.model_copy(update={"selective_recompute": True}))


def assert_valid_mesh(plan, profile: Profile) -> None:  # type: ignore[no-untyped-def]
    assert plan_fits(plan), [(s.memory_bytes, s.memory_limit_bytes) for s in plan.stages]
    assert plan.world_size <= plan.cluster.num_devices
    assert plan.tensor_parallel_degree <= plan.cluster.devices_per_node
    assert sum(s.stop - s.start for s in plan.stages) == profile.num_layers


def test_tensor_parallelism_is_what_makes_it_fit() -> None:
    # one layer too big for a device at T = 1: only a tensor-parallel split holds it
    profile = sharded_profile(3, 4)
    big = profile.layers[1].model_copy(update={"tensor_parallel": "block", "param_bytes": 200 * MiB})
    profile = profile.model_copy(update={"layers": [profile.layers[0], big, *profile.layers[2:]]})
    cl = _cluster(8, 700 * MiB)
    training = TrainingSetup(global_batch_size=8)
    with pytest.raises(InfeasibleError, match=r"--tensor-parallel \d fits"):
        solve(profile, cl, training, PlanOptions(tensor_parallel=1, zero_stage=0, time_limit_s=0.5))
    plan = solve(profile, cl, training, PlanOptions(time_limit_s=0.5))
    assert plan.tensor_parallel_degree > 1 or plan.zero_stage > 0
    assert plan_fits(plan)


def test_zero_is_named_when_it_fits() -> None:
    # replicated layers (no T helps), parameters too big without sharding the optimizer state
    profile = sharded_profile(5, 4)
    profile = profile.model_copy(update={"layers": [
        x.model_copy(update={"tensor_parallel": "replicated", "param_bytes": 40 * MiB}) for x in profile.layers
    ]})
    cl = _cluster(4, 512 * MiB)
    training = TrainingSetup(global_batch_size=4)
    with pytest.raises(InfeasibleError, match=r"--zero \d fits \(with --data-parallel \d\)"):
        solve(profile, cl, training, PlanOptions(zero_stage=0, data_parallel=4, time_limit_s=0.5))
    plan = solve(profile, cl, training, PlanOptions(data_parallel=4, time_limit_s=0.5))
    assert plan.zero_stage > 0 and plan_fits(plan)
    assert_valid(plan.model_copy(update={"tensor_parallel_degree": 1}), profile)


def test_sub_solves_skip_the_diagnosis_that_only_the_user_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mesh search's ZeRO-0 solve finds nothing here; its diagnosis (searches of their own,
    seconds on a large profile) would be thrown away, so the sub-solve raises without one. A
    user's own infeasible solve is still diagnosed."""
    import planner.search.driver as driver

    profile = sharded_profile(5, 4)
    profile = profile.model_copy(update={"layers": [
        x.model_copy(update={"tensor_parallel": "replicated", "param_bytes": 40 * MiB}) for x in profile.layers
    ]})
    cl = _cluster(4, 512 * MiB)
    training = TrainingSetup(global_batch_size=4)
    calls = []
    real = driver.diagnose

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "diagnose", counted)
    plan = solve(profile, cl, training, PlanOptions(data_parallel=4, time_limit_s=0.5))
    assert plan.zero_stage > 0 and plan_fits(plan) and calls == []
    with pytest.raises(InfeasibleError, match="not diagnosed"):
        driver.solve(profile, cl, training, PlanOptions(zero_stage=0, data_parallel=4, time_limit_s=0.5), explain=False)
    assert calls == []
    with pytest.raises(InfeasibleError, match=r"--zero \d fits"):
        solve(profile, cl, training, PlanOptions(zero_stage=0, data_parallel=4, time_limit_s=0.5))


def test_the_sub_solves_share_the_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mesh search's solves get limits that add up to the user's (counted in limits, not
    seconds: the same input gives the same plan), the first one half of it when ZeRO solves
    may follow; before, the first took the whole limit and the ZeRO solves came on top (the
    random-layer rows: 7.2-8.1 s for a 5 s limit)."""
    import planner.search.axes as axes
    from tests.planner.helpers import cluster, random_profile

    limits: list[float] = []
    real = axes.solve_mesh_family

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        limits.append(args[3].time_limit_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(axes, "solve_mesh_family", spy)
    profile = random_profile(9, 60)
    # (384 MiB before recompute was checkpointed layer by layer: its layers' inputs weigh more here)
    cl = cluster(16, "400MiB")
    # fused optimizer kernels: the memory above was sized before the step's temporaries were counted
    training = TrainingSetup(global_batch_size=128, optimizer="adam-mixed", fused_optimizer=True)
    plan = solve(profile, cl, training, PlanOptions(time_limit_s=0.8))
    assert plan_fits(plan)
    # ZeRO 0, then its relaxation (its bound covers every ZeRO stage), unless a loaded machine's
    # clock passed the limit first (the message says so; the later solves are then not started)
    assert len(limits) >= 2 or "time limit reached" in plan.solver.message, (limits, plan.solver.message)
    # the plan's search has 0.8 of the limit (the bound of partial recompute's relaxed problem the
    # rest: planner.search.partial), its first solve half of that
    assert limits[0] == pytest.approx(0.8 * 0.8 / 2)
    assert sum(limits) <= 0.8 + 1e-9, limits


def test_fixed_axes_are_respected() -> None:
    profile = sharded_profile(7, 6)
    cl = _cluster(8, 4096 * MiB)
    training = TrainingSetup(global_batch_size=8)
    plan = solve(profile, cl, training, PlanOptions(tensor_parallel=2, zero_stage=1, sequence_parallel=True,
                                                    time_limit_s=0.5))
    assert (plan.tensor_parallel_degree, plan.zero_stage, plan.sequence_parallel) in {(2, 1, True), (2, 0, True)}
    if plan.data_parallel_degree > 1:
        assert plan.zero_stage == 1
    assert plan.world_size <= 8 and all(d % 2 == 0 for s in plan.stages for d in s.devices)
    with pytest.raises(InputError, match="devices per node"):
        solve(profile, _cluster(4, 4096 * MiB).model_copy(update={"devices_per_node": 2}), training,
              PlanOptions(tensor_parallel=4, time_limit_s=0.5))


def test_replicated_profiles_never_get_tensor_parallelism() -> None:
    from tests.planner.helpers import random_profile

    profile = random_profile(1, 6)
    plan = solve(profile, _cluster(4, 4096 * MiB), TrainingSetup(global_batch_size=8), PlanOptions(time_limit_s=0.5))
    assert plan.tensor_parallel_degree == 1 and "T=1)" in plan.solver.message


def test_cli_flags_on_plan_and_estimate(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json as _json

    from pipeplan.cli import main
    from profiler.synth import synth_transformer

    prof = tmp_path / "gpt.json"
    prof.write_text(synth_transformer(layers=4, hidden=1024, heads=8, seq=512, vocab=4096, device_type="a100-80g",
                                      microbatch_sizes=(1, 2), attention="materialized").model_dump_json())
    out = tmp_path / "plan.json"
    rc = main(["estimate", str(prof), "--devices", "8", "--batch-size", "8", "--stages", "0:3,3:6",
               "--microbatches", "4", "--tensor-parallel", "4", "--zero", "1", "--data-parallel", "1",
               "--sequence-parallel", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "tensor-parallel T=4 with sequence parallelism" in text and "(8 devices)" in text
    plan = _json.loads(out.read_text())
    assert (plan["tensor_parallel_degree"], plan["zero_stage"], plan["sequence_parallel"]) == (4, 1, True)
    assert plan["schema_version"] == 5 and [s["devices"] for s in plan["stages"]] == [[0], [4]]
    assert main(["show", str(out)]) == 0
    assert "T=4+SP ZeRO-1" in capsys.readouterr().out  # zero 1 with D = 1 is kept as asked by estimate
    rc = main(["plan", str(prof), "--devices", "8", "--batch-size", "8", "--tensor-parallel", "2", "--zero", "2",
               "--no-sequence-parallel", "--time-limit", "0.5", "--json"])
    plan = _json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["tensor_parallel_degree"] == 2 and not plan["sequence_parallel"]
    assert plan["zero_stage"] in (0, 2) and (plan["zero_stage"] == 2) == (plan["data_parallel_degree"] > 1)
    rc = main(["estimate", str(prof), "--devices", "8", "--batch-size", "8", "--stages", "0:3,3:6",
               "--microbatches", "4", "--selective-recompute", "-o", str(out)])
    assert rc == 0 and "selective recompute" in capsys.readouterr().out
    assert _json.loads(out.read_text())["selective_recompute"] is True
    assert main(["show", str(out)]) == 0 and "selective-recompute" in capsys.readouterr().out
    rc = main(["plan", str(prof), "--devices", "8", "--batch-size", "8", "--selective-recompute", "--time-limit",
               "0.5", "--json"])
    plan = _json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["selective_recompute"] and not any(s["recompute"] for s in plan["stages"])
    rc = main(["plan", str(prof), "--devices", "8", "--tensor-parallel", "16"])
    err = capsys.readouterr().err
    assert rc == 1 and "error: --tensor-parallel 16" in err and "Traceback" not in err


def test_a_fixed_zero_stage_tries_every_replica_count() -> None:
    """Regression: with --zero 1 and D free, the relaxation chose D = 1 (nothing to shard) and
    the search tried no other D, so the bundled model on 8 H100s was reported infeasible."""
    from pathlib import Path

    bundled = Profile.model_validate_json((Path(__file__).resolve().parents[2] / "planner/data/gpt-48l-10b.json").read_text())
    cluster = Cluster.model_validate({"devices": 8, "device_type": "h100-80g"})
    plan = solve(bundled, cluster, TrainingSetup(global_batch_size=256), PlanOptions(schedule="1f1b", zero_stage=1, time_limit_s=1))
    assert plan.zero_stage == 1 and plan.data_parallel_degree > 1 and plan_fits(plan)
