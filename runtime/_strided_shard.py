"""DTensor's ``_StridedShard`` placement (private), for fused projections sharded by heads.

A fused projection such as Hugging Face GPT-2's ``c_attn`` (out = ``[Q | K | V]``, each
``heads x head_dim``) must give each tensor-parallel rank its heads of Q, of K and of V, not a
contiguous slice of the fused dimension.  ``_StridedShard(dim, split_factor=parts)`` is
exactly that layout: the dimension is cut into ``parts`` pieces and each piece is sharded over
the mesh, so rank ``r`` holds ``[Q_r | K_r | V_r]`` while the DTensor's global value keeps the
model's own layout (checkpoints, ``--check`` and the optimizer see the unsharded parameter).
DTensor propagates it through ``addmm`` and ``view`` without communication.  FSDP2 (ZeRO 2/3)
sharding such a parameter again on the same dimension gives placements DTensor's
``full_tensor`` misreads; :func:`full_tensor` gathers them right (``--check``).  This module is
the only user of that private name; ``tests/runtime/test_mesh_hf_blocks.py`` fails clearly when
torch moves or renames it.
"""

from __future__ import annotations

from typing import Any

MODULE = "torch.distributed.tensor.placement_types"
NAME = "_StridedShard"


def _cls() -> Any:
    import importlib

    mod = importlib.import_module(MODULE)
    cls = getattr(mod, NAME, None)
    if cls is None:
        raise RuntimeError(
            f"torch {__import__('torch').__version__} has no {MODULE}.{NAME}: the runtime shards fused "
            "projections (GPT-2's c_attn) by heads with it; update runtime/_strided_shard.py"
        )
    return cls


def check_available() -> None:
    """Raise ``RuntimeError`` naming what moved when torch no longer has the placement."""
    _cls()


def strided_shard(dim: int, parts: int) -> Any:
    """The placement that shards each of ``parts`` equal pieces of ``dim`` over the mesh axis."""
    return _cls()(dim, split_factor=parts)


def is_strided(placement: Any, dim: int, parts: int) -> bool:
    """True when ``placement`` is :func:`strided_shard` ``(dim, parts)``."""
    return (
        isinstance(placement, _cls())
        and int(placement.dim) == dim
        and int(getattr(placement, "split_factor", 0)) == parts
    )


def _refined_later(placements: tuple[Any, ...], i: int) -> bool:
    """True when mesh dimension ``i`` holds a ``_StridedShard`` of a tensor dimension that a later
    mesh dimension shards too: FSDP2's placement for a tensor-parallel DTensor it shards again
    on the same dimension (``_fsdp_param._init_sharding_spec_tp``)."""
    p = placements[i]
    if not isinstance(p, _cls()):
        return False
    from torch.distributed.tensor import Shard

    return any(isinstance(q, (Shard, _cls())) and q.dim == p.dim for q in placements[i + 1 :])


def _gather_along(local: Any, group: Any, dim: int) -> Any:
    """The ranks of ``group``'s pieces of ``local`` concatenated along ``dim`` in rank order
    (pieces of unequal length allowed: FSDP2 chunks as ``torch.chunk``, the last ones shorter or
    empty)."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    n = torch.tensor([local.size(dim)], dtype=torch.int64)
    lengths = [torch.zeros_like(n) for _ in range(size)]
    dist.all_gather(lengths, n, group=group)
    longest = max(int(x) for x in lengths)
    padded = local.new_zeros((*local.shape[:dim], longest, *local.shape[dim + 1 :]))
    padded.narrow(dim, 0, local.size(dim)).copy_(local)
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, int(k)) for p, k in zip(pieces, lengths, strict=True)], dim=dim)


def full_tensor(t: Any) -> Any:
    """``t.full_tensor()`` (a collective over ``t``'s mesh), right also for the layout DTensor
    misreads: FSDP2 (ZeRO 2/3) sharding a head-split fused parameter (GPT-2's ``c_attn.bias``,
    ``_StridedShard(0, 3)`` over "tp") again on dimension 0 over "dp" gives placements
    ``(_StridedShard(0, 2), _StridedShard(0, 3))``, while each rank holds a contiguous chunk of its
    tensor-parallel shard; ``full_tensor`` then interleaves (and zero-fills) the pieces wrongly
    (torch 2.13, tests/runtime/test_strided_full_tensor.py).  Such leading mesh dimensions are
    gathered here by concatenation, in FSDP2's order, and the rest by DTensor."""
    from torch.distributed.tensor import DTensor

    placements = tuple(t.placements)
    mesh = t.device_mesh
    outer = [i for i in range(len(placements)) if _refined_later(placements, i)]
    if not outer:
        return t.full_tensor()
    names = mesh.mesh_dim_names
    last = max(outer)
    if names is None or any(not (p.is_replicate() or i in outer) for i, p in enumerate(placements[: last + 1])):
        raise NotImplementedError(
            f"cannot gather a DTensor with placements {placements} on mesh {names}: only leading "
            "FSDP2 shards of a strided tensor-parallel shard are handled (runtime/_strided_shard.py)"
        )
    local = t.to_local()
    for i in outer:
        local = _gather_along(local, mesh.get_group(i), placements[i].dim)
    rest = mesh[names[last + 1 :]] if last + 2 < len(names) else mesh[names[last + 1]]
    inner = DTensor.from_local(local, rest, placements[last + 1 :], run_check=False, shape=t.shape, stride=t.stride())
    return inner.full_tensor()


def has_strided(t: Any) -> bool:
    """True when ``t`` is a DTensor with a ``_StridedShard`` placement on some mesh dimension
    (what ``torch.distributed.checkpoint`` refuses to save: "overlapping chunks")."""
    placements = getattr(t, "placements", None)
    return placements is not None and any(isinstance(p, _cls()) for p in placements)


def copy_from_full(t: Any, full: Any) -> None:
    """Copy into ``t``'s local shard its elements of ``full`` (``t``'s global value, a plain
    tensor): the inverse of :func:`full_tensor`, whatever the layout.  Each rank gathers, with
    :func:`full_tensor`, a tensor of ``t``'s layout whose local elements are ``rank * numel +
    local index``: the global positions holding this rank's code are where its elements live
    (a collective over ``t``'s mesh, as :func:`full_tensor`)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = t.to_local()
    numel = max(int(t.numel()), 1)
    rank = dist.get_rank()
    codes = torch.arange(local.numel(), dtype=torch.int64, device=local.device).add_(rank * numel)
    coded = DTensor.from_local(codes.view(local.shape), t.device_mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride())  # fmt: skip
    where = full_tensor(coded).reshape(-1)
    mine = (where // numel) == rank
    if int(mine.sum()) != local.numel():  # each local index appears once: every element is set
        raise RuntimeError(
            f"rank {rank}: {int(mine.sum())} of its {local.numel()} elements found in the gathered layout "
            f"of a DTensor with placements {tuple(t.placements)} (runtime/_strided_shard.py)"
        )
    with torch.no_grad():
        flat = local.new_empty(local.numel())
        flat[where[mine] - rank * numel] = full.reshape(-1).to(device=local.device, dtype=local.dtype)[mine]
        local.copy_(flat.view(local.shape))
