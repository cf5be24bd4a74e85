"""Sequence parallelism on Hugging Face GPT-2 and T5 blocks.

GPT-2's projections are ``Conv1D``, which flattens batch and sequence around its
``aten.addmm`` (``x.view(-1, x.size(-1))``, then ``.view(size_out)``), so the runtime gathers
the sequence before the flattening view and reduce-scatters after the restoring one; the blocks
take the attention mask as their first input, which stays replicated while the hidden states are
split.  T5's decoder blocks take the encoder's output beside their own hidden states: both are
split (the cross-attention's keys and values gather it), the masks and the relative position
bias stay replicated.

The runs are ``examples.hf:gpt2`` and ``examples.hf:t5`` (tiny, random, dropout 0.1) on 2 or 4
gloo ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import types
from pathlib import Path
from typing import Any

import pytest

GPT2 = "examples.hf:gpt2"
BLOCKS = [f"transformer.h.{i}" for i in range(4)]
T5 = "examples.hf:t5"
T5_BLOCKS = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def _split(model: str = GPT2) -> Any:
    from profiler.loading import load_entrypoint
    from profiler.split import split_model

    entry = load_entrypoint(model)
    return entry, split_model(entry.model, entry.example_inputs, keywords=entry.keywords)


def test_gpt2_blocks_are_no_longer_refused_and_a_block_without_its_views_is() -> None:
    """The GPT-2 rule has a sequence dimension: T = 2 with sequence parallelism passes the checks
    made before training.  A block whose Conv1D is not between the flattening views (here: the
    restoring view removed) is still refused, naming the projection and the fix, and so is a
    rule without a sequence dimension."""
    import torch

    from planner.errors import InputError
    from runtime.mesh import (
        MeshSpec,
        _sequence_parallel_problem,
        profiled_kinds,
        refuse_unexecutable,
        split_sharding,
    )

    sp = MeshSpec(tensor_parallel_degree=2, sequence_parallel=True)
    _, split = _split()
    kinds = dict(zip(split.names, profiled_kinds(split), strict=True))
    refuse_unexecutable(split.units, split.names, sp, layer_kinds=kinds)
    shardings = split_sharding(split, sp)
    first = split.names.index("transformer.h.0")
    block, sharding = split.units[first], shardings[first]
    assert sharding.sequence_dim == 1 and _sequence_parallel_problem(block, sharding) == ""

    # the fault: c_proj's addmm output used as it is (no view restoring batch and sequence)
    block = copy.deepcopy(block)
    weight = next(n for n in block.graph.nodes if n.op == "get_attr" and n.target == "transformer.h.0.attn.c_proj.weight")
    addmm = next(iter(weight.users))
    restore = next(iter(addmm.users))
    assert restore.target is torch.ops.aten.view.default
    restore.replace_all_uses_with(addmm)
    block.graph.erase_node(restore)
    block.recompile()
    assert _sequence_parallel_problem(block, sharding) == (
        "transformer.h.0.attn.c_proj's aten.addmm is not between a view flattening its input and one view "
        "restoring the sequence dimension 1 of its output (Conv1D's x.view(-1, x.size(-1)) ... .view(size_out))"
    )
    units = list(split.units)
    units[first] = block
    with pytest.raises(InputError, match=r"(?s)layer 3 'transformer.h.0' \(GPT-2 block.*c_proj's aten.addmm.*"
                                         r"fix: replan with --no-sequence-parallel"):  # fmt: skip
        refuse_unexecutable(units, split.names, sp, layer_kinds=kinds)
    # a rule without a sequence dimension is refused as before
    no_rule = dataclasses.replace(sharding, sequence_dim=None)
    assert "no sequence-parallel rule" in _sequence_parallel_problem(split.units[first], no_rule)


def _described(unit: int, x: Any) -> str:
    """``unit:type:placements`` of one output of a unit."""
    placements = [repr(p) for p in x.placements] if hasattr(x, "placements") else ""
    return f"{unit}:{type(x).__name__}:{placements}"


def _inspect_stage(rank: int, port: int, out_dir: str, model: str, blocks: list[str]) -> None:
    """Rank ``rank`` of 2: ``model``'s ``blocks`` as one stage at T = 2 with sequence
    parallelism, forward and backward against the same stage whole (the same dropout masks), and
    every DTensor the blocks' graphs make (placements, local and global shapes)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.fx
    from torch.distributed.tensor import DTensor

    from runtime.mesh import MeshSpec, apply_mesh, build_mesh, split_sharding, stage_shardings
    from runtime.modules import stage_examples

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        spec = MeshSpec(tensor_parallel_degree=2, sequence_parallel=True)
        mesh = build_mesh(spec)
        torch.manual_seed(0)
        entry, split = _split(model)
        first, last = split.names.index(blocks[0]), split.names.index(blocks[-1]) + 1
        examples = stage_examples(split, entry.example_inputs, 2, torch.device("cpu"))
        whole = copy.deepcopy(split.stage_module(first, last, pipeline=True))
        shardings = stage_shardings(split_sharding(split, spec), first, last)
        sharded = apply_mesh(split.stage_module(first, last, pipeline=True), spec, mesh, shardings=shardings)
        records: list[dict[str, Any]] = []

        class Recorder(torch.fx.Interpreter):
            def __init__(self, module: Any, unit: int) -> None:
                super().__init__(module)
                self.unit = unit

            def run_node(self, n: torch.fx.Node) -> Any:
                value = super().run_node(n)
                for v in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(v, DTensor):
                        name = n.target.__name__ if isinstance(n.target, types.FunctionType) else str(n.target)
                        records.append({"unit": self.unit, "target": name,
                                        "placements": [repr(p) for p in v.placements],
                                        "local": list(v.to_local().shape), "global": list(v.shape)})  # fmt: skip
                return value

        outputs: list[list[str]] = []
        for unit, wrapper in enumerate(sharded.units):
            inner = getattr(wrapper, "inner", None)
            if inner is None:  # a layer without a rule runs whole: nothing to record
                continue
            inner.forward = lambda *a, inner=inner, unit=unit: Recorder(inner, unit).run(*a)
            wrapper.register_forward_hook(lambda m, a, o, unit=unit: outputs.append([_described(unit, x) for x in o]))

        def run(mod: Any) -> list[Any]:
            """The stage's last output and the gradients of its floating-point inputs."""
            xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in examples[first][0]]
            torch.manual_seed(7)  # the same dropout masks in both runs
            out = mod(*xs)
            out[-1].square().sum().backward()
            return [out[-1]] + [x.grad for x in xs if x.grad is not None]

        def rel(a: Any, b: Any) -> float:
            return float((a.detach() - b.detach()).abs().max() / max(float(b.detach().abs().max()), 1e-3))

        ref = run(whole)
        got = run(sharded)
        assert len(got) == len(ref) >= 2, (len(got), len(ref))
        worst = max(rel(a, b) for a, b in zip(got, ref, strict=True))
        ref_params = dict(whole.named_parameters())
        grads = {}
        for name, p in sharded.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            worst = max(worst, rel(g, ref_params[name.replace(".inner", "")].grad))
            grads[name] = [repr(pl) for pl in p.grad.placements] if isinstance(p.grad, DTensor) else None
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps({"worst": worst, "records": records, "outputs": outputs, "grads": grads})
        )
    finally:
        dist.destroy_process_group()


