"""Context parallelism (C) and expert parallelism (E) in `pipeplan export`.

Megatron-LM gets ``--context-parallel-size``/``--cp-comm-type`` and ``--expert-model-parallel-size``,
checked by megatron-core's TransformerConfig and by its own ``parallel_state`` building the groups
on a fake process group (the expert group holds the context-parallel ranks first, as pipeplan
prices it).  torchtitan gets ``context_parallel_degree`` and ``expert_parallel_degree``, checked by
its config classes, command-line parser and ``ParallelDims`` building the mesh where torchtitan
is installed (see tests/test_export_targets.py).  DeepSpeed and torch.distributed.pipelining have
neither axis: they refuse, with the plan without it as the nearest.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import tomllib

from planner.cost import Layout, estimate
from planner.export import ExportRefused, export_plan, problems
from planner.export import megatron as mg
from planner.export import torchtitan as tt
from planner.export.common import Decisions, ExpertLayer, PlanInfo
from planner.schema import Cluster, Plan, Profile, TrainingSetup
from profiler.decoder import DecoderSpec, MoESpec
from profiler.synth import synth_decoder
from tests.planner.test_export import read_megatron

STAGES = [(0, 3), (3, 6)]  # embed, blocks.0-1 | blocks.2-3, head


def _spec(moe: MoESpec | None = None) -> DecoderSpec:
    return DecoderSpec(layers=4, hidden=256, heads=4, seq=4096, vocab=1000, gated_mlp=True, norm="rmsnorm",
                       bias=False, positions="rotary", moe=moe)  # fmt: skip


@pytest.fixture(scope="module")
def dense() -> Profile:
    return synth_decoder(_spec(), microbatch_sizes=(1, 2))


@pytest.fixture(scope="module")
def moe() -> Profile:
    """Every block a mixture of 8 experts, top-2."""
    return synth_decoder(_spec(MoESpec(experts=8, top_k=2, expert_ffn=512)), microbatch_sizes=(1, 2))


def _plan(profile: Profile, *, c: int = 1, e: int = 1, t: int = 1, d: int = 2, sp: bool = False, zero: int = 0,
          attention: str = "all-gather") -> Plan:  # fmt: skip
    k, m = 2, 4
    cluster = Cluster.model_validate({"devices": k * d * t * c, "memory": "80GiB"})
    return estimate(
        profile, cluster, TrainingSetup(global_batch_size=m * d),
        Layout(STAGES, num_microbatches=m, data_parallel=d, pipeline_degree=k, tensor_parallel=t, zero_stage=zero,
               sequence_parallel=sp, context_parallel=c, expert_parallel=e, context_attention=attention),
    )  # fmt: skip


def _megatron(plan: Plan, profile: Profile) -> tuple[str, dict[str, str | None]]:
    text = export_plan(plan, "megatron", profile=profile)[0].files[0].text
    return text, read_megatron(text)


def _megatron_config(flags: dict[str, str | None]) -> Any:
    """megatron-core's TransformerConfig under the exported flags."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = "--num-experts" in flags
    return TransformerConfig(
        num_layers=4, hidden_size=256, num_attention_heads=4, pipeline_dtype=torch.bfloat16, add_bias_linear=False,
        pipeline_model_parallel_size=int(str(flags["--pipeline-model-parallel-size"])),
        tensor_model_parallel_size=int(str(flags["--tensor-model-parallel-size"])),
        sequence_parallel="--sequence-parallel" in flags,
        context_parallel_size=int(str(flags.get("--context-parallel-size") or 1)),
        cp_comm_type=flags.get("--cp-comm-type"),
        num_moe_experts=int(str(flags["--num-experts"])) if experts else None,
        moe_router_topk=int(str(flags.get("--moe-router-topk") or 2)),
        moe_ffn_hidden_size=512 if experts else None,
        expert_model_parallel_size=int(str(flags.get("--expert-model-parallel-size") or 1)),
    )  # fmt: skip


