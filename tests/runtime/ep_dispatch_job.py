"""Run under ``torchrun --nproc-per-node 2``: runtime.experts' dispatch and combine around a
per-expert matrix product equal the product done locally, forward and backward, for routings
that leave experts, ranks or the whole batch without tokens.  Prints ``ok`` per case and rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.experts import Combine, Dispatch

EXPERTS, H = 4, 3


def _case(counts: list[int], weights: torch.Tensor, rank: int) -> bool:
    c = torch.tensor(counts if rank == 0 else counts[::-1])
    offsets = torch.cumsum(c, 0).to(torch.int32)
    x = torch.randn(int(c.sum()), H, requires_grad=True)
    expert = torch.repeat_interleave(torch.arange(EXPERTS), c)
    ref = torch.einsum("nh,nhk->nk", x, weights[expert])
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x) if x.numel() else (torch.zeros_like(x),)
    rows, local_offsets, order, send, recv = Dispatch(dist.group.WORLD, experts=EXPERTS)(x, offsets)
    local = EXPERTS // dist.get_world_size()
    counts_here = torch.diff(local_offsets.long(), prepend=torch.zeros(1, dtype=torch.long))
    mine = torch.repeat_interleave(torch.arange(local), counts_here) + rank * local
    y = Combine(dist.group.WORLD)(torch.einsum("nh,nhk->nk", rows, weights[mine]), order, send, recv)
    y.square().sum().backward()
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return torch.allclose(y, ref, atol=1e-6) and torch.allclose(grad, ref_grad, atol=1e-6)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    weights = torch.randn(EXPERTS, H, H, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(rank)
    for counts in ([2, 1, 3, 1], [5, 0, 0, 0], [0, 0, 0, 3], [2, 0, 1, 0], [0, 0, 0, 0]):
        print(f"rank {rank} {counts}: {'ok' if _case(counts, weights, rank) else 'WRONG'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
