"""Profiler: measures a torch.nn.Module per layer (needs torch) and synthesizes profiles (does not).

``import profiler`` does not import torch; the measuring names load on first use:

* ``profiler.profile(model, example_inputs, *, microbatch_sizes=..., device=...)`` -> ``Profile``
  (:mod:`profiler.measure`);
* ``profiler.split_model(model, example_inputs, *, split_points=None)`` -> ``SplitModel``, the
  executable units shared with the runtime (:mod:`profiler.split`; captured by
  :mod:`profiler.capture`), warning with ``CutWarning`` where a block boundary cannot be cut;
* ``profiler.stage_saved_bytes(split, batch, ranges)``: what each stage really keeps for
  backward, the truth the profile's memory predicts;
* ``profiler.load_entrypoint("examples.gpt:tiny")`` -> ``Entrypoint`` (:mod:`profiler.loading`);
* ``profiler.fake_profile(make_entry, *, device_type=...)`` -> a ``Profile`` traced on fake tensors,
  times priced by the device model (:mod:`profiler.fake`); ``profiler.hf_entrypoint(path, seq=...)``
  builds a Hugging Face model from its config.json (:mod:`profiler.hf_config`);
* ``profiler.synth_transformer(...)`` -> an analytic ``Profile`` (:mod:`profiler.synth`, torch-free).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "profile": "profiler.measure",
    "measure_split": "profiler.measure",
    "stage_saved_bytes": "profiler.measure",
    "CutWarning": "profiler.split",
    "RngStreams": "profiler.split",
    "split_model": "profiler.split",
    "split_for_profile": "profiler.split",
    "SplitModel": "profiler.split",
    "load_entrypoint": "profiler.loading",
    "Entrypoint": "profiler.loading",
    "default_loss": "profiler.loading",
    "synth_transformer": "profiler.synth",
    "fake_profile": "profiler.fake",
    "hf_entrypoint": "profiler.hf_config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
