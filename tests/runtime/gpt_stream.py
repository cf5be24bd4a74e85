"""``examples.gpt:tiny`` (same layers and weights) reading an *iterable* of batches: the toy token
stream of :func:`examples.gpt.token_stream` through ``Loader(make)``, for the resume test (a
resumed run must skip the batches its checkpoint already trained on)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

from examples.gpt import GPT, GPTConfig, build, lm_loss, token_stream
from runtime.data import Loader


def tiny() -> tuple[GPT, tuple[Tensor], Callable[[Tensor], Tensor], Any]:
    cfg = GPTConfig()
    model, _ = build(cfg)
    data = token_stream(cfg)

    def make(batch_size: int) -> Iterator[Tensor]:
        step = 0
        while True:
            yield data(step, batch_size)
            step += 1

    return model, (data(0, cfg.batch),), lm_loss, Loader(make)
