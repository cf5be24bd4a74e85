"""The mesh (runtime/mesh.py) and checkpoints (runtime/checkpoint.py): layout, refusals, and
small gloo jobs compared with the unsplit model at 1e-5 (tests/runtime/mesh_job.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from planner.errors import InputError
from runtime.mesh import MESH_AXES, MeshSpec, match_rule, plan_sharding, refuse_unexecutable
from tests.runtime import mesh_job

TOL = 1e-5


@pytest.fixture(scope="module")
def gpt_split() -> Any:
    import torch

    from profiler.loading import load_entrypoint
    from profiler.split import split_model

    torch.manual_seed(0)
    entry = load_entrypoint("examples.gpt:tiny")
    return split_model(entry.model, entry.example_inputs, keywords=entry.keywords)


def test_the_private_api_is_where_mesh_expects_it() -> None:
    """runtime.mesh runs the units under DTensor's experimental implicit replication."""
    from torch.distributed.tensor.experimental import implicit_replication

    assert callable(implicit_replication)


def test_mesh_layout_is_torchtitans_order() -> None:
    assert MESH_AXES == ("pp", "dp_replicate", "dp_shard", "tp")
    spec = MeshSpec(pipeline_degree=2, data_parallel_degree=3, tensor_parallel_degree=2)
    assert spec.shape == (2, 3, 1, 2) and spec.world_size == 12
    assert MeshSpec(pipeline_degree=2, data_parallel_degree=3, zero_stage=3).shape == (2, 1, 3, 1)
    # tensor-parallel ranks of a replica are consecutive; pipeline outermost
    assert [spec.coords(r) for r in (0, 1, 2, 6, 11)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 2, 1)]
    assert all(spec.rank_of(*spec.coords(r)) == r for r in range(12))
    with pytest.raises(InputError, match="outside the mesh"):
        spec.coords(12)


def test_reshard_policy() -> None:
    assert MeshSpec(zero_stage=3, schedule="1f1b").reshard_after_forward()
    assert not MeshSpec(zero_stage=2, schedule="1f1b").reshard_after_forward()
    for schedule in ("zb-h1", "zbv", "dualpipev", "interleaved-zb", "planned"):
        assert not MeshSpec(zero_stage=3, schedule=schedule).reshard_after_forward(), schedule


def test_rules_find_the_gpt_blocks(gpt_split: Any) -> None:
    found = [match_rule(u) for u in gpt_split.units]
    assert [f is not None for f in found] == [False, True, True, True, True, False]
    assert found[1] is not None and found[1].column == ("blocks.0.attn.qkv", "blocks.0.mlp.fc")
    spec = MeshSpec(tensor_parallel_degree=2)
    assert sorted(plan_sharding(gpt_split.units, gpt_split.names, spec)) == [1, 2, 3, 4]
    # the plan may keep a block replicated
    kinds = {"blocks.1": "replicated"}
    assert sorted(plan_sharding(gpt_split.units, gpt_split.names, spec, layer_kinds=kinds)) == [1, 3, 4]


def test_rules_find_hf_decoder_and_encoder_layers() -> None:
    import torch

    from profiler.loading import load_entrypoint
    from profiler.split import split_model

    cases = (
        ("examples.hf:llama", "model.layers.0", "decoder layer (Llama/Qwen2 style)"),
        ("examples.hf:bert", "bert.encoder.layer.0", "encoder layer (BERT style)"),
        ("examples.hf:vit", "vit.layers.0", "encoder layer (ViT style)"),
    )
    for spec, layer, rule in cases:
        torch.manual_seed(0)
        entry = load_entrypoint(spec)
        split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
        i = split.names.index(layer)
        found = match_rule(split.units[i])
        assert found is not None and found.rule == rule, (spec, layer, found)
        # executed, with and without sequence parallelism (tests/runtime/test_mesh_sp_zero.py):
        # nothing refused at T = 2
        assert found.sequence_dim == 1
        refuse_unexecutable(split.units, split.names, MeshSpec(tensor_parallel_degree=2))
        refuse_unexecutable(split.units, split.names, MeshSpec(tensor_parallel_degree=2, sequence_parallel=True))
        # a width T does not divide is refused before training, naming the layer
        with pytest.raises(InputError, match=f"layer {i} '{re.escape(layer)}': .* not divisible by T=3"):
            refuse_unexecutable(split.units, split.names, MeshSpec(tensor_parallel_degree=3))


