"""DTensor's ``_StridedShard`` placement (private), for fused projections sharded by heads.

A fused projection such as Hugging Face GPT-2's ``c_attn`` (out = ``[Q | K | V]``, each
``heads x head_dim``) must give each tensor-parallel rank its heads of Q, of K and of V, not a
contiguous slice of the fused dimension.  ``_StridedShard(dim, split_factor=parts)`` is
exactly that layout: the dimension is cut into ``parts`` pieces and each piece is sharded over
the mesh, so rank ``r`` holds ``[Q_r | K_r | V_r]`` while the DTensor's global value keeps the
model's own layout (checkpoints, ``--check`` and the optimizer see the unsharded parameter).
DTensor propagates it through ``addmm`` and ``view`` without communication.  This module is
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
