"""`pipeplan export`: every target reads back what it is given, refusals name the reason and price
the nearest plan, and the CLI answers with `error:` lines.  Torch-free: the framework parsers
are exercised in tests/test_export_targets.py."""

from __future__ import annotations

import ast
import json
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeplan.cli import main
from planner.cost import Layout, estimate, plan_fits, reestimate
from planner.errors import InputError
from planner.export import ExportRefused, export_plan, problems
from planner.export import megatron as mg
from planner.export.common import Decisions, PlanInfo
from planner.export.mapping import NotAStack, Unit, decoder_stack
from planner.schedules import placement_of, rank_stages
from planner.schema import (
    Cluster,
    Plan,
    PlanOptions,
    Profile,
    Schedule,
    TrainingSetup,
    load_document,
)
from profiler.synth import synth_transformer
from tests.planner.helpers import random_profile

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "profiles" / "tiny.json"  # embed, blocks.0-5, head
GPT_TINY = ROOT / "examples" / "profiles" / "gpt-tiny-cpu.json"  # embed, blocks.0-3, head
BUNDLED = ROOT / "planner" / "data" / "gpt-48l-10b.json"


def _profile(path: Path) -> Profile:
    loaded: Profile = load_document("profile", str(path))
    return loaded


def _renamed(profile: Profile, names: list[str]) -> Profile:
    layers = [layer.model_copy(update={"name": n}) for layer, n in zip(profile.layers, names, strict=True)]
    return Profile(model=profile.model, measured_on=profile.measured_on, microbatch_sizes=profile.microbatch_sizes, layers=layers)


def _plan(
    profile: Profile,
    stages: list[tuple[int, int]],
    *,
    k: int | None = None,
    m: int = 8,
    schedule: Schedule = "1f1b",
    recompute: bool | list[bool] = False,
    recompute_layers: Sequence[int | None] | None = None,
    d: int = 1,
    batch: int = 32,
    memory: str = "80GiB",
) -> Plan:
    kk = k or len(stages)
    cluster = Cluster.model_validate({"devices": kk * d, "memory": memory})
    return estimate(
        profile, cluster, TrainingSetup(global_batch_size=batch, optimizer="sgd"),
        Layout(
            stages,
            num_microbatches=m,
            schedule=schedule,
            recompute=recompute,
            recompute_layers=recompute_layers,
            data_parallel=d,
            pipeline_degree=kk,
        ),
    )


def _units(plan: Plan) -> list[list[Unit]]:
    stack = decoder_stack([n for s in plan.stages for n in s.layer_names])
    return [stack.stage_units(s.start, s.stop) for s in plan.stages]


# --------------------------------------------------------------------------- reading back each target


def read_megatron(text: str) -> dict[str, str | None]:
    """The flags of a megatron export, from its bash array."""
    body = text.split("PIPEPLAN_MEGATRON_ARGS=(\n", 1)[1].split("\n)", 1)[0]
    flags: dict[str, str | None] = {}
    for line in body.splitlines():
        parts = line.strip().split(" ", 1)
        flags[parts[0]] = ast.literal_eval(parts[1]) if len(parts) > 1 and parts[1].startswith("'") else (parts[1] if len(parts) > 1 else None)
    return flags


def decoders_checkpointed(plan: Plan) -> list[int]:
    """Per stage, how many decoder layers its first ``checkpointed_layers`` layers hold whole."""
    stack = decoder_stack([n for s in plan.stages for n in s.layer_names])
    out = []
    for stage in plan.stages:
        end = stage.start + stage.checkpointed_layers
        rest = stack.units[end : stage.stop]
        out.append(len({u for u in stack.units[stage.start : end] if u.kind == "decoder" and u not in rest}))
    return out


def flags_checkpoint(flags: dict[str, str | None], units: list[list[Unit]]) -> list[int]:
    """Per stage, the decoder layers Megatron checkpoints under ``flags``: all of them with
    ``--recompute-method uniform`` (``--recompute-num-layers 1``), the first N with ``block``
    (megatron/core/transformer/transformer_block.py ``_checkpointed_forward``), none without."""
    decoders = [sum(u.kind == "decoder" for u in stage) for stage in units]
    method = flags.get("--recompute-method")
    if flags.get("--recompute-granularity") != "full":
        return [0] * len(units)
    n = int(str(flags["--recompute-num-layers"]))
    if method == "uniform":
        assert n == 1  # one layer per checkpoint: each layer its own
        return decoders
    assert method == "block", flags
    return [min(n, k) for k in decoders]


def megatron_stages(flags: dict[str, str | None], num_decoder: int) -> list[str]:
    """Per-stage layer characters, from the layout or from Megatron's even split."""
    if "--pipeline-model-parallel-layout" in flags:
        return mg.expand_layout(str(flags["--pipeline-model-parallel-layout"]))
    k = int(str(flags["--pipeline-model-parallel-size"]))
    v = int(str(flags.get("--num-virtual-stages-per-pipeline-rank") or 1))
    n = num_decoder // (k * v)
    out = ["t" * n for _ in range(k * v)]
    out[0] = "E" + out[0]
    out[-1] += "L"
    return out


