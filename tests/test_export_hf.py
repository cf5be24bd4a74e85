"""Hugging Face decoders end to end: profile -> plan -> `pipeplan export --to megatron|torchtitan`,
each export read back by the target's own parser (megatron-core's layout parser and
TransformerConfig; torchtitan's config classes and command-line parser where torchtitan is
installed, see tests/test_export_targets.py).

The name mapping runs on fake-tensor profiles of shrunk copies of the shipped configs (a few
decoder layers, a few seconds each): transformers' own module names (``model.embed_tokens``,
``model.rotary_emb``, ``model.layers.N``, ``model.norm``, ``lm_head``).  The full-size checks
(Llama 3 70B on 64 H100, Mixtral 8x7B on 32 H100) plan synth profiles of the full configs
(``profiler.hf_spec`` + ``profiler.synth``: the same formulas without torch), whose parameter
bytes must be the published parameter counts.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib

from pipeplan.cli import main
from planner.export import TARGETS, ExportRefused, export_plan, problems
from planner.export import megatron as mg
from planner.export import torchtitan as tt
from planner.export.common import Decisions, ExpertLayer
from planner.export.mapping import decoder_stack
from planner.schema import Plan, Profile, load_document
from tests.planner.test_export import _plan, megatron_stages, read_megatron

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"
SEQ = 1024
#: Megatron layer characters per Hugging Face name (``None``: places nothing), written out here
#: apart from planner/export/mapping.py
HF_CHARS = {"model.embed_tokens": "E", "model.rotary_emb": None, "model.norm": "L", "lm_head": "L"}


def _shrunk(tmp: Path, name: str, layers: int, **changes: Any) -> Path:
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, **changes)
    out = tmp / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _fake(config_dir: Path) -> Profile:
    pytest.importorskip("transformers")
    from profiler.fake import fake_profile
    from profiler.hf_config import hf_entrypoint

    profile: Profile = fake_profile(lambda: hf_entrypoint(str(config_dir), seq=SEQ), device_type="h100-80g", microbatch_sizes=(1, 2))
    return profile


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Profile:
    """Llama 3 70B with 8 decoder layers (model.embed_tokens, model.rotary_emb, 8 layers, model.norm, lm_head)."""
    return _fake(_shrunk(tmp_path_factory.mktemp("cfg"), "llama3-70b", 8))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Profile:
    """Mixtral 8x7B with 4 decoder layers, each with 8 experts, top-2."""
    return _fake(_shrunk(tmp_path_factory.mktemp("cfg"), "mixtral-8x7b", 4))


def _flow(tmp: Path, profile: Profile, plan_args: list[str], *, with_profile: bool = True) -> tuple[Plan, dict[str, str]]:
    """`pipeplan plan` then `pipeplan export --to megatron` and `--to torchtitan` (files written)."""
    prof = tmp / "profile.json"
    prof.write_text(profile.model_dump_json())
    plan_path = tmp / "plan.json"
    assert main(["plan", str(prof), *plan_args, "--time-limit", "2", "-o", str(plan_path)]) == 0
    plan: Plan = load_document("plan", str(plan_path))
    texts = {}
    for target in ("megatron", "torchtitan"):
        out = tmp / f"{target}.out"
        assert main(["export", str(plan_path), "--to", target, "-o", str(out), *(["--profile", str(prof)] if with_profile else [])]) == 0
        texts[target] = out.read_text()
    return plan, texts


def _hf_char(name: str) -> str | None:
    return "t" if re.fullmatch(r"model\.layers\.\d+", name) else HF_CHARS[name]


def _hf_fqn(name: str) -> list[str]:
    """torchtitan's module for a Hugging Face layer (its decoder: tok_embeddings, layers.N, norm, lm_head)."""
    m = re.fullmatch(r"model\.layers\.(\d+)", name)
    if m:
        return [f"layers.{m.group(1)}"]
    return {"model.embed_tokens": ["tok_embeddings"], "model.rotary_emb": [], "model.norm": ["norm"], "lm_head": ["lm_head"]}[name]


