"""A small pipelined training job on the mesh of :mod:`runtime.mesh`, for the mesh and
checkpoint tests, without the worker (tests/runtime/test_mesh_run.py runs the worker itself on the mesh).

Every rank: split ``examples.gpt:tiny`` with the profiler's splitter, build its stage with
:func:`runtime.mesh.apply_mesh`, run ``torch.distributed.pipelining``'s 1F1B (or GPipe) on
deterministic token batches, average gradients over the data axis (flat all-reduce for ZeRO 0/1,
FSDP2 for 2/3), sum tied-weight gradients over the pipeline ranks, take SGD steps, optionally
resume from / save a checkpoint (:mod:`runtime.checkpoint`), and compare its final parameters
with the unsplit model trained for the same steps in this process.  Writes
``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

MODEL = "examples.gpt:tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batch(step: int, rows: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 256, (rows, 32), generator=g)


def _reference(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from examples.gpt import lm_loss
    from profiler.loading import load_entrypoint

    torch.manual_seed(0)
    model = load_entrypoint(MODEL).model
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg.get("momentum", 0.0))
    m, b, d_deg = cfg["M"], cfg["b"], cfg["D"]
    for step in range(cfg["total_steps"]):
        ids = batch(step, m * b * d_deg)
        for chunk in ids.split(b):
            (lm_loss(model(chunk)) / (m * d_deg)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def run(rank: int, cfg: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg["world"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import DTensor

    from examples.gpt import lm_loss
    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime import checkpoint as ckpt
    from runtime.mesh import (
        MeshSpec,
        all_reduce_grad,
        apply_mesh,
        build_mesh,
        data_mesh,
        full_parameters,
        make_sharded_optimizer,
        plan_sharding,
        reduces_data_gradients,
        stage_shardings,
    )
    from runtime.modules import CheckpointedUnit, stage_examples
    from runtime.training import unique_parameters

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        spec = MeshSpec(
            pipeline_degree=cfg["K"], data_parallel_degree=cfg["D"], tensor_parallel_degree=cfg["T"],
            zero_stage=cfg["zero"], schedule=cfg.get("schedule", "1f1b"),
        )  # fmt: skip
        mesh = build_mesh(spec)
        k, replica, _ = spec.coords(rank)
        torch.manual_seed(0)
        entry = load_entrypoint(MODEL)
        split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
        bounds = cfg["bounds"]  # stage s = units bounds[s]:bounds[s+1]
        start, stop = bounds[k], bounds[k + 1]
        examples = stage_examples(split, entry.example_inputs, cfg["b"], torch.device("cpu"))
        shardings = plan_sharding(split.units, split.names, spec)
        units = list(range(start, stop))
        tied = [split.units[u].get_parameter(n) for g in split.shared_parameters() for u, n in g if u in units]
        tied = list({id(p): p for p in tied}.values()) if spec.pipeline_degree > 1 else []
        module = split.stage_module(start, stop, pipeline=True)
        run_mod = apply_mesh(
            module, spec, mesh, checkpointed_layers=min(cfg.get("recompute", 0), stop - start),
            shardings=stage_shardings(shardings, start, stop), keep_whole=tied,
        )  # fmt: skip
        stage = PipelineStage(
            run_mod, k, spec.pipeline_degree, torch.device("cpu"),
            input_args=examples[start][0], output_args=examples[stop - 1][1], group=mesh["pp"].get_group(),
        )  # fmt: skip

        def loss_fn(output: Any, target: Any) -> Any:
            return lm_loss(split.rebuild_output(output if isinstance(output, tuple) else (output,)))

        m = cfg["M"]
        kind = Schedule1F1B if cfg.get("schedule", "1f1b") == "1f1b" else ScheduleGPipe
        schedule = kind(stage, m, loss_fn=loss_fn, scale_grads=False)
        params = unique_parameters([split.units[u] for u in units])
        opt = make_sharded_optimizer("sgd-momentum" if cfg.get("momentum") else "sgd", params, lr=cfg["lr"], spec=spec, mesh=mesh)
        named = [(n, p) for u in units for n, p in split.units[u].named_parameters()]
        first = 0
        if cfg.get("resume"):
            info = ckpt.load_checkpoint(cfg["resume"], named, opt, model=MODEL, sha256=split.sha256())
            first = info.step
        b, d_deg = cfg["b"], spec.data_parallel_degree
        for step in range(first, cfg["steps"]):
            ids = batch(step, m * b * d_deg)[replica * m * b : (replica + 1) * m * b]
            target = torch.zeros(m * b)
            if k == 0:
                schedule.step(ids, target=target if k == spec.pipeline_degree - 1 else None)
            else:
                schedule.step(target=target if k == spec.pipeline_degree - 1 else None)
            for p in params:
                if p.grad is not None:
                    p.grad.div_(m)
            if d_deg > 1:
                for p in (q for q in params if not reduces_data_gradients(spec, q)):
                    all_reduce_grad(p, data_mesh(mesh, spec).get_group(), divide=d_deg)
            for p in tied:
                all_reduce_grad(p, mesh["pp"].get_group())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cfg.get("save") and step + 1 == cfg.get("save_at", cfg["steps"]):
                ckpt.save_checkpoint(
                    cfg["save"], step + 1, named, opt, model=MODEL, sha256=split.sha256(),
                    plan=f"K={spec.pipeline_degree} D={d_deg} T={spec.tensor_parallel_degree} zero={spec.zero_stage}",
                    optimizer_name="sgd-momentum" if cfg.get("momentum") else "sgd",
                )  # fmt: skip
        sharded = sorted({n for n, p in named if isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)})
        mine = full_parameters(named)
        out: dict[str, Any] = {"rank": rank, "sharded": sharded, "optimizer": type(opt).__name__, "params": len(mine)}
        out["checkpointed"] = sum(isinstance(u, CheckpointedUnit) for u in module.units)
        if cfg.get("compare", True):
            ref = _reference(dict(cfg, total_steps=cfg["steps"]))
            worst, worst_name = 0.0, ""
            for n, t in mine.items():
                r = ref[n]
                diff = float((t - r).abs().max() / max(float(r.abs().max()), 1e-3))
                if diff >= worst:
                    worst, worst_name = diff, n
            out.update(worst=worst, worst_name=worst_name)
        Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def launch(cfg: dict[str, Any], out: str) -> list[dict[str, Any]]:
    """Run the job on ``cfg["world"]`` CPU processes; the per-rank results."""
    import torch.multiprocessing as mp

    cfg = dict(cfg, out=out, port=free_port())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(run, args=(cfg,), nprocs=cfg["world"], join=True, start_method="spawn")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cfg["world"])]




def run_unit(rank: int, cfg: dict[str, Any]) -> None:
    """One layer of ``cfg["model"]`` sharded over T = world ranks, forward and backward on its
    example activations, against the same layer whole in this process: the largest relative
    difference of outputs, input gradients and parameter gradients."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg["world"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.mesh import MeshSpec, apply_mesh, build_mesh, plan_sharding, stage_shardings
    from runtime.modules import stage_examples

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        spec = MeshSpec(tensor_parallel_degree=cfg["world"])
        mesh = build_mesh(spec)
        torch.manual_seed(0)
        entry = load_entrypoint(cfg["model"])
        split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
        u = split.names.index(cfg["layer"])
        examples = stage_examples(split, entry.example_inputs, 2, torch.device("cpu"))
        inputs = examples[u][0]
        whole = copy.deepcopy(split.stage_module(u, u + 1, pipeline=True))
        shardings = plan_sharding(split.units, split.names, spec)
        sharded = apply_mesh(split.stage_module(u, u + 1, pipeline=True), spec, mesh, shardings=stage_shardings(shardings, u, u + 1))

        def run(mod: Any) -> tuple[Any, list[Any]]:
            xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
            out = mod(*xs)
            sum(o.float().square().sum() for o in out if o.is_floating_point()).backward()
            return out, [x.grad for x in xs if x.grad is not None]

        ref_out, ref_grads = run(whole)
        out, grads = run(sharded)

        def rel(a: Any, b: Any) -> float:
            return float((a - b).abs().max() / max(float(b.abs().max()), 1e-3))

        worst = max(rel(a, b) for a, b in zip([*out, *grads], [*ref_out, *ref_grads], strict=True))
        ref_params = dict(whole.named_parameters())
        n_sharded = 0
        for name, p in sharded.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            key = name.replace(".inner", "")
            worst = max(worst, rel(g, ref_params[key].grad))
            n_sharded += isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)
        Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps({"worst": worst, "sharded": n_sharded}))
    finally:
        dist.destroy_process_group()


def launch_unit(cfg: dict[str, Any], out: str) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    cfg = dict(cfg, out=out, port=free_port())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(run_unit, args=(cfg,), nprocs=cfg["world"], join=True, start_method="spawn")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cfg["world"])]


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    print(json.dumps((launch_unit if "layer" in cfg else launch)(cfg, sys.argv[2]), indent=1))
