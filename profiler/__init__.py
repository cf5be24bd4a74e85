"""Profiler: measures a torch.nn.Module per layer (needs torch) and synthesizes profiles (does not).

``import profiler`` does not import torch; ``profiler.profile`` loads the measuring code on
first use.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "profile":
        from profiler.measure import profile

        return profile
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")