def check_megatron(text: str, plan: Plan, *, decoders: int, experts: tuple[int, int] | None) -> dict[str, str | None]:
    """The flags through megatron-core's layout parser and TransformerConfig, stage by stage
    against the plan's layer names; ``experts``: (experts, top-k) the flags must set."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_config import TransformerConfig

    flags = read_megatron(text)
    assert f"--num-layers {decoders}." in text
    k = int(str(flags["--pipeline-model-parallel-size"]))
    vpp = len(plan.stages) // k
    layout = flags.get("--pipeline-model-parallel-layout")
    expected = ["".join(c for n in s.layer_names if (c := _hf_char(n))) for s in plan.stages]
    expected = [re.sub("L+", "L", s) for s in expected]  # model.norm + lm_head: one loss head
    assert megatron_stages(flags, decoders) == expected
    if layout is not None:
        parsed = PipelineParallelLayerLayout.from_str(str(layout), k)
        parsed.validate_layer_layout(num_layers=decoders, mtp_num_layers=None)
        chars = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.loss: "L"}
        assert ["".join(chars[t] for t in parsed.layout[s % k][s // k]) for s in range(len(plan.stages))] == expected
    tp = int(str(flags["--tensor-model-parallel-size"]))
    config = TransformerConfig(
        num_layers=decoders, hidden_size=64 * tp, num_attention_heads=4 * tp, pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=k, pipeline_model_parallel_layout=layout,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 and layout is None else None,
        tensor_model_parallel_size=tp, sequence_parallel="--sequence-parallel" in flags,
        num_moe_experts=int(str(flags["--num-experts"])) if "--num-experts" in flags else None,
        moe_router_topk=int(str(flags.get("--moe-router-topk") or 2)),
        expert_model_parallel_size=int(str(flags.get("--expert-model-parallel-size") or 1)),
        moe_ffn_hidden_size=64 if "--num-experts" in flags else None,
        add_bias_linear=False,  # Hugging Face's Llama and Mixtral: no biases (Megatron's MoE needs none with ETP > 1)
    )  # fmt: skip
    if experts is None:
        assert config.num_moe_experts is None and "--moe-router-topk" not in flags
    else:
        assert (config.num_moe_experts, config.moe_router_topk, config.expert_model_parallel_size) == (*experts, 1)
    return flags


def check_torchtitan(text: str, plan: Plan, *, experts: bool) -> dict[str, Any]:
    """The fragment's parts are the plan's stages in torchtitan's names; torchtitan's own config
    classes and command-line parser read it where torchtitan is installed."""
    toml = tomllib.loads(text)
    par = toml["parallelism"]
    assert par["module_fqns_per_model_part"] == [[f for n in s.layer_names for f in _hf_fqn(n)] for s in plan.stages]
    assert ("expert_parallel_degree" in par) == experts
    if importlib.util.find_spec("torchtitan") is not None:
        from dataclasses import field, make_dataclass

        import tyro
        from torch.distributed.pipelining.schedules import get_schedule_class
        from torchtitan.config import ConfigManager, ParallelismConfig, TrainingConfig
        from torchtitan.config.manager import custom_registry
        from torchtitan.distributed.activation_checkpoint import (
            ActivationCheckpointingConfig,
            SelectiveAC,
        )

        ConfigManager()  # registers torchtitan's command-line rules (comma lists)
        job_type = make_dataclass(
            "Job",
            [
                ("training", TrainingConfig, field(default_factory=TrainingConfig)),
                ("parallelism", ParallelismConfig, field(default_factory=ParallelismConfig)),
                ("activation_checkpoint", ActivationCheckpointingConfig, field(default_factory=SelectiveAC.Config)),
            ],
            kw_only=True,
        )
        parsed = ParallelismConfig(**par)  # keyword-only dataclass: unknown keys raise
        training = TrainingConfig(**toml["training"])
        get_schedule_class(parsed.pipeline_parallel_schedule)
        overrides = text.split("command-line overrides:\n#   ", 1)[1].split("\n", 1)[0].split(" ")
        job = tyro.cli(job_type, args=overrides, registry=custom_registry)
        assert job.parallelism == parsed and job.training == training
        assert parsed.expert_parallel_degree == 1
    return toml


# --------------------------------------------------------------------------- shrunk configs, fake tensors


def test_llama_layers_map_onto_megatron_and_torchtitan(llama: Profile, tmp_path: Path) -> None:
    names = [layer.name for layer in llama.layers]
    assert names == ["model.embed_tokens", "model.rotary_emb", *[f"model.layers.{i}" for i in range(8)], "model.norm", "lm_head"]
    plan, texts = _flow(tmp_path, llama, ["--devices", "64", "--device-type", "h100-80g", "--devices-per-node", "8",
                                          "--batch-size", "256", "--tensor-parallel", "8", "--pipeline-degree", "4",
                                          "--schedules", "1f1b,interleaved-1f1b", "--zero", "0"])  # fmt: skip
    assert plan.pipeline_degree == 4 and plan.tensor_parallel_degree == 8
    check_megatron(texts["megatron"], plan, decoders=8, experts=None)
    check_torchtitan(texts["torchtitan"], plan, experts=False)


@pytest.mark.parametrize(
    "stages",
    [
        [(0, 1), (1, 6), (6, 12)],  # the rotary embedding starts stage 1
        [(0, 2), (2, 6), (6, 12)],  # it ends stage 0
        [(0, 3), (3, 10), (10, 12)],  # the head alone: model.norm + lm_head
    ],
)
def test_a_stage_may_start_or_stop_at_the_rotary_embedding(llama: Profile, stages: list[tuple[int, int]]) -> None:
    plan = _plan(llama, stages, m=6, batch=12)
    assert not problems(plan, "megatron") and not problems(plan, "torchtitan")
    check_megatron(export_plan(plan, "megatron")[0].files[0].text, plan, decoders=8, experts=None)
    check_torchtitan(export_plan(plan, "torchtitan")[0].files[0].text, plan, experts=False)


@pytest.mark.parametrize("target", ["megatron", "torchtitan"])
def test_a_stage_of_the_rotary_embedding_alone_is_refused_with_the_nearest_plan(llama: Profile, target: str) -> None:
    plan = _plan(llama, [(0, 1), (1, 2), (2, 12)], m=6, batch=12)
    with pytest.raises(ExportRefused, match=r"stage 1 holds only parameterless layers \(model\.rotary_emb\)") as refused:
        export_plan(plan, target, profile=llama)
    near = refused.value.nearest
    assert near is not None and near.plan is not None  # priced
    assert all(decoder_stack([n for s in plan.stages for n in s.layer_names]).stage_units(a, b) for a, b in near.decisions.stages)
    export, used = export_plan(plan, target, profile=llama, use_nearest=True)
    assert used is not None and export.files[0].text


def test_mixtral_experts_reach_megatron_and_torchtitan(mixtral: Profile, tmp_path: Path) -> None:
    assert [(layer.moe.experts, layer.moe.top_k) for layer in mixtral.layers if layer.moe] == [(8, 2)] * 4
    # E = 1 pinned: torchtitan cannot express E > 1 with T = 8, and the search may find one (with
    # tensor-parallel roles in the census, it finds E = 2, 18 % faster, which bounds excluded before)
    plan, texts = _flow(tmp_path, mixtral, ["--devices", "32", "--device-type", "h100-80g", "--devices-per-node", "8",
                                            "--batch-size", "128", "--tensor-parallel", "8", "--pipeline-degree", "2",
                                            "--schedule", "1f1b", "--zero", "0", "--expert-parallel", "1"])  # fmt: skip
    flags = check_megatron(texts["megatron"], plan, decoders=4, experts=(8, 2))
    assert "--moe-layer-freq" not in flags  # every decoder layer has experts
    toml = check_torchtitan(texts["torchtitan"], plan, experts=True)
    assert toml["parallelism"]["expert_parallel_degree"] == 1
    assert "8 experts, top-2" in texts["torchtitan"]


def test_without_the_profile_the_experts_are_unknown_and_the_cli_says_so(
    mixtral: Profile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, texts = _flow(tmp_path, mixtral, ["--devices", "32", "--device-type", "h100-80g", "--tensor-parallel", "8",
                                            "--batch-size", "64", "--pipeline-degree", "2", "--schedule", "1f1b",
                                            "--expert-parallel", "1"],  # torchtitan: no E > 1 with T = 8
                        with_profile=False)  # fmt: skip
    assert "--num-experts" not in texts["megatron"] and "expert_parallel_degree" not in texts["torchtitan"]
    err = capsys.readouterr().err
    assert "no profile given, so this megatron export has no mixture-of-experts settings" in err
    assert "--profile PROFILE" in err


def test_deepseek_dense_first_layers_are_megatrons_moe_layer_freq(tmp_path: Path) -> None:
    """DeepSeek-V3 shrunk to 1 dense + 2 MoE decoder layers (256 experts, top-8, 1 shared)."""
    profile = _fake(_shrunk(tmp_path, "deepseek-v3", 3, first_k_dense_replace=1))
    assert [layer.name for layer in profile.layers if layer.moe] == ["model.layers.1", "model.layers.2"]
    plan = _plan(profile, [(0, 3), (3, 7)], m=4, batch=8)
    text = export_plan(plan, "megatron", profile=profile)[0].files[0].text
    flags = check_megatron(text, plan, decoders=3, experts=(256, 8))
    assert flags["--moe-layer-freq"] == "([0]*1+[1]*2)"
    assert eval(str(flags["--moe-layer-freq"])) == [0, 1, 1]  # how Megatron-LM's moe_freq_type reads it
    assert "--moe-shared-expert-intermediate-size" in text  # the comment asks for the shared experts' size


def test_experts_that_differ_between_layers_are_refused() -> None:
    names = ["embed", "blocks.0", "blocks.1", "head"]
    d = Decisions(stages=((0, 2), (2, 4)), recompute=(False, False), schedule="1f1b", num_microbatches=2,
                  pipeline_degree=2, data_parallel=1, global_batch_size=2)  # fmt: skip
    same = [ExpertLayer("blocks.0", 8, 2), ExpertLayer("blocks.1", 8, 2)]
    assert not mg.problems(d, names, experts=same)
    assert mg.argv(d, names, experts=same)[-6:] == ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "1"]
    differ = [ExpertLayer("blocks.0", 8, 2), ExpertLayer("blocks.1", 16, 2)]
    for target in ("megatron", "torchtitan"):
        found = TARGETS[target].problems(d, names, experts=differ)
        assert found and "'blocks.0' has 8 experts, top-2 but layer 'blocks.1' has 16 experts, top-2" in found[0].reason
        assert found[0].fix is None
    outside = [ExpertLayer("head", 8, 2)]
    assert "is not a decoder layer" in mg.problems(d, names, experts=outside)[0].reason
    capacity = [ExpertLayer("blocks.0", 8, 2, capacity_factor=1.25), ExpertLayer("blocks.1", 8, 2, capacity_factor=1.25)]
    assert mg.argv(d, names, experts=capacity)[-3:] == ["--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity"]
    assert "dropless" in tt.problems(d, names, experts=capacity)[0].reason


# --------------------------------------------------------------------------- full size, synth


def _synth(name: str) -> Profile:
    from profiler.hf_spec import read_config, spec_from_config
    from profiler.synth import synth_decoder

    return synth_decoder(spec_from_config(read_config(CONFIGS / name), seq=8192), device_type="h100-80g", microbatch_sizes=(1, 2))


@pytest.mark.parametrize(
    ("name", "devices", "published", "decoders", "experts"),
    [("llama3-70b", 64, 70.6e9, 80, None), ("mixtral-8x7b", 32, 46.7e9, 32, (8, 2))],
)
def test_full_size_plans_hold_the_published_parameters_and_export(
    tmp_path: Path, name: str, devices: int, published: float, decoders: int, experts: tuple[int, int] | None
) -> None:
    profile = _synth(name)
    plan, texts = _flow(tmp_path, profile, ["--devices", str(devices), "--device-type", "h100-80g",
                                            "--devices-per-node", "8", "--batch-size", "256", "--tensor-parallel", "8",
                                            "--schedules", "1f1b,interleaved-1f1b", "--zero", "0"])  # fmt: skip
    total = sum(layer.param_bytes for layer in profile.layers)
    assert abs(total / (published * 2) - 1) < 0.005, (total / 2 / 1e9, published / 1e9)  # bf16: 2 bytes
    # a stage's param_bytes are one device's of its tensor-parallel group: T times them is the
    # model (a little more: the norms T=8 does not divide are on every device)
    assert plan.tensor_parallel_degree == 8
    per_device = sum(s.param_bytes for s in plan.stages)
    assert abs(per_device * 8 / (published * 2) - 1) < 0.005, (per_device * 8 / 2 / 1e9, published / 1e9)
    flags = check_megatron(texts["megatron"], _as_hf_check(plan), decoders=decoders, experts=experts)
    assert flags["--tensor-model-parallel-size"] == "8"
    toml = tomllib.loads(texts["torchtitan"])
    parts = toml["parallelism"]["module_fqns_per_model_part"]
    assert [f for part in parts for f in part] == ["tok_embeddings", *[f"layers.{i}" for i in range(decoders)], "norm", "lm_head"]
    assert len(parts) == len(plan.stages)


def _as_hf_check(plan: Plan) -> Plan:
    """The synth plan with Hugging Face names (embed -> model.embed_tokens, blocks.N ->
    model.layers.N, head -> lm_head), for :func:`check_megatron`'s independent mapping."""
    stages = [s.model_copy(update={"layer_names": [_hf_name(n) for n in s.layer_names]}) for s in plan.stages]
    return plan.model_copy(update={"stages": stages})


