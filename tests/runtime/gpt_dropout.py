"""``examples.gpt:tiny`` (same layers and weights) with dropout 0.1 in the embedding, the
attention and after both projections, for the recompute run: a checkpointed layer's re-run must
draw the forward's dropout masks, or ``run --check`` fails."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from examples.gpt import GPT, GPTConfig, build, lm_loss


def tiny() -> tuple[GPT, tuple[Tensor], Callable[[Tensor], Tensor]]:
    model, inputs = build(GPTConfig(dropout=0.1))
    return model, inputs, lm_loss
