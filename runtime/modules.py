"""Module wrappers the executor puts around a stage (needs torch)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


class Recompute(nn.Module):
    """Runs ``inner`` under ``torch.utils.checkpoint``: the stage keeps only its input per
    micro-batch and recomputes its activations during the backward pass."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False)