def _hf_name(synth: str) -> str:
    return {"embed": "model.embed_tokens", "head": "lm_head"}.get(synth, synth.replace("blocks.", "model.layers."))


# --------------------------------------------------------------------------- full size, fake tensors


@pytest.mark.parametrize(
    ("name", "devices", "t", "published", "decoders", "experts"),
    [("llama3-70b", 64, 8, 70.6e9, 80, None), ("mixtral-8x7b", 32, 2, 46.7e9, 32, (8, 2))],
)
def test_full_size_fake_profiles_hold_the_published_parameters_and_export(
    tmp_path: Path, name: str, devices: int, t: int, published: float, decoders: int, experts: tuple[int, int] | None
) -> None:
    """The issue's end to end at full size, as a user runs it: ``profile --fake --hf-config`` (one
    block of each kind traced, a few seconds), ``plan``, ``export`` to Megatron-LM and torchtitan.
    (Mixtral at T = 2: the profiler shards attention but not transformers' fused experts under
    tensor parallelism, so at T = 8 its experts, replicated on 8 devices, fit no 32-GPU plan.)"""
    import warnings

    pytest.importorskip("transformers")
    from profiler.fake import fake_profile
    from profiler.hf_config import hf_entrypoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = fake_profile(lambda: hf_entrypoint(str(CONFIGS / name), seq=8192), device_type="h100-80g",
                               microbatch_sizes=(1, 2))
    assert profile.metadata["profiler"]["repeated_blocks"]["blocks"] == decoders
    # (Megatron-LM's rules: sequence parallelism with T, recompute on every stage or none)
    within_megatron = ["--sequence-parallel", "--no-recompute"] if experts else []
    plan, texts = _flow(tmp_path, profile, ["--devices", str(devices), "--device-type", "h100-80g",
                                            "--devices-per-node", "8", "--batch-size", "256", "--tensor-parallel", str(t),
                                            "--schedules", "1f1b,interleaved-1f1b", "--zero", "0",
                                            *within_megatron])  # fmt: skip
    total = sum(layer.param_bytes for layer in profile.layers)
    assert abs(total / (published * 2) - 1) < 0.005, (total / 2 / 1e9, published / 1e9)  # bf16: 2 bytes
    assert plan.tensor_parallel_degree == t
    flags = check_megatron(texts["megatron"], plan, decoders=decoders, experts=experts)
    assert flags["--tensor-model-parallel-size"] == str(t)
    toml = tomllib.loads(texts["torchtitan"])
    parts = toml["parallelism"]["module_fqns_per_model_part"]
    assert [f for part in parts for f in part] == ["tok_embeddings", *[f"layers.{i}" for i in range(decoders)], "norm", "lm_head"]
