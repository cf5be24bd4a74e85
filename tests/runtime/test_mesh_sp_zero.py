"""``pipeplan run`` with sequence parallelism, and with ZeRO 1/2/3 together with tensor parallelism,
end to end (profile -> ``pipeplan plan`` with the axes forced -> ``pipeplan run --check`` on gloo)
against the unsplit model at 1e-5 (SGD); and a unit-level check that the sequence-parallel
blocks really run on sequence shards.

One profile of ``examples.gpt:tiny`` serves every case (module fixture); each case is one launch of
2 or 4 ranks for 2 steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.test_mesh_run import _checked, _mesh_note, _plan, _run

MODEL = "examples.gpt:tiny"


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeplan.cli import main

    path = tmp_path_factory.mktemp("mesh-sp-zero") / "profile.json"
    code = main(["profile", "--model", MODEL, "--microbatch-sizes", "1,2", "--time-budget", "2", "-q", "-o", str(path)])
    assert code == 0
    return path


def _flags(t: int, d: int, zero: int, *, sp: bool, schedule: str) -> list[str]:
    return [
        "--tensor-parallel", str(t), "--data-parallel", str(d), "--zero", str(zero), "--optimizer", "sgd",
        "--schedule", schedule, *(["--sequence-parallel"] if sp else []),
    ]  # fmt: skip


SP_NOTE = "sequence parallelism on the 4 tensor-parallel layer(s): their norms, dropout and residual adds run on 1/2"

# (devices, stages, global batch, T, D, zero, sequence parallel, schedule, what the mesh note must say)
CASES = {
    "T2-SP": (2, 1, 4, 2, 1, 0, True, "1f1b", SP_NOTE),
    # a split-backward schedule: the weight gradients are taken apart from the input gradients
    "T2-SP-K2-zbh1": (4, 2, 4, 2, 1, 0, True, "zb-h1", SP_NOTE),
    "D2-T2-zero1": (4, 1, 8, 2, 2, 1, False, "1f1b", "ZeRO 1: optimizer state sharded over the 2 replicas (DTensorZeroOptimizer)"),
    "D2-T2-zero3": (4, 1, 8, 2, 2, 3, False, "1f1b", "reshard after forward: yes"),
    # ZeRO 2 with sequence parallelism: FSDP2 sums the norms' gradients over "tp" itself
    "D2-T2-zero2-SP": (4, 1, 8, 2, 2, 2, True, "1f1b", "reshard after forward: no"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_and_zero_with_tp_match_the_unsplit_model(case: str, profile: Path, tmp_path: Path) -> None:
    devices, stages, batch, t, d, zero, sp, schedule, says = CASES[case]
    path = tmp_path / f"{case}.json"
    # _plan passes --no-sequence-parallel; a later --sequence-parallel wins
    plan = _plan(profile, path, devices=devices, stages=stages, batch=batch, extra=_flags(t, d, zero, sp=sp, schedule=schedule))
    assert (plan["pipeline_degree"], plan["data_parallel_degree"], plan["tensor_parallel_degree"]) == (stages, d, t)
    assert (plan["zero_stage"], plan["sequence_parallel"], plan["schedule"]) == (zero, sp, schedule)
    report = _run(path, tmp_path, "--steps", "2", "--check")
    _checked(report)
    assert report["world_size"] == stages * d * t
    note = _mesh_note(report)
    assert says in note and "tensor parallelism T = 2 on 4 layer(s)" in note, note
    assert (SP_NOTE in note) == sp, note
    if zero < 2 and d > 1:  # T > 1 keeps the flat all-reduce (runtime.mesh.gradient_reduction), and says why
        assert "data-parallel gradients: the runtime's flat all-reduce after the schedule (T = 2: DDP takes" in note
    if zero >= 2:  # FSDP2 sharded every parameter tensor, the blocks' tensor-parallel ones included (K = 1:
        # the tied embedding/head weight sits on one rank, so FSDP2 shards it too)
        fsdp = int(note.split("then each stage's rest; ")[1].split(" ")[0])
        assert fsdp == 52, note
        # FSDP2 gathers the four blocks one by one (as the cost model's ZeRO-3 prices it); the
        # tied embedding and head share a weight, so they stay in the stage's group
        layers = int(note.split("layer by layer (")[1].split(" ")[0])
        assert layers == 4, note


# ------------------------------------------------------------ the blocks really run sequence-sharded


def _inspect_unit(rank: int, port: int, out_dir: str) -> None:
    """Rank ``rank`` of 2: blocks 0 and 1 of the GPT as one stage, T = 2 with sequence
    parallelism; forward and backward against the same stage whole, and every DTensor a node of
    the blocks' graphs produced (its placements and local shape), recorded by an fx Interpreter."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import copy

    import torch
    import torch.distributed as dist
    import torch.fx
    from torch.distributed.tensor import DTensor

    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.mesh import MeshSpec, apply_mesh, build_mesh, plan_sharding, stage_shardings
    from runtime.modules import stage_examples

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        spec = MeshSpec(tensor_parallel_degree=2, sequence_parallel=True)
        mesh = build_mesh(spec)
        torch.manual_seed(0)
        entry = load_entrypoint(MODEL)
        split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
        examples = stage_examples(split, entry.example_inputs, 2, torch.device("cpu"))
        whole = copy.deepcopy(split.stage_module(1, 3, pipeline=True))
        shardings = stage_shardings(plan_sharding(split.units, split.names, spec), 1, 3)
        sharded = apply_mesh(split.stage_module(1, 3, pipeline=True), spec, mesh, shardings=shardings)

        records: list[dict[str, Any]] = []

        class Recorder(torch.fx.Interpreter):
            def __init__(self, module: Any, unit_index: int) -> None:
                super().__init__(module)
                self.unit_index = unit_index

            def run_node(self, n: torch.fx.Node) -> Any:
                value = super().run_node(n)
                if isinstance(value, DTensor):
                    records.append({
                        "unit": self.unit_index, "node": n.name, "target": str(n.target),
                        "placements": [repr(p) for p in value.placements],
                        "local": list(value.to_local().shape), "global": list(value.shape),
                    })  # fmt: skip
                return value

        unit_outputs: list[list[str]] = []
        wrappers = list(sharded.units)
        for unit_index, wrapper in enumerate(wrappers):
            inner = wrapper.inner

            def recorded(*args: Any, inner: Any = inner, unit_index: int = unit_index) -> Any:
                return Recorder(inner, unit_index).run(*args)

            inner.forward = recorded  # the graph's nodes one by one, recorded

        def run(mod: Any) -> tuple[Any, Any]:
            xs = [t.detach().clone().requires_grad_(True) for t in examples[1][0]]
            out = mod(*xs)
            sum(o.square().sum() for o in out).backward()
            return out, xs[0].grad

        ref_out, ref_grad = run(whole)
        for i, w in enumerate(wrappers):  # what each block hands on: the next block gets shards
            w.register_forward_hook(
                lambda m, a, o, i=i: unit_outputs.append(
                    [f"{i}:{type(x).__name__}:{[repr(p) for p in x.placements] if isinstance(x, DTensor) else ''}" for x in o]
                )
            )
        out, grad = run(sharded)

        def rel(a: Any, b: Any) -> float:
            return float((a.detach() - b.detach()).abs().max() / max(float(b.detach().abs().max()), 1e-3))

        worst = max(rel(out[0], ref_out[0]), rel(grad, ref_grad))
        ref_params = dict(whole.named_parameters())
        grads = {}
        for name, p in sharded.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            worst = max(worst, rel(g, ref_params[name.replace(".inner", "")].grad))
            grads[name] = [repr(pl) for pl in p.grad.placements] if isinstance(p.grad, DTensor) else None
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps({"worst": worst, "records": records, "outputs": unit_outputs, "grads": grads})
        )
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_blocks_run_on_sequence_shards(tmp_path: Path) -> None:
    """Inside each sequence-parallel block the norms and residual adds hold half the sequence
    (``Shard(1)``, local 16 of 32 positions) and only the linears' inputs are gathered whole;
    the first block hands the second its output still sharded, the last gathers it; attention's
    scores hold each rank's half of the heads; the norm
    weights' gradients come out summed (replicated); and all of it matches the stage run whole."""
    import torch.multiprocessing as mp

    from tests.runtime.mesh_job import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_inspect_unit, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["worst"] <= 1e-5, r["worst"]
        recs = r["records"]
        for unit in (0, 1):
            mine = [x for x in recs if x["unit"] == unit]
            norms = [x for x in mine if "layer_norm" in x["target"]]
            adds = [x for x in mine if x["target"] == "aten.add.Tensor"]
            gathers = [x for x in mine if "gather_sequence" in x["target"]]
            scatters = [x for x in mine if "scatter_sequence" in x["target"]]
            assert len(norms) == 2 and len(adds) == 2 and len(gathers) == 2 and len(scatters) == 2, mine
            for x in norms + adds + scatters:  # sequence-sharded: half of the 32 positions here
                assert x["placements"] == ["Shard(dim=1)"] and x["local"][1] == 16 and x["global"][1] == 32, x
            for x in gathers:  # the column-parallel linears' input: the whole sequence
                assert x["placements"] == ["Replicate()"] and x["local"][1] == 32, x
            # attention runs on each rank's own heads (the fused projection is grouped by head):
            # the scores are sharded on the head dimension, never gathered
            scores = [x for x in mine if "softmax" in x["target"]]
            assert scores, mine
            for x in scores:
                assert x["placements"] == ["Shard(dim=1)"] and 2 * x["local"][1] == x["global"][1], x
        # block 0's output stays sharded into block 1; block 1's leaves whole (the stage's output)
        assert r["outputs"] == [["0:DTensor:['Shard(dim=1)']"], ["1:Tensor:"]]
        norm_grads = {k: v for k, v in r["grads"].items() if ".ln" in k}
        assert len(norm_grads) == 8 and all(v == ["Replicate()"] for v in norm_grads.values()), norm_grads


