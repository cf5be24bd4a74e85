"""Checkpoints of head-split fused parameters (``_StridedShard``: GPT-2's ``c_attn`` at T > 1).

``torch.distributed.checkpoint`` refuses that placement ("overlapping chunks"), with or without
FSDP2 sharding it again; :mod:`runtime.checkpoint` saves such a tensor (and its optimizer state)
whole and copies each rank's elements back on load.  4 gloo ranks, a 2 x 2 ("dp", "tp") mesh: a
bias ``[24]`` placed ``_StridedShard(0, 3)`` over "tp" and a transposed weight ``[4, 24]``
(``_StridedShard(1, 3)``), FSDP2-sharded over "dp" (ZeRO 3), one SGD-with-momentum step, saved;
then loaded (a) into the same layout holding other values, compared whole (parameters and
momentum), and (b) into the plain, unsharded module of one rank (another plan, T = 1).  End to
end: ``tests/runtime/test_mesh_hf_blocks.py``'s GPT-2 at T = 2 resumed under ``--check``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

N = 24


def _job(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from runtime._strided_shard import full_tensor, has_strided, strided_shard
    from runtime.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]

        class Fused(torch.nn.Module):
            def __init__(self, offset: float) -> None:
                super().__init__()
                bias = torch.arange(N, dtype=torch.float32) + offset
                weight = torch.arange(4 * N, dtype=torch.float32).view(4, N) * 0.5 + offset
                self.bias = torch.nn.Parameter(distribute_tensor(bias, tp, [strided_shard(0, 3)]))
                self.weight = torch.nn.Parameter(distribute_tensor(weight, tp, [strided_shard(1, 3)]))

            def forward(self, c: torch.Tensor) -> torch.Tensor:
                return (self.bias * self.bias * c).sum() + (self.weight * c).sum()

        coef = distribute_tensor(torch.linspace(-1.0, 1.0, N), tp, [strided_shard(0, 3)])
        kw = {"model": "m:f", "sha256": "a" * 64}

        def build(offset: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            module = Fused(offset)
            fully_shard(module, mesh=mesh["dp"])
            return module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)

        def whole(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
            out = {n: full_tensor(p.detach()) for n, p in module.named_parameters()}
            out |= {f"{n}.momentum": full_tensor(opt.state[p]["momentum_buffer"]) for n, p in module.named_parameters()}
            return out

        module, opt = build(0.0)
        module(coef).full_tensor().backward()
        opt.step()
        strided = [n for n, p in module.named_parameters() if has_strided(p)]
        saved = whole(module, opt)
        save_checkpoint(Path(out_dir, "ck"), 1, list(module.named_parameters()), opt, plan="D2xT2", optimizer_name="sgd",
                        **kw)  # fmt: skip

        other, other_opt = build(100.0)
        load_checkpoint(Path(out_dir, "ck"), list(other.named_parameters()), other_opt, **kw)
        loaded = whole(other, other_opt)
        result: dict[str, object] = {
            "strided": strided,
            "placements": [repr(p) for p in other.bias.placements],
            "same_layout": {k: torch.equal(v, loaded[k]) for k, v in saved.items()},
        }
        plain = torch.nn.Module()
        plain.bias = torch.nn.Parameter(torch.zeros(N))
        plain.weight = torch.nn.Parameter(torch.zeros(4, N))
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        load_checkpoint(Path(out_dir, "ck"), list(plain.named_parameters()), plain_opt, **kw)
        result["plain"] = {
            **{n: torch.equal(p.detach(), saved[n]) for n, p in plain.named_parameters()},
            **{f"{n}.momentum": torch.equal(plain_opt.state[p]["momentum_buffer"], saved[f"{n}.momentum"])
               for n, p in plain.named_parameters()},
        }  # fmt: skip
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_strided_parameters_and_their_momentum_survive_a_checkpoint(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tests.runtime.mesh_job import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_job, args=(free_port(), str(tmp_path)), nprocs=4, join=True, start_method="spawn")
    keys = ["bias", "weight", "bias.momentum", "weight.momentum"]
    for rank in range(4):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["strided"] == ["bias", "weight"], r  # what DCP refuses, FSDP2-sharded again
        assert "_StridedShard" in " ".join(r["placements"]), r
        assert r["same_layout"] == dict.fromkeys(keys, True), (rank, r)
        assert r["plain"] == dict.fromkeys(keys, True), (rank, r)