def test_the_runtime_shards_the_embedding_and_head_the_profile_prices_sharded() -> None:
    """An untied embedding runs vocabulary-parallel and an LM head column-parallel, as the profile
    prices them (``examples.hf:llama``: ``--check`` in tests/runtime/test_mesh_sp_zero.py); a
    table tied to the head is priced replicated and runs whole (the zoo GPT); a vocabulary T does
    not divide is refused before training, naming the layer."""
    import torch

    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.mesh import profiled_kinds, split_sharding

    torch.manual_seed(0)
    entry = load_entrypoint("examples.hf:llama")
    split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
    kinds = profiled_kinds(split)
    shardings = split_sharding(split, MeshSpec(tensor_parallel_degree=2))
    embed, head = split.names.index("model.embed_tokens"), split.names.index("lm_head")
    assert (kinds[embed], kinds[head]) == ("vocab-embedding", "column-head")
    assert shardings[embed].vocab == ("model.embed_tokens",) and shardings[embed].rule == "vocabulary-parallel embedding"
    assert shardings[head].column == ("lm_head",) and not shardings[head].row and not shardings[head].vocab
    # exactly the units priced as sharded are sharded
    assert sorted(shardings) == [i for i, k in enumerate(kinds) if k != "replicated"]
    with pytest.raises(InputError, match=f"layer {embed} 'model.embed_tokens': model.embed_tokens has 128 rows \\(vocabulary\\), not divisible by T=3"):
        split_sharding(split, MeshSpec(tensor_parallel_degree=3))

    torch.manual_seed(0)
    entry = load_entrypoint("examples.gpt:tiny")
    split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
    assert split.shared_parameters()  # tied embedding and head
    shardings = split_sharding(split, MeshSpec(tensor_parallel_degree=2))
    assert sorted(shardings) == [1, 2, 3, 4]  # the blocks; the tied embedding and head run whole


def test_refusals_name_the_layer(gpt_split: Any) -> None:
    units, names = gpt_split.units, gpt_split.names
    with pytest.raises(InputError) as err:
        # a plan (of another profile) that prices the head as an embedding: it has no table to shard
        refuse_unexecutable(units, names, MeshSpec(tensor_parallel_degree=2), layer_kinds={"head": "vocab-embedding"})
    assert "layer 5 'head' is tensor-parallel (vocab-embedding)" in str(err.value) and "no sharding rule" in str(err.value)
    assert "fix: replan with --tensor-parallel 1" in str(err.value)
    with pytest.raises(InputError, match="not divisible by T=3(.|\n)*fix: replan with a tensor-parallel degree that divides every width"):
        refuse_unexecutable(units, names, MeshSpec(tensor_parallel_degree=3))
    # executed now (tests/runtime/test_mesh_sp_zero.py): sequence parallelism on the GPT blocks,
    # ZeRO 1/2/3 together with tensor parallelism
    refuse_unexecutable(units, names, MeshSpec(tensor_parallel_degree=2, sequence_parallel=True))
    for zero in (1, 2, 3):
        refuse_unexecutable(units, names, MeshSpec(data_parallel_degree=2, tensor_parallel_degree=2, zero_stage=zero))
    with pytest.raises(InputError, match="no layer of this model has a sharding rule"):
        refuse_unexecutable(units[:1], names[:1], MeshSpec(tensor_parallel_degree=2))
    refuse_unexecutable(units, names, MeshSpec(tensor_parallel_degree=2))  # executable: no error
    refuse_unexecutable(units, names, MeshSpec(data_parallel_degree=2, zero_stage=3))


def _run(tmp_path: Path, **cfg: Any) -> list[dict[str, Any]]:
    base = {"M": 2, "b": 2, "lr": 0.1, "steps": 2, "zero": 0, "T": 1, "D": 1}
    full = {**base, **cfg}
    full["world"] = full["K"] * full["D"] * full["T"]
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    return mesh_job.launch(full, str(out))


def _assert_matches(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["params"] > 0
        assert r["worst"] <= TOL, r


@pytest.mark.slow
def test_zero3_then_tensor_parallel_resumed_from_its_checkpoint(tmp_path: Path) -> None:
    """Plan A, D=2 ZeRO-3 x K=2 (SGD with momentum), 2 steps, checked against 2 unsplit steps
    and saved; plan B, T=2 x K=2 with other stage bounds and M, resumes for 2 more, checked
    against 4 unsplit steps.  (Each mesh checked at 1e-5; one test, to keep the suite short.)"""
    ck = tmp_path / "ck"
    results = _run(tmp_path, K=2, D=2, zero=3, bounds=[0, 3, 6], momentum=0.9, save=str(ck))
    _assert_matches(results)
    # FSDP2 shards every parameter but the tied embedding / head
    assert all("blocks.0.attn.qkv.weight" in r["sharded"] or "blocks.2.attn.qkv.weight" in r["sharded"] for r in results)
    assert not any("embed.tok.weight" in r["sharded"] for r in results)
    assert (ck / "latest").read_text().strip() == "step-000002"
    results = _run(tmp_path, K=2, T=2, bounds=[0, 2, 6], M=4, steps=4, momentum=0.9, resume=str(ck))
    _assert_matches(results)
    assert all(r["sharded"] for r in results)  # the blocks are tensor-parallel in plan B


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh",
    [{"D": 2, "zero": 3, "recompute": 6}, {"T": 2, "recompute": 4}],
    ids=["zero3-all-layers", "tensor-parallel-first-4"],
)
def test_layers_checkpointed_under_fsdp2_and_tensor_parallelism_train_exactly(mesh: dict[str, Any], tmp_path: Path) -> None:
    """Per-layer recompute composes with the other axes as apply_mesh orders them: each
    checkpointed unit is sharded by FSDP2 (ZeRO 3 re-gathers its parameters for the backward's
    re-run) or holds tensor-parallel DTensors; 2 steps on 2 ranks match the unsplit model."""
    results = _run(tmp_path, K=1, bounds=[0, 6], **mesh)
    _assert_matches(results)
    assert all(r["checkpointed"] == mesh["recompute"] and r["sharded"] for r in results)


