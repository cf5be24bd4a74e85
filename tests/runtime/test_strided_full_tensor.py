"""Gathering a head-split fused parameter that FSDP2 sharded again (ZeRO 2/3 with T > 1).

GPT-2's ``c_attn`` is sharded by heads over "tp" (``_StridedShard(0, 3)`` on its bias: rank ``r``
holds ``[Q_r | K_r | V_r]``); ``fully_shard`` over "dp" then gives each rank a contiguous chunk
of that shard and labels the bias ``(_StridedShard(0, 2), _StridedShard(0, 3))``, which
DTensor's ``full_tensor`` reads as another layout (torch 2.13: the pieces interleaved wrongly,
some zero-filled).  ``--check`` gathered parameters and gradients that way, and GPT-2 at
D = 2 x T = 2 with ZeRO 2 failed it on ``c_attn.bias`` (1.55 relative) while training was right.

4 gloo ranks, a 2 x 2 ("dp", "tp") mesh: the bias ``[24]`` and the transposed weight ``[4, 24]``
(sharded on dimension 1, which FSDP2 does not touch), forward and backward through FSDP2, then
:func:`runtime.mesh.full_parameters` and :func:`runtime.mesh.full_gradients` against the values
whole; a bias of 6 (3 elements per tensor-parallel rank, chunked 2 + 1 over "dp") checks
uneven chunks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _job(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from runtime._strided_shard import strided_shard
    from runtime.mesh import full_gradients, full_parameters

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
        result: dict[str, object] = {}
        for n in (24, 6):
            bias = torch.arange(n, dtype=torch.float32)
            weight = torch.arange(4 * n, dtype=torch.float32).view(4, n)
            coef = torch.linspace(-1.0, 1.0, n)

            class Fused(torch.nn.Module):
                def __init__(self, bias: torch.Tensor, weight: torch.Tensor) -> None:
                    super().__init__()
                    self.bias = torch.nn.Parameter(distribute_tensor(bias.clone(), tp, [strided_shard(0, 3)]))
                    self.weight = torch.nn.Parameter(distribute_tensor(weight.clone(), tp, [strided_shard(1, 3)]))

                def forward(self, c: torch.Tensor) -> torch.Tensor:
                    return (self.bias * c).sum() + (self.weight * c).sum()

            module = Fused(bias, weight)
            fully_shard(module, mesh=mesh["dp"])
            placements = [repr(p) for p in module.bias.placements]
            module(distribute_tensor(coef, tp, [strided_shard(0, 3)])).full_tensor().backward()
            params = full_parameters(module.named_parameters())
            grads = full_gradients(module.named_parameters())
            result[str(n)] = {
                "placements": placements,
                "bias": torch.equal(params["bias"], bias),
                "weight": torch.equal(params["weight"], weight),
                "bias_grad": torch.allclose(grads["bias"], coef),
                "weight_grad": torch.allclose(grads["weight"], coef.expand(4, n)),
                "bias_grad_value": grads["bias"].tolist(),
            }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_check_gathers_fsdp_sharded_head_split_parameters_whole(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tests.runtime.mesh_job import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_job, args=(free_port(), str(tmp_path)), nprocs=4, join=True, start_method="spawn")
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for n, r in result.items():
            # the layout this test is about (when torch labels it otherwise, revisit runtime/_strided_shard.py)
            assert r["placements"] == ["_StridedShard(dim=0, sf=2)", "_StridedShard(dim=0, sf=3)"], (n, r)
            assert r["bias"] and r["weight"] and r["weight_grad"], (rank, n, r)
            assert r["bias_grad"], (rank, n, r["bias_grad_value"])