@contextmanager
def _fake_world(size: int) -> Iterator[None]:
    """A fake process group of ``size`` ranks (this process is rank 0): the targets build their
    groups and meshes on it without devices."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _megatron_groups(text: str, flags: dict[str, str | None]) -> tuple[list[int], list[int], int]:
    """megatron-core's parallel_state on the export's rank count: rank 0's context- and
    expert-parallel groups and the data-parallel size."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    world = int(text.split("# Megatron-LM flags. Launch ", 1)[1].split(" ", 1)[0])
    with _fake_world(world):
        ps.initialize_model_parallel(
            tensor_model_parallel_size=int(str(flags["--tensor-model-parallel-size"])),
            pipeline_model_parallel_size=int(str(flags["--pipeline-model-parallel-size"])),
            context_parallel_size=int(str(flags.get("--context-parallel-size") or 1)),
            expert_model_parallel_size=int(str(flags.get("--expert-model-parallel-size") or 1)),
            create_gloo_process_groups=False,
        )
        try:
            cp = dist.get_process_group_ranks(ps.get_context_parallel_group())
            ep = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
            return cp, ep, ps.get_data_parallel_world_size()
        finally:
            ps.destroy_model_parallel()


# --------------------------------------------------------------------------- Megatron-LM


@pytest.mark.parametrize(("attention", "comm"), [("all-gather", "all_gather"), ("ring", "p2p")])
def test_context_parallelism_reaches_megatron(dense: Profile, attention: str, comm: str) -> None:
    plan = _plan(dense, c=2, attention=attention)
    assert plan.context_parallel_degree == 2 and plan.world_size == 8
    text, flags = _megatron(plan, dense)
    assert flags["--context-parallel-size"] == "2" and flags["--cp-comm-type"] == comm
    assert "Launch 8 ranks (TP 1 x CP 2 x PP 2 x DP 2)" in text
    assert "--seq-length a multiple of 4" in text
    config = _megatron_config(flags)
    assert (config.context_parallel_size, config.cp_comm_type) == (2, comm)
    cp, _, dp = _megatron_groups(text, flags)
    assert cp == [0, 1] and dp == 2  # TP 1: the CP ranks are consecutive; DP is the plan's D


@pytest.mark.parametrize(("c", "e", "d"), [(1, 2, 2), (2, 2, 2), (2, 4, 2)])
def test_expert_parallelism_reaches_megatron_and_its_groups_hold_the_context_ranks_first(
    moe: Profile, c: int, e: int, d: int
) -> None:
    plan = _plan(moe, c=c, e=e, d=d)
    assert plan.expert_parallel_degree == e
    text, flags = _megatron(plan, moe)
    assert (flags["--num-experts"], flags["--moe-router-topk"], flags["--expert-model-parallel-size"]) == ("8", "2", str(e))
    config = _megatron_config(flags)
    assert (config.num_moe_experts, config.expert_model_parallel_size) == (8, e)
    cp, ep, _ = _megatron_groups(text, flags)
    assert len(cp) == c and set(cp) <= set(ep)
    assert ep == list(range(e))  # rank 0's expert group: the first E of the CP x DP ranks (TP 1)
    assert f"each MoE layer's experts sharded over {e} of the DP x CP ranks" in text


def test_expert_parallelism_with_tensor_parallelism_needs_sequence_parallelism_in_megatron(moe: Profile) -> None:
    with_sp = _plan(moe, e=2, t=2, sp=True)
    _, flags = _megatron(with_sp, moe)
    assert "--sequence-parallel" in flags and flags["--expert-model-parallel-size"] == "2"
    assert _megatron_config(flags).expert_model_parallel_size == 2
    without = _plan(moe, e=2, t=2, sp=False)
    with pytest.raises(ExportRefused, match="Megatron-LM requires --sequence-parallel with experts and TP > 1") as err:
        export_plan(without, "megatron", profile=moe)
    near = err.value.nearest
    assert near is not None and near.plan is not None and near.decisions.sequence_parallel
    assert "pipeplan plan PROFILE ... --sequence-parallel" in str(err.value)


def test_megatron_refuses_expert_degrees_it_cannot_set_up() -> None:
    """Decisions a plan's schema would refuse, given directly: E not dividing DP x CP, or the
    experts of a layer."""
    names = ["embed", "blocks.0", "blocks.1", "head"]
    d = Decisions(stages=((0, 2), (2, 4)), recompute=(False, False), schedule="1f1b", num_microbatches=2,
                  pipeline_degree=2, data_parallel=2, global_batch_size=4)  # fmt: skip
    experts = [ExpertLayer("blocks.0", 6, 2), ExpertLayer("blocks.1", 6, 2)]
    assert not mg.problems(d.replace(expert_parallel=2), names, experts=experts)
    found = mg.problems(d.replace(expert_parallel=4, context_parallel=2), names, experts=experts)
    assert [p.reason.split(":")[0] for p in found] == ["expert parallelism E=4 does not divide the 6 experts of a layer"]
    found = mg.problems(d.replace(expert_parallel=3), names, experts=experts)
    assert found[0].reason.startswith("expert parallelism E=3 does not divide DP x CP = 2 x 1 = 2")
    assert found[0].fix is not None and found[0].fix(d)[0][1].expert_parallel == 1