def read_python_constants(text: str) -> dict[str, object]:
    """Module-level constants of a torch export (SPLIT_SPEC keys, literals), without importing torch."""
    out: dict[str, object] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "SPLIT_SPEC" and isinstance(node.value, ast.Dict):  # values are SplitPoint.BEGINNING
                assert all(ast.unparse(v) == "SplitPoint.BEGINNING" for v in node.value.values)
                out[name] = [ast.literal_eval(key) for key in node.value.keys if key is not None]
            elif isinstance(node.value, ast.Name):
                out[name] = node.value.id
            else:
                out[name] = ast.literal_eval(node.value)
    return out


def check_round_trip(plan: Plan) -> None:
    """Export ``plan`` to every target that can express it and read each file back."""
    names = [n for s in plan.stages for n in s.layer_names]
    k, d, m, b = plan.pipeline_degree, plan.data_parallel_degree, plan.num_microbatches, plan.microbatch_size
    for target in ("megatron", "torchtitan", "deepspeed", "torch"):
        if problems(plan, target):
            with pytest.raises(ExportRefused):
                export_plan(plan, target)
            continue
        export, near = export_plan(plan, target)
        assert near is None
        text = export.files[0].text
        if target == "megatron":
            flags = read_megatron(text)
            stack = decoder_stack(names)
            stages = megatron_stages(flags, stack.num_decoder_layers)
            assert len(stages) == len(plan.stages) and len(stages) % k == 0
            assert "".join(stages) == "E" + "t" * stack.num_decoder_layers + "L"  # every layer once, in order
            for s, chars in enumerate(stages):  # stage s of the flat list is plan stage s (rank s % K)
                assert chars == "".join(mg.LAYER_CHARS[u.kind] for u in _units(plan)[s])
            assert flags["--pipeline-model-parallel-size"] == str(k)
            assert int(str(flags["--micro-batch-size"])) == b
            assert int(str(flags["--global-batch-size"])) == b * m * d == plan.global_batch_size
            assert flags_checkpoint(flags, _units(plan)) == decoders_checkpointed(plan)
        elif target == "torchtitan":
            toml = tomllib.loads(text)
            par, tr = toml["parallelism"], toml["training"]
            parts = par["module_fqns_per_model_part"]
            assert par["pipeline_parallel_degree"] == k and len(parts) == len(plan.stages)
            flat = [f for part in parts for f in part]
            n_dec = decoder_stack(names).num_decoder_layers
            assert flat == ["tok_embeddings", *[f"layers.{i}" for i in range(n_dec)], "norm", "lm_head"]
            for part, units in zip(parts, _units(plan), strict=True):
                assert [f for u in units for f in (["tok_embeddings"] if u.kind == "embedding" else [f"layers.{u.index}"] if u.kind == "decoder" else ["norm", "lm_head"])] == part
            assert tr["local_batch_size"] == b * m and tr["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == m
            assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == d
            assert toml["activation_checkpoint"]["mode"] == ("full" if any(decoders_checkpointed(plan)) else "none")
        elif target == "deepspeed":
            cfg = json.loads(text)
            planned = cfg["pipeline"]["pipeplan"]
            assert planned["parts"] == [s.start for s in plan.stages] + [plan.num_layers]
            assert planned["layer_names"] == names and planned["recompute"] == [s.recompute for s in plan.stages]
            assert cfg["pipeline"]["stages"] == k
            assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * d
            assert cfg["gradient_accumulation_steps"] == m
        else:
            consts = read_python_constants(text)
            assert consts["SPLIT_SPEC"] == [s.layer_names[0] for s in plan.stages[1:]]
            assert consts["NUM_STAGES"] == len(plan.stages)
            assert consts["STAGE_LAYERS"] == [s.layer_names for s in plan.stages]
            stages_of_rank = consts["STAGES_OF_RANK"]
            assert isinstance(stages_of_rank, dict)
            assert sorted(s for ss in stages_of_rank.values() for s in ss) == list(range(len(plan.stages)))
            placement = placement_of(plan.schedule)
            assert stages_of_rank == dict(enumerate(rank_stages(placement, k, len(plan.stages) // k)))
            if placement == "loop":
                assert all(s % k == r for r, ss in stages_of_rank.items() for s in ss)
            assert consts["NUM_MICROBATCHES"] == m and consts["MICROBATCH_SIZE"] == b
            assert consts["RECOMPUTE_STAGES"] == [s.index for s in plan.stages if s.recompute]
            assert consts["RECOMPUTE_LAYERS"] == [s.checkpointed_layers for s in plan.stages]


# --------------------------------------------------------------------------- round trips


def _random_split(rng: random.Random, n: int, parts: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, n), parts - 1))
    return list(zip([0, *cuts], [*cuts, n], strict=True))


@pytest.mark.parametrize("path", [TINY, GPT_TINY, BUNDLED])
def test_zoo_plans_round_trip(path: Path) -> None:
    profile = _profile(path)
    n = profile.num_layers
    rng = random.Random(n)
    for _ in range(6):
        k = rng.randint(1, min(4, n))
        v = rng.choice([1, 2]) if 2 * k <= n else 1
        schedule: Schedule = "interleaved-1f1b" if v > 1 else rng.choice(["1f1b", "gpipe"])
        stages = _random_split(rng, n, k * v)
        recompute = rng.choice([False, True, [rng.random() < 0.5 for _ in stages]])
        partial = [rng.randint(0, b - a) for a, b in stages] if rng.random() < 0.5 else None
        plan = _plan(profile, stages, k=k, m=2 * k, schedule=schedule, recompute=recompute, recompute_layers=partial,
                     d=rng.choice([1, 2]), batch=16 * k)  # fmt: skip
        check_round_trip(plan)


def test_solver_plan_of_the_bundled_model_round_trips() -> None:
    """The README's plan (interleaved, K=4 x D=2) exports to megatron, torchtitan and torch as is."""
    from planner.solver import solve

    profile = _profile(BUNDLED)
    cluster = Cluster.model_validate({"devices": 8, "device_type": "h100-80g"})
    plan = solve(profile, cluster, TrainingSetup(global_batch_size=64), PlanOptions(time_limit_s=1))
    check_round_trip(plan)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 40), st.integers(1, 4), st.integers(1, 3), st.randoms(use_true_random=False))