def _inspected(tmp_path: Path, model: str, blocks: list[str]) -> list[dict[str, Any]]:
    """What :func:`_inspect_stage` recorded on each of the 2 ranks."""
    import torch.multiprocessing as mp

    from tests.runtime.mesh_job import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = (free_port(), str(tmp_path), model, blocks)
    mp.start_processes(_inspect_stage, args=args, nprocs=2, join=True, start_method="spawn")
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_gpt2_blocks_run_on_sequence_shards_and_match_them_whole(tmp_path: Path) -> None:
    """Inside each block the norms, dropout and residual adds hold half the sequence (``Shard(1)``,
    8 of 16 positions); each Conv1D's input is gathered whole once, before its flattening view
    (c_attn and c_fc: 2 gathers), and each row-parallel output reduce-scattered after its
    restoring view (c_proj twice); attention runs on each rank's heads over the whole sequence;
    the mask stays replicated; a block hands the next its output sharded (and the mask
    replicated), the last gathers it;
    the norms' and row biases' gradients come out summed (replicated); and forward, input and
    parameter gradients match the stage whole."""
    for r in _inspected(tmp_path, GPT2, BLOCKS):
        assert r["worst"] <= 1e-5, r["worst"]
        for unit in range(4):
            mine = [x for x in r["records"] if x["unit"] == unit]
            norms = [x for x in mine if "layer_norm" in x["target"]]
            adds = [x for x in mine if x["target"] == "aten.add.Tensor" and len(x["global"]) == 3 and x["global"][2] == 32]
            dropouts = [x for x in mine if x["target"] == "whole_dropout"]
            gathers = [x for x in mine if x["target"] == "gather_sequence"]
            scatters = [x for x in mine if x["target"] == "scatter_sequence"]
            assert (len(norms), len(adds), len(dropouts), len(gathers), len(scatters)) == (2, 2, 2, 2, 2), mine
            for x in norms + adds + dropouts + scatters:  # sequence-sharded: 8 of the 16 positions
                assert x["placements"] == ["Shard(dim=1)"] and x["local"][1] == 8 and x["global"][1] == 16, x
            for x in gathers:  # the Conv1D's input before its view: the whole sequence
                assert x["placements"] == ["Replicate()"] and x["local"][1] == 16, x
            addmm = [x for x in mine if x["target"] == "aten.addmm.default"]
            assert [a["local"] for a in addmm] == [[32, 48], [32, 32], [32, 64], [32, 32]], addmm  # 2 x 16 rows
            attention = [x for x in mine if x["target"] == "attention_whole_dropout"]
            assert attention and all(x["placements"] == ["Shard(dim=1)"] and x["local"][1:3] == [2, 16]
                                     for x in attention), attention  # fmt: skip
        assert r["outputs"] == [
            ["0:DTensor:['Replicate()']", "0:DTensor:['Shard(dim=1)']"],
            ["1:DTensor:['Replicate()']", "1:DTensor:['Shard(dim=1)']"],
            ["2:DTensor:['Replicate()']", "2:DTensor:['Shard(dim=1)']"],
            ["3:Tensor:"],  # the stage's end: the hidden states whole (the mask is not handed on)
        ], r["outputs"]
        summed = {k: v for k, v in r["grads"].items() if ".ln_" in k or "c_proj.bias" in k}
        assert len(summed) == 24 and all(v == ["Replicate()"] for v in summed.values()), summed