def test_without_the_profile_megatron_still_gets_the_expert_degree(moe: Profile) -> None:
    plan = _plan(moe, e=2)
    export, _ = export_plan(plan, "megatron")
    text = export.files[0].text
    flags = read_megatron(text)
    assert flags["--expert-model-parallel-size"] == "2" and "--num-experts" not in flags
    assert "Your model flags must set --num-experts" in text
    assert any("no profile given" in n for n in export.notes)


# --------------------------------------------------------------------------- torchtitan


def _torchtitan(plan: Plan, profile: Profile) -> tuple[str, dict[str, Any]]:
    text = export_plan(plan, "torchtitan", profile=profile)[0].files[0].text
    return text, tomllib.loads(text)


def _torchtitan_mesh(text: str, toml: dict[str, Any]) -> dict[str, list[int]] | None:
    """torchtitan's ParallelismConfig, command-line parser and ParallelDims mesh (on a fake process
    group of the export's rank count) for the fragment: rank 0's cp and ep groups; ``None`` where
    torchtitan is not installed."""
    if importlib.util.find_spec("torchtitan") is None:
        return None
    from dataclasses import field, make_dataclass

    import tyro
    from torchtitan.config import ConfigManager, ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import custom_registry
    from torchtitan.distributed.parallel_dims import ParallelDims

    ConfigManager()
    par = ParallelismConfig(**toml["parallelism"])  # keyword-only: unknown keys raise
    training = TrainingConfig(**toml["training"])
    job_type = make_dataclass("Job", [("training", TrainingConfig, field(default_factory=TrainingConfig)),
                                      ("parallelism", ParallelismConfig, field(default_factory=ParallelismConfig))],
                              kw_only=True)  # fmt: skip
    overrides = text.split("command-line overrides:\n#   ", 1)[1].split("\n", 1)[0].split(" ")
    overrides = [a for a in overrides if not a.startswith("activation-checkpoint:")]
    job = tyro.cli(job_type, args=overrides, registry=custom_registry)
    assert job.parallelism == par and job.training == training
    world = int(text.split("; launch ", 1)[1].split(" ", 1)[0])
    with _fake_world(world):
        dims = ParallelDims.from_config(par, world)
        dims.build_mesh()
        return {name: dims.get_mesh(name).mesh.flatten().tolist() for name in ("cp", "ep") if getattr(dims, f"{name}_enabled")}


def test_context_parallelism_reaches_torchtitan(dense: Profile) -> None:
    plan = _plan(dense, c=2)
    text, toml = _torchtitan(plan, dense)
    par = toml["parallelism"]
    assert par["context_parallel_degree"] == 2 and "expert_parallel_degree" not in par
    assert par["fsdp_reshard_after_forward"] == "never"  # ZeRO 0: FSDP over the C ranks keeps parameters whole
    assert "launch 8 ranks" in text and "torchtitan all-gathers K/V, as the plan" in text
    assert "--parallelism.context_parallel_degree 2" in text
    mesh = _torchtitan_mesh(text, toml)
    assert mesh is None or mesh["cp"] == [0, 1]


def test_torchtitan_refuses_ring_attention_with_all_gather_as_the_nearest(dense: Profile) -> None:
    plan = _plan(dense, c=2, attention="ring")
    with pytest.raises(ExportRefused, match="context parallelism C=2 with ring attention: torchtitan all-gathers K/V") as err:
        export_plan(plan, "torchtitan", profile=dense)
    near = err.value.nearest
    assert near is not None and near.plan is not None
    assert near.plan.context_attention == "all-gather" and near.plan.context_parallel_degree == 2
    assert "--context-attention all-gather" in str(err.value)