def test_synth_plans_round_trip(blocks: int, k: int, v: int, rng: random.Random) -> None:
    profile = synth_transformer(layers=blocks, hidden=256, heads=4, seq=128, vocab=1000, name=f"synth-{blocks}")
    n = profile.num_layers
    if k * v > n:
        v = 1
        k = min(k, n)
    stages = _random_split(rng, n, k * v)
    schedule: Schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    plan = _plan(profile, stages, k=k, m=2 * k, schedule=schedule, recompute=rng.choice([False, True]), batch=8 * k)
    check_round_trip(plan)


# --------------------------------------------------------------------------- the megatron layout


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="t", max_size=9), min_size=1, max_size=12), st.booleans(), st.booleans())
def test_layout_encoding_expands_to_the_stages(middle: list[str], e_alone: bool, l_alone: bool) -> None:
    stages = list(middle)
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    if e_alone:
        stages.insert(0, "E")
        stages[1] = stages[1][1:] or "t"
    if l_alone:
        stages.append("L")
        stages[-2] = stages[-2][:-1] or "t"
    text = mg.encode_layout(stages)
    assert mg.expand_layout(text) == stages
    assert len(text) <= len("|".join(stages)) + 4


def test_layout_examples() -> None:
    assert mg.encode_layout(["Ettt", "ttt", "ttt", "tttL"]) == "Et*3|(t*3|)*2t*3L"
    assert mg.encode_layout(["Et", "tt", "tt", "ttL"]) == "Et|tt|tt|ttL"  # a repeat only where not longer
    assert mg.encode_layout(["Et", "tt", "tt", "tt", "ttL"]) == "Et|(tt|)*3ttL"
    assert mg.encode_layout(["E", "tttt", "tttt", "tttt", "L"]) == "E|(t*4|)*3L"
    assert mg.expand_layout("Et*3|(tt|)*29,m|L")[1:3] == ["tt", "tt"]
    assert mg.is_even_split(["Ettt", "ttt", "tttL"], 9) and not mg.is_even_split(["Ett", "tttt", "tttL"], 9)


# --------------------------------------------------------------------------- layer-name mapping


def test_mapping_reads_common_decoder_names() -> None:
    hf = ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"]
    stack = decoder_stack(hf)
    assert stack.container == "transformer.h." and stack.num_decoder_layers == 2
    assert [u.kind for u in stack.units] == ["embedding"] * 3 + ["decoder"] * 2 + ["head"] * 2
    titan = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "lm_head"]
    assert [str(u) for u in decoder_stack(titan).units][1:4] == ["decoder layer 0", "decoder layer 1", "decoder layer 2"]
    parts = ["embed", "blocks.0.ln1", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "head"]
    stack = decoder_stack(parts)
    assert stack.num_decoder_layers == 2 and not stack.starts_unit(2) and stack.starts_unit(4)


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        (["stem", "cells.0", "cells.1", "classifier"], "'stem' comes before the decoder layers"),
        (["embed", "blocks.0", "blocks.1", "classifier"], "'classifier' comes after the decoder layers"),
        (["embed", "blocks.0", "pool", "blocks.1", "head"], "'pool' sits between the decoder layers"),
        (["embed", "blocks.0", "blocks.0#1", "head"], "second call of module 'blocks.0'"),
        (["blocks.0", "blocks.1", "head"], "no embedding layer"),
        (["embed", "blocks.0", "blocks.1"], "no head layer"),
        (["embed", "mlp", "head"], "no layer is named like a decoder layer"),
    ],
)
def test_mapping_refuses_unknown_structure(names: list[str], fragment: str) -> None:
    with pytest.raises(NotAStack, match=fragment.replace("(", r"\(")):
        decoder_stack(names)