# ------------------------------------------------------ Hugging Face decoder layers, tensor-parallel


def _layers(prefix: str) -> list[str]:
    return [f"{prefix}.{i}" for i in range(4)]


# model -> the layers sharded at T = 2, in order
HF_TP = {
    # Llama-style decoder layers: separate q, k, v projections, grouped-query attention, SwiGLU
    # MLP, fused attention; its untied embedding runs vocabulary-parallel and its LM head
    # column-parallel, as the profile prices them
    "examples.hf:llama": ["model.embed_tokens", *_layers("model.layers"), "lm_head"],
    # BERT-style encoder layers with dropout 0.1 in the attention and after both row-parallel
    # linears: each rank's heads get their share of the unsharded model's masks
    # (runtime.mesh.whole_dropout), so --check holds; its embedding is tied to the head:
    # replicated, in the profile and at run time
    "examples.hf:bert": _layers("bert.encoder.layer"),
    # ViT-style encoder layers (transformers 5 names: attention.q_proj ... mlp.fc2)
    "examples.hf:vit": _layers("vit.layers"),
}


# ViT runs with sequence parallelism only (its layers have no dropout; the run covers its rule)
HF_CASES = [(m, sp) for m in HF_TP for sp in (False, True) if sp or m != "examples.hf:vit"]