# ------------------------------------------------------------------------- checkpoint files


def _fake_checkpoint(root: Path, step: int, *, sha: str = "a" * 64, latest: bool = True) -> Path:
    from runtime.checkpoint import FORMAT, step_dir

    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"not a real metadata file")
    info = {"format": FORMAT, "model": "m:f", "sha256": sha, "step": step, "plan": "K=2", "optimizer": "sgd"}
    (path / "pipeplan.json").write_text(json.dumps(info))
    if latest:
        (root / "latest").write_text(path.name + "\n")
    return path


def test_a_half_written_checkpoint_is_never_the_latest(tmp_path: Path) -> None:
    from runtime.checkpoint import read_info

    _fake_checkpoint(tmp_path, 4)
    half = tmp_path / "step-000008"  # killed mid-save: shards, no info, no marker
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert read_info(tmp_path).step == 4
    (tmp_path / "latest").unlink()  # nothing complete yet
    with pytest.raises(InputError, match="no complete checkpoint"):
        read_info(tmp_path)


def test_another_models_checkpoint_is_refused(tmp_path: Path) -> None:
    from runtime.checkpoint import check_compatible, read_info

    _fake_checkpoint(tmp_path, 4, sha="b" * 64)
    info = read_info(tmp_path)
    with pytest.raises(InputError) as err:
        check_compatible(info, model="examples.gpt:tiny", sha256="c" * 64)
    text = str(err.value)
    assert "'m:f' (fingerprint bbbbbbbbbbbb...)" in text and "'examples.gpt:tiny' (fingerprint cccccccccccc...)" in text
    with pytest.raises(InputError, match="resume with --optimizer sgd"):
        check_compatible(info, model="m:f", sha256="b" * 64, optimizer="adam")


def test_a_damaged_checkpoint_gets_a_clear_error(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp  # noqa: F401  (load_checkpoint needs torch)

    from runtime.checkpoint import load_checkpoint, read_info

    path = _fake_checkpoint(tmp_path, 4)
    with pytest.raises(InputError, match="is damaged: cannot read its metadata"):
        load_checkpoint(tmp_path, [], None, model="m:f", sha256="a" * 64)
    (path / "pipeplan.json").write_text("{")
    with pytest.raises(InputError, match="is damaged: .*does not parse"):
        read_info(tmp_path)
    (path / "pipeplan.json").unlink()
    with pytest.raises(InputError, match="pipeplan.json is missing"):
        read_info(tmp_path)


def test_sequence_parallelism_without_a_rule_is_refused(gpt_split: Any) -> None:
    """A sharded layer whose kind has no sequence dimension, or whose graph does not use a
    linear's weight in one ``aten.linear`` call, cannot run sequence-parallel: the problem is named."""
    import dataclasses

    from runtime.mesh import _sequence_parallel_problem

    block = gpt_split.units[1]
    sharding = match_rule(block)
    assert sharding is not None and sharding.sequence_dim == 1
    assert _sequence_parallel_problem(block, sharding) == ""
    no_rule = dataclasses.replace(sharding, sequence_dim=None)
    assert "no sequence-parallel rule" in _sequence_parallel_problem(block, no_rule)
    not_linear = dataclasses.replace(sharding, column=("blocks.0.ln1",))
    assert _sequence_parallel_problem(block, not_linear) == (
        "blocks.0.ln1.weight is not used by exactly one aten.linear call in the layer's graph"
    )


def test_resume_is_checked_before_any_rank_starts(tmp_path: Path) -> None:
    import argparse

    from pipeplan.cmd_run import _checkpoint_args

    _fake_checkpoint(tmp_path / "ck", 4, sha="b" * 64)
    args = argparse.Namespace(resume=str(tmp_path / "ck"), checkpoint=str(tmp_path / "new"), every=2, steps=8)
    with pytest.raises(InputError, match="is of model 'm:f'"):
        _checkpoint_args(args, model="examples.gpt:tiny", sha256="c" * 64, optimizer="sgd")
    out = _checkpoint_args(args, model="m:f", sha256="b" * 64, optimizer="sgd")
    assert out == ["--resume", str(tmp_path / "ck"), "--checkpoint", str(tmp_path / "new"), "--every", "2"]
    with pytest.raises(InputError, match="at step 4; give --steps above it"):
        _checkpoint_args(argparse.Namespace(resume=str(tmp_path / "ck"), steps=4), model="m:f", sha256="b" * 64, optimizer="sgd")