# --------------------------------------------------------------------------- refusals and the nearest plan


def test_gpipe_is_refused_by_megatron_and_the_nearest_plan_is_priced() -> None:
    profile = _profile(TINY)
    stages = [(0, 3), (3, 5), (5, 8)]
    plan = _plan(profile, stages, m=6, schedule="gpipe", batch=12)
    with pytest.raises(ExportRefused) as err:
        export_plan(plan, "megatron", profile=profile)
    assert "schedule 'gpipe'" in str(err.value) and "no GPipe schedule" in str(err.value)
    near = err.value.nearest
    assert near is not None and near.plan is not None
    expected = _plan(profile, stages, m=6, schedule="1f1b", batch=12)
    assert near.plan.predicted.step_time_ms == pytest.approx(expected.predicted.step_time_ms)
    assert f"{expected.predicted.step_time_ms:.2f} ms" in str(err.value)
    export, used = export_plan(plan, "megatron", profile=profile, use_nearest=True)
    assert used is not None and used.decisions.schedule == "1f1b"
    assert "--pipeline-model-parallel-size 3" in export.files[0].text


def test_gpipe_with_too_few_microbatches_gets_enough_for_1f1b() -> None:
    profile = _profile(TINY)
    plan = _plan(profile, [(0, 2), (2, 4), (4, 6), (6, 8)], m=2, schedule="gpipe", batch=8)
    with pytest.raises(ExportRefused) as err:
        export_plan(plan, "deepspeed", profile=profile)
    near = err.value.nearest
    assert near is not None and near.decisions.num_microbatches == 4  # smallest M >= K that splits 8
    assert "M=4 (1F1B needs M >= K=4)" in str(err.value)


@pytest.mark.parametrize("target", ["megatron", "torchtitan"])
def test_mixed_recompute_is_refused_and_the_faster_uniform_choice_that_fits_is_offered(target: str) -> None:
    profile = _profile(TINY)
    stages = [(0, 2), (2, 4), (4, 6), (6, 8)]
    for memory in ("1GiB", "33MiB"):
        plan = _plan(profile, stages, recompute=[True, False, True, False], memory=memory)
        with pytest.raises(ExportRefused) as err:
            export_plan(plan, target, profile=profile)
        message = str(err.value)
        assert "stage(s) 0,2 recompute but stage(s) 1,3 do not" in message
        near = err.value.nearest
        assert near is not None and near.plan is not None
        on = _plan(profile, stages, recompute=True, memory=memory)
        off = _plan(profile, stages, recompute=False, memory=memory)
        fitting = [p for p in (on, off) if plan_fits(p)]
        best = min(fitting or [on, off], key=lambda p: p.predicted.step_time_ms)
        assert [s.recompute for s in near.plan.stages] == [s.recompute for s in best.stages]
        assert near.plan.predicted.step_time_ms == pytest.approx(best.predicted.step_time_ms)
    # the two memory limits must make different choices, or the test shows nothing
    assert plan_fits(_plan(profile, stages, recompute=False, memory="1GiB"))
    assert not plan_fits(_plan(profile, stages, recompute=False, memory="33MiB"))
    assert plan_fits(_plan(profile, stages, recompute=True, memory="33MiB"))


def test_recompute_of_stages_without_decoder_layers_does_not_matter_to_megatron() -> None:
    profile = _profile(TINY)
    plan = _plan(profile, [(0, 1), (1, 4), (4, 7), (7, 8)], recompute=[False, True, True, True])
    export, _ = export_plan(plan, "megatron")
    flags = read_megatron(export.files[0].text)
    assert flags["--recompute-method"] == "uniform" and flags["--pipeline-model-parallel-layout"] == "E|(t*3|)*2L"
    # nor does a stage that checkpoints only its embedding: Megatron never checkpoints it
    embedding_only = _plan(profile, [(0, 3), (3, 8)], recompute_layers=[1, 0])
    assert embedding_only.stages[0].recompute and not problems(embedding_only, "megatron")
    assert "--recompute-granularity" not in read_megatron(export_plan(embedding_only, "megatron")[0].files[0].text)