SP_NOTE = "sequence parallelism on the 4 tensor-parallel layer(s): their norms, dropout and residual adds run on 1/2"
# case -> (model, devices, stages, data-parallel degree, global batch)
RUNS = {
    "T2-SP": (GPT2, 2, 1, 1, 4),
    "D2-T2-SP": (GPT2, 4, 1, 2, 8),
    "K2-T2-SP": (GPT2, 4, 2, 1, 4),
    "t5-T2-SP": (T5, 2, 1, 1, 4),
    # the second stage starts at decoder.block.1, whose position bias and masks arrive as plain inputs
    "t5-K2-T2-SP": (T5, 4, 2, 1, 4),
}


@pytest.mark.parametrize("case", list(RUNS))
def test_hf_blocks_with_sequence_parallelism_pass_the_check_with_adam(case: str, tmp_path: Path) -> None:
    """profile (fake, fast) -> plan with T = 2 and sequence parallelism forced -> ``run --check``
    with the default optimizer (Adam) and the models' dropout 0.1: the blocks run
    sequence-parallel (the run's mesh note says so), GPT-2's position embedding and head shard
    over T on the whole sequence, and the check holds against the unsplit model."""
    from pipeplan.cli import main
    from tests.runtime.helpers import fake_profile_file, run_cli

    model, devices, stages, d, batch = RUNS[case]
    profile = fake_profile_file(model, tmp_path / "profile.json", microbatch_sizes=(1, 2))
    path = tmp_path / f"{case}.json"
    assert main([
        "plan", str(profile), "--devices", str(devices), "--devices-per-node", str(devices), "--device-type", "cpu",
        "--interconnect", "loopback", "--batch-size", str(batch), "--microbatches", "2", "--stages", str(stages),
        "--no-recompute", "--sequence-parallel", "--tensor-parallel", "2", "--data-parallel", str(d),
        "--zero", "0", "-o", str(path),
    ]) == 0  # fmt: skip
    plan = json.loads(path.read_text())
    assert (plan["tensor_parallel_degree"], plan["data_parallel_degree"], plan["pipeline_degree"]) == (2, d, stages)
    assert plan["sequence_parallel"], plan
    report = tmp_path / "report.json"
    proc, _ = run_cli(["run", "--plan", str(path), "--model", model, "--steps", "2", "--check",
                       "--report", str(report), "--timeout", "120"], timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check PASSED" in proc.stdout and "adam" in proc.stdout, proc.stdout[-2000:]
    data = json.loads(report.read_text())
    check = data["check"]
    assert check["passed"] and check["max_param_rel_diff"] <= 1e-5 and check["max_loss_rel_diff"] <= 1e-5, check
    note = next(n for n in data["notes"] if n.startswith("mesh: "))
    assert SP_NOTE in note, note
    assert "priced as" not in note, note


def test_t5_blocks_run_on_sequence_shards_and_match_them_whole(tmp_path: Path) -> None:
    """T5's encoder and decoder blocks (and the layers between them, run whole) as one stage:
    each block's residual adds and reduce-scatters hold half its sequence (8 of the encoder's
    16 positions, 4 of the decoder's 8); each activation a column-parallel linear reads is
    gathered once (the encoder's: self-attention and MLP; the decoder's: self-attention,
    cross-attention query, MLP, and the encoder's output for the cross-attention's keys and
    values); the encoder's output is handed from decoder block to decoder block sharded, the
    masks and the relative position bias replicated; the norms' gradients come out summed; and
    forward, input and parameter gradients match the stage whole."""
    for r in _inspected(tmp_path, T5, T5_BLOCKS):
        assert r["worst"] <= 1e-5, r["worst"]
        units = sorted({x["unit"] for x in r["records"]})
        assert units == [0, 1, 6, 7], units  # the encoder's and the decoder's blocks
        for unit in units:
            mine = [x for x in r["records"] if x["unit"] == unit]
            seq = 16 if unit < 2 else 8
            residual = [x for x in mine if x["target"] == "aten.add.Tensor" and x["global"] == [2, seq, 32]]
            gathers = [x for x in mine if x["target"] == "gather_sequence"]
            scatters = [x for x in mine if x["target"] == "scatter_sequence"]
            assert (len(residual), len(scatters)) == ((2, 2) if unit < 2 else (3, 3)), mine
            for x in residual + scatters:
                assert x["placements"] == ["Shard(dim=1)"] and x["local"][1] == seq // 2, x
            for x in gathers:
                assert x["placements"] == ["Replicate()"] and x["local"] == x["global"], x
            assert sorted(x["global"][1] for x in gathers) == ([16, 16] if unit < 2 else [8, 8, 8, 16]), gathers
        rep, shard = "DTensor:['Replicate()']", "DTensor:['Shard(dim=1)']"
        assert r["outputs"] == [
            # the decoder's input ids, the mask, the position bias, the hidden states, two masks
            [f"0:{rep}", f"0:{rep}", f"0:{rep}", f"0:{shard}", f"0:{rep}", f"0:{rep}"],
            ["1:Tensor:"] * 4,  # a layer without a rule follows: gathered whole
            # the encoder's output, masks, the position bias, a constant, the hidden states
            [f"6:{shard}", f"6:{rep}", f"6:{rep}", f"6:{rep}", "6:Tensor:", f"6:{shard}"],
            ["7:Tensor:"] * 2,  # the stage's end: whole
        ], r["outputs"]
        norms = {k: v for k, v in r["grads"].items() if "layer_norm" in k and ".block." in k}
        assert len(norms) == 10 and all(v == ["Replicate()"] for v in norms.values()), norms


def test_only_the_hidden_states_are_split_on_entry() -> None:
    """The inputs a sequence-parallel block splits are those its gathered activations are
    computed from along the residual stream, wherever they sit: GPT-2's hidden states (after
    the mask), T5's (the position bias computed by the first block is an input of the second:
    it reaches the MLP only through attention, so it stays whole) and, in a decoder block, the
    encoder's output beside them (the cross-attention's keys and values gather it).  The graph
    rewrite runs on the traced block alone, no process group needed."""
    from runtime.mesh import _make_sequence_parallel, match_rule

    cases = {
        GPT2: {"transformer.h.0": ["dropout"]},
        T5: {"encoder.block.1": ["add_8"], "decoder.block.1": ["dropout_7", "add_26"]},
    }
    for model, blocks in cases.items():
        _, split = _split(model)
        for block, hidden in blocks.items():
            unit = copy.deepcopy(split.units[split.names.index(block)])
            names = [n.name for n in unit.graph.nodes if n.op == "placeholder"]
            sharding = match_rule(unit)
            assert sharding is not None and sharding.sequence_dim == 1, (block, sharding)
            positions = _make_sequence_parallel(unit, sharding)
            assert [names[i] for i in positions] == hidden, (block, names, positions)
            assert len(names) > len(hidden), names  # the masks, the position bias: not split
