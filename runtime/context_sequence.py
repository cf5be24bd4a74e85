"""How context parallelism (the plan's C) cuts the sequence (needs torch).

Causal load balancing, as Megatron-LM and torch do: the sequence is cut into 2C chunks and
context-parallel rank c holds chunks c and 2C-1-c (:func:`chunks_of`), so every rank has the same
share of the causal triangle.  :func:`local_positions` are the global positions a rank holds,
:func:`local_sequence` cuts an input (every input whose dimension 1 is the sequence length),
:func:`sequence_length` reads s from the model's example inputs and :func:`check_sequence`
refuses an s that 2C does not divide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from planner.errors import InputError


def sequence_length(example_inputs: Sequence[Any]) -> int:
    """The sequence length s: dimension 1 of the first input (token ids ``[batch, seq]``)."""
    first = example_inputs[0] if example_inputs else None
    if not isinstance(first, Tensor) or first.dim() < 2:
        shape = tuple(first.shape) if isinstance(first, Tensor) else type(first).__name__
        raise InputError(f"context parallelism needs the model's first input shaped [batch, sequence, ...]; it is "
                         f"{shape}: replan with --context-parallel 1")  # fmt: skip
    return int(first.shape[1])


def chunks_of(rank: int, degree: int) -> tuple[int, int]:
    """The two of the 2C sequence chunks context-parallel ``rank`` holds: c and 2C-1-c."""
    return rank, 2 * degree - 1 - rank


def local_positions(seq: int, rank: int, degree: int) -> Tensor:
    """Global positions of the tokens context-parallel ``rank`` holds, in its order."""
    size = seq // (2 * degree)
    return torch.cat([torch.arange(i * size, (i + 1) * size) for i in chunks_of(rank, degree)])


def local_sequence(t: Any, seq: int, rank: int, degree: int) -> Any:
    """``t``'s tokens on context-parallel ``rank`` when its dimension 1 is the sequence, else ``t``."""
    if not isinstance(t, Tensor) or t.dim() < 2 or t.shape[1] != seq:
        return t
    return t.index_select(1, local_positions(seq, rank, degree).to(t.device))


def check_sequence(seq: int, degree: int) -> None:
    if seq % (2 * degree):
        raise InputError(f"context parallelism C={degree}: the sequence length {seq} is not divisible by 2C = "
                         f"{2 * degree} (each rank holds two chunks, for causal balance): replan with a "
                         "--context-parallel C such that 2C divides it")  # fmt: skip