def test_the_same_partial_recompute_on_every_stage_is_megatrons_block_method() -> None:
    """Each stage checkpoints its first decoder layer (stage 0 also its embedding before it):
    Megatron's ``--recompute-method block --recompute-num-layers 1``; the torch export lists
    the counts; torchtitan (every block or none) and DeepSpeed (every layer of a stage or none)
    refuse it and offer full recompute or none."""
    profile = _profile(TINY)  # embed, blocks.0-5, head
    plan = _plan(profile, [(0, 3), (3, 5), (5, 8)], m=6, batch=12, recompute_layers=[2, 1, 1])
    assert [s.checkpointed_layers for s in plan.stages] == [2, 1, 1]
    flags = read_megatron(export_plan(plan, "megatron")[0].files[0].text)
    assert (flags["--recompute-granularity"], flags["--recompute-method"], flags["--recompute-num-layers"]) == ("full", "block", "1")
    assert flags_checkpoint(flags, _units(plan)) == decoders_checkpointed(plan) == [1, 1, 1]
    consts = read_python_constants(export_plan(plan, "torch")[0].files[0].text)
    assert consts["RECOMPUTE_LAYERS"] == [2, 1, 1] and consts["RECOMPUTE_STAGES"] == [0, 1, 2]
    for target, reason in (("torchtitan", 'mode = "full" checkpoints every transformer block'),
                           ("deepspeed", "activation_checkpoint_interval checkpoints every layer")):  # fmt: skip
        with pytest.raises(ExportRefused, match=reason) as err:
            export_plan(plan, target, profile=profile)
        near = err.value.nearest
        assert near is not None and near.plan is not None
        assert not problems(near.plan, target)
        assert near.decisions.checkpointed_layers in ((3, 2, 3), (0, 0, 0))
        assert [s.checkpointed_layers for s in near.plan.stages] == list(near.decisions.checkpointed_layers)
    # a stage with fewer decoder layers than N checkpoints all of them, as Megatron's block method does
    fewer = _plan(profile, [(0, 3), (3, 4), (4, 8)], m=6, batch=12, recompute_layers=[3, 1, 2])
    flags = read_megatron(export_plan(fewer, "megatron")[0].files[0].text)
    assert (flags["--recompute-method"], flags["--recompute-num-layers"]) == ("block", "2")
    assert flags_checkpoint(flags, _units(fewer)) == decoders_checkpointed(fewer) == [2, 1, 2]


def test_unequal_partial_recompute_is_refused_by_megatron_with_the_largest_count_or_none() -> None:
    """Stage 0 checkpoints 1 of its 3 decoder layers, stage 1 2 of 3: no single N says it; the
    nearest plans are the first 2 on every stage (block 2) or none, the faster one that fits."""
    profile = _profile(TINY)
    stages = [(0, 4), (4, 8)]
    # a memory whose limit lies between the peaks of the two candidates: block 2 fits, none does not
    block, off = (_plan(profile, stages, recompute_layers=rl, memory="1GiB") for rl in ([3, 2], [0, 0]))
    peak = [max(s.memory_bytes for s in p.stages) for p in (block, off)]
    usable = block.stages[0].memory_limit_bytes / 2**30  # the share of a device's memory a plan may use
    tight = f"{(peak[0] + peak[1]) / 2 / usable:.0f}B"
    for memory in ("1GiB", tight):
        plan = _plan(profile, stages, recompute_layers=[2, 2], memory=memory)
        with pytest.raises(ExportRefused) as err:
            export_plan(plan, "megatron", profile=profile)
        assert "the stages checkpoint 1 of 3, 2 of 3 decoder layers" in str(err.value)
        assert "--no-recompute" in str(err.value)
        near = err.value.nearest
        assert near is not None and near.plan is not None
        block = _plan(profile, stages, recompute_layers=[3, 2], memory=memory)  # embed + blocks.0-1 | blocks.3-4
        off = _plan(profile, stages, memory=memory)
        fitting = [p for p in (block, off) if plan_fits(p)]
        best = min(fitting or [block, off], key=lambda p: p.predicted.step_time_ms)
        assert [s.checkpointed_layers for s in near.plan.stages] == [s.checkpointed_layers for s in best.stages]
        assert near.plan.predicted.step_time_ms == pytest.approx(best.predicted.step_time_ms)
        export, _ = export_plan(plan, "megatron", profile=profile, use_nearest=True)
        flags = read_megatron(export.files[0].text)
        assert flags_checkpoint(flags, _units(near.plan)) == decoders_checkpointed(near.plan)
    # the two memory limits must make different choices, or the test shows nothing
    assert plan_fits(_plan(profile, stages, memory="1GiB"))
    assert not plan_fits(_plan(profile, stages, memory=tight))
    assert plan_fits(_plan(profile, stages, recompute_layers=[3, 2], memory=tight))


def test_a_checkpoint_count_that_ends_inside_a_decoder_layer_rounds_to_whole_layers() -> None:
    """A profile cut inside the blocks (split points): checkpointing the first part of a block
    is not something Megatron can say; the fix rounds down (not even the embedding: Megatron
    never checkpoints it) or up (the whole block), and the nearest plan is then block 1 or none."""
    names = ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "blocks.2.attn", "blocks.2.mlp", "head"]
    profile = _renamed(_profile(TINY), names)
    plan = _plan(profile, [(0, 3), (3, 8)], recompute_layers=[2, 2])  # embed + blocks.0.attn | blocks.1
    found = mg.problems(Decisions.from_plan(plan), names)
    assert [p.reason for p in found] == ["stage 0 checkpoints its first 2 layers, which end inside a decoder layer: "
                                         "Megatron checkpoints whole decoder layers"]  # fmt: skip
    assert found[0].fix is not None
    assert [d.checkpointed_layers for _, d in found[0].fix(Decisions.from_plan(plan))] == [(0, 2), (3, 2)]
    with pytest.raises(ExportRefused) as err:
        export_plan(plan, "megatron", profile=profile)
    near = err.value.nearest
    assert near is not None and near.decisions.checkpointed_layers in ((3, 2), (0, 0))
    assert not mg.problems(near.decisions, names)