@pytest.mark.parametrize(("c", "e", "zero"), [(2, 2, 0), (1, 2, 1), (2, 4, 1)])
def test_expert_parallelism_reaches_torchtitan(moe: Profile, c: int, e: int, zero: int) -> None:
    plan = _plan(moe, c=c, e=e, zero=zero)
    text, toml = _torchtitan(plan, moe)
    par = toml["parallelism"]
    assert par["expert_parallel_degree"] == e and par.get("context_parallel_degree", 1) == c
    assert f"Expert parallelism E={e}" in text and "8 experts, top-2" in text
    mesh = _torchtitan_mesh(text, toml)
    if mesh is not None:  # torchtitan's expert group: the context-parallel ranks first, then FSDP ranks
        assert mesh["ep"] == list(range(e)) and set(mesh.get("cp", [0])) <= set(mesh["ep"])


def test_torchtitan_refuses_experts_it_would_place_otherwise(moe: Profile) -> None:
    replicated = _plan(moe, e=2, zero=0)  # ZeRO 0: data_parallel_replicate_degree lends no rank to EP
    found = problems(replicated, "torchtitan", profile=moe)
    assert found[0].reason.startswith("expert parallelism E=2 does not divide data_parallel_shard_degree x "
                                      "context_parallel_degree = 1 x 1 = 1")  # fmt: skip
    with pytest.raises(ExportRefused) as err:
        export_plan(replicated, "torchtitan", profile=moe)
    near = err.value.nearest
    assert near is not None and near.plan is not None
    assert (near.plan.zero_stage, near.plan.expert_parallel_degree) in {(1, 2), (0, 1)}
    export, used = export_plan(replicated, "torchtitan", profile=moe, use_nearest=True)
    assert used is not None and export.files[0].text
    if importlib.util.find_spec("torchtitan") is not None:  # written anyway, torchtitan's mesh has no room for it
        forced = tt.render(Decisions.from_plan(replicated), PlanInfo.from_plan(replicated, profile=moe)).files[0].text
        with pytest.raises(ValueError, match="unflatten"):
            _torchtitan_mesh(forced, tomllib.loads(forced))
    split = _plan(moe, e=2, t=2, sp=True, zero=1)  # experts split over T: torchtitan keeps them whole
    reasons = [p.reason for p in tt.problems(Decisions.from_plan(split), [n for s in split.stages for n in s.layer_names])]
    assert any(r.startswith("expert parallelism E=2 with tensor parallelism T=2") for r in reasons)


# --------------------------------------------------------------------------- DeepSpeed, torch


@pytest.mark.parametrize("target", ["deepspeed", "torch"])
def test_targets_without_the_axes_refuse_them_with_the_plan_without_them(dense: Profile, moe: Profile, target: str) -> None:
    with pytest.raises(ExportRefused, match=r"context parallelism C=2 \(all-gather attention\): .* has no context parallelism") as err:
        export_plan(_plan(dense, c=2), target, profile=dense)
    near = err.value.nearest
    assert near is not None and near.plan is not None and near.plan.context_parallel_degree == 1
    assert near.plan.world_size == 4 and "context parallelism off (C=1 instead of 2)" in str(err.value)
    with pytest.raises(ExportRefused, match=r"expert parallelism E=2: .* has no expert parallelism") as err:
        export_plan(_plan(moe, e=2), target, profile=moe)
    near = err.value.nearest
    assert near is not None and near.plan is not None and near.plan.expert_parallel_degree == 1
    assert "--expert-parallel 1" in str(err.value)
    # both axes: C off first; E=4 does not divide D=2 then, so it drops to 2, then off
    both = _plan(moe, c=2, e=4)
    with pytest.raises(ExportRefused) as err:
        export_plan(both, target, profile=moe)
    assert len(err.value.reasons) >= 2
    near = err.value.nearest
    assert near is not None and near.plan is not None
    assert (near.plan.context_parallel_degree, near.plan.expert_parallel_degree) == (1, 1)
    assert "and E=2 (E must divide D=2)" in str(err.value)


def test_plans_without_the_axes_export_as_before(dense: Profile) -> None:
    plan = _plan(dense)
    for target in ("megatron", "torchtitan", "deepspeed", "torch"):
        assert not problems(plan, target)
    _, flags = _megatron(plan, dense)
    assert not {"--context-parallel-size", "--cp-comm-type", "--expert-model-parallel-size"} & set(flags)
    _, toml = _torchtitan(plan, dense)
    assert not {"context_parallel_degree", "expert_parallel_degree", "fsdp_reshard_after_forward"} & set(toml["parallelism"])