@pytest.mark.parametrize(("model", "sp"), HF_CASES, ids=[f"{m.split(':')[1]}-{'tp-sp' if sp else 'tp'}" for m, sp in HF_CASES])
def test_hf_layers_run_tensor_parallel_and_match_the_unsplit_model(model: str, sp: bool, tmp_path: Path) -> None:
    """Hugging Face decoder and encoder layers at T = 2, without and with sequence parallelism:
    ``--check`` against the unsplit model."""
    from pipeplan.cli import main

    profile = tmp_path / "profile.json"
    assert main(["profile", "--model", model, "--microbatch-sizes", "1,2", "--time-budget", "2",
                 "-q", "-o", str(profile)]) == 0  # fmt: skip
    path = tmp_path / "t2.json"
    plan = _plan(profile, path, devices=2, stages=1, batch=4,
                 extra=_flags(2, 1, 0, sp=sp, schedule="1f1b"))  # fmt: skip
    assert plan["tensor_parallel_degree"] == 2 and plan["sequence_parallel"] == sp
    report = _run(path, tmp_path, "--steps", "2", "--check", model=model, lr="0.001")
    check = report["check"]
    assert check["passed"] and check["max_param_rel_diff"] <= 1e-5 and check["max_loss_rel_diff"] <= 1e-5, check
    note = _mesh_note(report)
    layers = HF_TP[model]
    assert f"tensor parallelism T = 2 on {len(layers)} layer(s) ({', '.join(layers)})" in note, note
    # the blocks run sequence-parallel, the embedding and head on the whole sequence
    assert ("sequence parallelism on the 4 tensor-parallel layer(s): their norms, dropout and residual adds "
            "run on 1/2" in note) == sp, note  # fmt: skip
    # nothing the plan priced as sharded runs whole
    assert "priced as" not in note, note
    # Llama's untied column-parallel head keeps its logits sharded into the vocabulary-parallel
    # loss (torch's loss_parallel), as Megatron; BERT's tied head runs whole, ViT's classifier is
    # not a column-parallel head
    assert ("vocabulary-parallel loss: the head's logits stay sharded" in note) == (model == "examples.hf:llama"), note