def test_interleaved_is_refused_by_deepspeed_and_its_chunks_merge() -> None:
    profile = _profile(BUNDLED)
    stages = _random_split(random.Random(3), profile.num_layers, 8)
    plan = _plan(profile, stages, k=4, m=8, schedule="interleaved-1f1b", batch=32)
    with pytest.raises(ExportRefused) as err:
        export_plan(plan, "deepspeed", profile=profile)
    assert "interleaved-1f1b with 2 chunks per rank" in str(err.value)
    near = err.value.nearest
    assert near is not None and near.plan is not None
    merged = [(stages[2 * r][0], stages[2 * r + 1][1]) for r in range(4)]
    assert list(near.decisions.stages) == merged and near.decisions.schedule == "1f1b"
    assert near.plan.predicted.step_time_ms == pytest.approx(_plan(profile, merged, m=8, batch=32).predicted.step_time_ms)
    export, _ = export_plan(plan, "deepspeed", profile=profile, use_nearest=True)
    assert json.loads(export.files[0].text)["pipeline"]["pipeplan"]["parts"] == [a for a, _ in merged] + [profile.num_layers]


def test_a_cut_inside_a_block_moves_to_the_nearest_block_boundary() -> None:
    names = ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "blocks.2.attn", "blocks.2.mlp", "head"]
    profile = _renamed(_profile(TINY), names)
    plan = _plan(profile, [(0, 2), (2, 6), (6, 8)], m=4, batch=8)  # cuts blocks.0 and blocks.2
    for target in ("megatron", "torchtitan"):
        with pytest.raises(ExportRefused) as err:
            export_plan(plan, target, profile=profile)
        assert "layer 2 ('blocks.0.mlp') cuts decoder layer 0 in two" in str(err.value)
        near = err.value.nearest
        assert near is not None and near.plan is not None
        assert list(near.decisions.stages) == [(0, 1), (1, 5), (5, 8)]  # ties go to the earlier boundary
        assert near.plan.predicted.step_time_ms == pytest.approx(_plan(profile, [(0, 1), (1, 5), (5, 8)], m=4, batch=8).predicted.step_time_ms)
    export, _ = export_plan(plan, "torch")  # torch splits at any named module
    assert read_python_constants(export.files[0].text)["SPLIT_SPEC"] == ["blocks.0.mlp", "blocks.2.mlp"]
    export, _ = export_plan(plan, "megatron", profile=profile, use_nearest=True)
    assert read_megatron(export.files[0].text)["--pipeline-model-parallel-layout"] == "E|tt|tL"


def test_a_model_that_is_not_a_decoder_stack_has_no_megatron_plan() -> None:
    names = ["stem", "stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1", "stages.2.0", "pool", "fc"]
    profile = _renamed(_profile(TINY), names)
    plan = _plan(profile, [(0, 4), (4, 8)])
    for target in ("megatron", "torchtitan"):
        with pytest.raises(ExportRefused) as err:
            export_plan(plan, target, profile=profile)
        assert "'stem' comes before the decoder layers" in str(err.value) and err.value.nearest is None
        assert "try --to torch or --to deepspeed" in str(err.value)
    check_round_trip(plan)  # deepspeed and torch place any layer list


def test_torch_refuses_a_split_at_a_second_call() -> None:
    names = ["embed", "blocks.0", "blocks.1", "shared", "blocks.2", "shared#1", "blocks.3", "head"]
    profile = _renamed(_profile(TINY), names)
    plan = _plan(profile, [(0, 5), (5, 8)], m=4, batch=8)
    with pytest.raises(ExportRefused) as err:
        export_plan(plan, "torch", profile=profile)
    assert "'shared#1'" in str(err.value)
    assert err.value.nearest is not None and list(err.value.nearest.decisions.stages) == [(0, 4), (4, 8)]


def test_without_a_profile_the_nearest_plan_is_named_but_not_priced() -> None:
    plan = _plan(_profile(TINY), [(0, 4), (4, 8)], schedule="gpipe")
    with pytest.raises(ExportRefused) as err:
        export_plan(plan, "megatron")
    assert "not priced: give the model's profile (--profile PROFILE)" in str(err.value)


def test_a_profile_of_another_model_is_refused() -> None:
    plan = _plan(_profile(TINY), [(0, 4), (4, 8)], schedule="gpipe")
    with pytest.raises(InputError, match="is not the model this plan was made for"):
        export_plan(plan, "megatron", profile=_profile(GPT_TINY))


