"""The batches every rank and the unsplit reference train on: the global batch of a step
(:func:`global_batch`: the entry point's data function, or :func:`synthetic_batch`), a
data-parallel replica's rows of it and a fingerprint that says whether ranks agree.

The same ``(seed, step)`` must give the same batch everywhere, or ``--check`` would compare
different things.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def synthetic_batch(example_inputs: Sequence[Tensor], batch_size: int, *, seed: int, step: int) -> tuple[Tensor, ...]:
    """One global batch shaped like ``example_inputs`` (batch dimension ``batch_size``).

    Floating inputs are standard normal; integer inputs (token ids, labels) are uniform over
    the range the example spans; booleans are fair coins.  The same ``(seed, step)`` gives
    the same batch on every rank and in the reference.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    out = []
    for t in example_inputs:
        shape = (batch_size, *t.shape[1:])
        if t.dtype == torch.bool:
            x = torch.randint(0, 2, shape, generator=gen).bool()
        elif t.is_floating_point() or t.is_complex():
            x = torch.randn(shape, generator=gen, dtype=torch.float32).to(t.dtype)
        else:
            lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 1)
            x = torch.randint(lo, max(hi, lo) + 1, shape, generator=gen, dtype=t.dtype)
        out.append(x)
    return tuple(out)


def global_batch(
    example_inputs: Sequence[Tensor],
    batch_size: int,
    *,
    seed: int,
    step: int,
    data_fn: Callable[[int, int], Any] | None = None,
    spec: str = "the entry point",
    keywords: Sequence[str] = (),
) -> tuple[Tensor, ...]:
    """The global batch of ``step``: ``data_fn(step, batch_size)`` when given, else synthetic.

    The data function's batch is checked against ``example_inputs`` (shapes, dtypes) and an
    :class:`~planner.errors.InputError` says what came back instead.  ``seed`` only shapes
    the synthetic data: a data function depends on ``(step, batch_size)`` alone.
    """
    if data_fn is None:
        return synthetic_batch(example_inputs, batch_size, seed=seed, step=step)
    from profiler.loading import call_data_fn

    return call_data_fn(data_fn, example_inputs, step=step, batch_size=batch_size, spec=spec, keywords=keywords)


def batch_fingerprint(batch: Sequence[Tensor]) -> int:
    """A 63-bit hash of a batch's shapes, dtypes and bytes (to check that ranks agree)."""
    h = hashlib.blake2b(digest_size=8)
    for t in batch:
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def replica_shard(batch: Sequence[Tensor], replica: int, replicas: int) -> tuple[Tensor, ...]:
    """Rows of data-parallel replica ``replica`` (contiguous, equal shares)."""
    n = batch[0].shape[0] // replicas
    return tuple(t[replica * n : (replica + 1) * n] for t in batch)