def _inspect_llama(rank: int, port: int, out_dir: str) -> None:
    """Rank ``rank`` of 2: the placements inside llama's first decoder layer at T = 2."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.fx
    from torch.distributed.tensor import DTensor

    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.mesh import MeshSpec, apply_mesh, build_mesh, plan_sharding, stage_shardings
    from runtime.modules import stage_examples

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        spec = MeshSpec(tensor_parallel_degree=2)
        mesh = build_mesh(spec)
        torch.manual_seed(0)
        entry = load_entrypoint("examples.hf:llama")
        split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
        n = len(split.units)
        first = split.names.index("model.layers.0")
        examples = stage_examples(split, entry.example_inputs, 1, torch.device("cpu"))
        stage = apply_mesh(split.stage_module(0, n, pipeline=True), spec, mesh,
                           shardings=stage_shardings(plan_sharding(split.units, split.names, spec), 0, n))  # fmt: skip
        records: list[dict[str, Any]] = []

        class Recorder(torch.fx.Interpreter):
            def run_node(self, node: torch.fx.Node) -> Any:
                value = super().run_node(node)
                if isinstance(value, DTensor):
                    records.append({"node": node.name, "target": str(node.target),
                                    "placements": [repr(p) for p in value.placements],
                                    "local": list(value.to_local().shape), "global": list(value.shape)})  # fmt: skip
                return value

        inner = stage.units[first].inner
        inner.forward = lambda *a: Recorder(inner).run(*a)
        stage(*examples[0][0])
        Path(out_dir, f"llama{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def test_llama_decoder_layer_shards_like_megatron(tmp_path: Path) -> None:
    """Inside a Llama decoder layer at T = 2: the attention runs on each rank's heads, the MLP's
    gate and up projections leave their outputs sharded (not the weights gathered), and each
    row-parallel output is summed right after its linear (the residual stream stays replicated)."""
    import torch.multiprocessing as mp

    from tests.runtime.mesh_job import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_inspect_llama, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    recs = json.loads((tmp_path / "llama0.json").read_text())
    linears = [x for x in recs if x["target"] == "aten.linear.default"]
    assert len(linears) == 7, linears  # q, k, v, o, gate, up, down
    for x in linears[:3] + linears[4:6]:  # column-parallel: the output's last dimension halved
        assert x["placements"] == ["Shard(dim=2)"] and 2 * x["local"][2] == x["global"][2], x
    for i in (3, 6):  # row-parallel: partial sums, then summed by the next node
        assert linears[i]["placements"] == ["Partial(sum)"], linears[i]
        after = recs[recs.index(linears[i]) + 1]
        assert "reduce_row_output" in after["target"] and after["placements"] == ["Replicate()"], after
    attention = [x for x in recs if "scaled_dot_product_attention" in x["target"]]
    assert attention and all(x["placements"] == ["Shard(dim=1)"] and 2 * x["local"][1] == x["global"][1]
                             for x in attention), attention  # fmt: skip