def test_mesh_axes_are_read_when_the_plan_carries_them() -> None:
    plan = _plan(_profile(TINY), [(0, 4), (4, 8)], d=2)
    meshed = plan.model_copy(update={"tensor_parallel_degree": 2, "zero_stage": 1, "sequence_parallel": True})
    flags = read_megatron(export_plan(meshed, "megatron")[0].files[0].text)
    assert flags["--tensor-model-parallel-size"] == "2" and "--sequence-parallel" in flags and "--use-distributed-optimizer" in flags
    par = tomllib.loads(export_plan(meshed, "torchtitan")[0].files[0].text)["parallelism"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"], par["tensor_parallel_degree"]) == (2, 1, 2)
    assert json.loads(export_plan(meshed, "deepspeed")[0].files[0].text)["zero_optimization"]["stage"] == 1
    zero2 = plan.model_copy(update={"zero_stage": 2})
    with pytest.raises(ExportRefused, match="ZeRO stages 0 and 1 only") as err:
        export_plan(zero2, "deepspeed", profile=_profile(TINY))
    assert err.value.nearest is not None and err.value.nearest.decisions.zero_stage == 1
    priced = err.value.nearest.plan
    assert priced is not None and priced.zero_stage == 1 and priced.data_parallel_degree == 2
    assert priced == reestimate(priced, _profile(TINY))  # the nearest plan is priced with its mesh axes
    assert "--use-distributed-optimizer" in export_plan(zero2, "megatron")[0].files[0].text


def test_selective_recompute_is_exported_or_refused() -> None:
    profile = _profile(TINY)
    plan = _plan(profile, [(0, 4), (4, 8)], d=2).model_copy(update={"selective_recompute": True})
    text = export_plan(plan, "megatron")[0].files[0].text
    assert "--recompute-granularity selective" in text and "--recompute-granularity full" not in text
    assert tomllib.loads(export_plan(plan, "torchtitan")[0].files[0].text)["activation_checkpoint"]["mode"] == "selective"
    assert "SELECTIVE_RECOMPUTE = True" in export_plan(plan, "torch")[0].files[0].text
    with pytest.raises(ExportRefused, match="recomputes whole layers") as err:
        export_plan(plan, "deepspeed")
    assert "--no-selective-recompute" in str(err.value)
    assert err.value.nearest is not None and not err.value.nearest.decisions.selective_recompute


def test_an_action_list_is_written_as_a_schedule_csv() -> None:
    plan = _plan(_profile(TINY), [(0, 4), (4, 8)], m=2, batch=8)
    d = Decisions.from_plan(plan).replace(actions=(("0F0", "0F1", "0B0", "0B1"), ("1F0", "1B0", "1F1", "1B1")))
    from planner.export import torch_pipelining, torchtitan

    info = PlanInfo.from_plan(plan)
    export = torchtitan.render(d, info, output="tt.toml")
    toml = tomllib.loads(export.files[0].text)["parallelism"]
    assert toml["pipeline_parallel_schedule_csv"] == "tt.toml.schedule.csv" and toml["pipeline_parallel_schedule"] == "PipelineScheduleSingle"
    assert export.files[1].suffix == ".schedule.csv" and export.files[1].text == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    assert "_PipelineScheduleRuntime" in torch_pipelining.render(d, info).files[0].text
    assert mg.problems(d, info.layer_names)[0].reason.startswith("the plan carries its own action list")


# --------------------------------------------------------------------------- golden files


GOLDEN = ROOT / "tests" / "golden" / "export"


def _golden_plans() -> dict[str, Plan]:
    tiny = _profile(TINY)
    return {
        "tiny-1f1b": _plan(tiny, [(0, 3), (3, 5), (5, 8)], m=6, recompute=True, batch=12),
        "bundled-interleaved": _plan(_profile(BUNDLED), [(0, 7), (7, 13), (13, 19), (19, 25), (25, 31), (31, 37), (37, 44), (44, 50)], k=4, m=8, schedule="interleaved-1f1b", d=2, batch=32),
    }


@pytest.mark.parametrize("name", ["tiny-1f1b", "bundled-interleaved"])
@pytest.mark.parametrize("target", ["megatron", "torchtitan", "deepspeed", "torch"])
def test_golden_files(name: str, target: str) -> None:
    """The exact text of each export, so that a format change is a visible diff (the torchtitan
    fragment is checked against torchtitan's own classes only where torchtitan installs)."""
    plan = _golden_plans()[name]
    if problems(plan, target):
        export, _ = export_plan(plan, target, profile=None, use_nearest=True)
    else:
        export, _ = export_plan(plan, target)
    path = GOLDEN / f"{name}.{target}.txt"
    # the format is pinned, not the cost model's figures
    text = re.sub(r"(predicted step |\"predicted_step_ms\": )[\d.]+", r"\1<ms>", export.files[0].text)
    if os.environ.get("PIPEPLAN_UPDATE_GOLDEN") == "1":  # regenerate after a deliberate format change
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing: run with PIPEPLAN_UPDATE_GOLDEN=1 once and commit it"
    assert text == path.read_text()


# --------------------------------------------------------------------------- CLI


def test_cli_writes_and_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(_plan(_profile(TINY), [(0, 4), (4, 6), (6, 8)], m=6, batch=12).model_dump_json())
    out = tmp_path / "args.sh"
    assert main(["export", str(plan_path), "--to", "megatron", "-o", str(out)]) == 0
    assert "--pipeline-model-parallel-layout 'Et*3|tt|tL'" in out.read_text()
    assert f"megatron export written to {out}" in capsys.readouterr().err
    assert main(["export", str(plan_path), "--to", "deepspeed"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["pipeline"]["pipeplan"]["parts"] == [0, 4, 6, 8]
    assert "PlannedPipelineModule.from_config" in captured.err


def test_cli_refusal_is_an_error_line_and_nearest_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(_plan(_profile(TINY), [(0, 3), (3, 5), (5, 8)], m=6, batch=12, schedule="gpipe").model_dump_json())
    assert main(["export", str(plan_path), "--to", "megatron", "--profile", str(TINY)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: megatron cannot express this plan:") and "Traceback" not in err
    assert "predicted step" in err and "--nearest" in err
    assert main(["export", str(plan_path), "--to", "megatron", "--profile", str(TINY), "--nearest"]) == 0
    captured = capsys.readouterr()
    assert "note: this plan is not expressible" in captured.err and "PIPEPLAN_MEGATRON_ARGS=(" in captured.out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["missing.json", "--to", "megatron"], "error: plan file 'missing.json' does not exist"),
        (["PLAN", "--to", "megatron", "--profile", str(GPT_TINY)], "error: the profile (model"),
        (["PLAN", "--to", "megatron", "-o", "/nonexistent-dir/x.sh"], "error: cannot write '/nonexistent-dir/x.sh'"),
    ],
)
def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], fragment: str) -> None:
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(_plan(_profile(TINY), [(0, 4), (4, 8)]).model_dump_json())
    args = [str(plan_path) if a == "PLAN" else a for a in args]
    assert main(["export", *args]) == 1
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_cli_unknown_target_is_an_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["export", "plan.json", "--to", "jax"])
    assert exit_.value.code == 2
    assert "error: argument --to: invalid choice: 'jax'" in capsys.readouterr().err


def test_random_layer_profiles_need_a_decoder_stack_for_megatron() -> None:
    plan = _plan(random_profile(1, 6), [(0, 3), (3, 6)], m=4, batch=8)
    assert problems(plan, "megatron") and not problems(plan, "deepspeed") and not problems(plan, "torch")
    check_round_trip(plan)


def test_the_replan_hint_gives_plans_the_target_can_express() -> None:
    """The flags a refusal suggests (`plan ... --schedule 1f1b`, `--no-recompute`) make the
    solver's plan expressible."""
    from planner.solver import solve

    profile = _profile(BUNDLED)
    training = TrainingSetup(global_batch_size=64)
    classic = ["1f1b", "interleaved-1f1b"]
    interleaved = solve(profile, Cluster.model_validate({"devices": 8, "device_type": "h100-80g"}), TrainingSetup(global_batch_size=256),
                        PlanOptions(zero_stage=0, schedules=classic, time_limit_s=1))  # fmt: skip
    mixed = solve(profile, Cluster.model_validate({"devices": 8, "device_type": "a100-40g"}), training, PlanOptions(time_limit_s=1))
    for plan, target, flag, options in (
        (interleaved, "deepspeed", "--schedule 1f1b --zero 0", PlanOptions(schedule="1f1b", zero_stage=0, time_limit_s=1)),
        (mixed, "megatron", "--no-recompute --schedules 1f1b,interleaved-1f1b --zero 0",
         PlanOptions(recompute=False, schedules=classic, zero_stage=0, time_limit_s=1)),
    ):
        with pytest.raises(ExportRefused) as err:
            export_plan(plan, target, profile=profile)
        assert f"or make a new plan within {target}'s rules: pipeplan plan PROFILE ... {flag}" in str(err.value)
        again = solve(profile, plan.cluster, plan.training, options)
        assert not problems(again, target)


@pytest.mark.parametrize("fused", [False, True])
def test_torchtitan_runs_the_optimizer_kernels_the_plan_counts(fused: bool) -> None:
    """The plan's memory counts the optimizer step's temporaries of torch's foreach kernels, or
    none for fused ones: the torchtitan export asks for the same implementation."""
    plan = _golden_plans()["tiny-1f1b"]
    plan = plan.model_copy(update={"training": plan.training.model_copy(update={"fused_optimizer": fused})})
    export, _ = export_plan(plan, "torchtitan")
    want = "fused" if fused else "foreach"
    assert f'[optimizer]\nimplementation = "{want}"' in export.files[0].text
    assert f"--optimizer.implementation {want}" in export.files[0].text
