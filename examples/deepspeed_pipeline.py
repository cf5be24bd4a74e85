"""A DeepSpeed ``PipelineModule`` that takes its stage boundaries from a pipeplan plan.

DeepSpeed balances a ``PipelineModule`` by parameters, layer type or layer count, and has no
argument for explicit boundaries.  This subclass overrides ``_partition_layers`` to use the
boundaries that ``pipeplan export PLAN --to deepspeed -o ds_config.json`` writes, and turns on
activation checkpointing for the stages the plan recomputes (layer by layer, each layer its own
checkpoint, as pipeplan prices it).  Copy this file next to your training script::

    from deepspeed_pipeline import PlannedPipelineModule

    layers = [LayerSpec(Embedding, ...), *[LayerSpec(Block, ...) for _ in range(n)], LayerSpec(Head, ...)]
    model = PlannedPipelineModule.from_config(layers, "ds_config.json", loss_fn=loss_fn)
    engine, _, _, _ = deepspeed.initialize(model=model, config="ds_config.json",
                                           model_parameters=model.parameters())

``layers`` must hold one entry per layer of the plan, in the plan's order (the config lists
their names under ``pipeline.pipeplan.layer_names``).  Launch pipeline degree x data-parallel
ranks (``deepspeed --num_gpus N train.py``).  Written for DeepSpeed 0.19; it imports DeepSpeed,
pipeplan itself never does.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

from deepspeed.runtime.pipe import PipelineModule


class PlannedPipelineModule(PipelineModule):  # type: ignore[misc]
    """``PipelineModule`` with explicit boundaries: stage ``s`` holds ``layers[parts[s]:parts[s+1]]``.

    ``recompute[s]`` checkpoints the layers of stage ``s`` one by one
    (``activation_checkpoint_interval`` = 1: each keeps its input and re-runs in the backward).  Other keyword arguments go to ``PipelineModule`` (``num_stages``
    defaults to ``len(parts) - 1``; give ``topology`` instead for tensor parallelism).
    """

    def __init__(
        self,
        layers: Sequence[Any],
        *,
        parts: Sequence[int],
        recompute: Sequence[bool] | None = None,
        **kwargs: Any,
    ) -> None:
        parts = [int(p) for p in parts]
        if len(parts) < 2 or parts[0] != 0 or parts[-1] != len(layers) or any(b <= a for a, b in itertools.pairwise(parts)):
            raise ValueError(
                f"parts {parts} must rise strictly from 0 to len(layers) = {len(layers)}: the plan has "
                f"{parts[-1] if parts else 0} layers, so `layers` needs one entry per plan layer"
            )
        recompute = [bool(r) for r in (recompute or [False] * (len(parts) - 1))]
        if len(recompute) != len(parts) - 1:
            raise ValueError(f"recompute has {len(recompute)} entries for {len(parts) - 1} stages")
        # read by _partition_layers, which PipelineModule.__init__ calls
        self._planned_parts = parts
        if kwargs.get("topology") is None:
            kwargs.setdefault("num_stages", len(parts) - 1)
        super().__init__(layers, partition_method="pipeplan", **kwargs)
        if recompute[self.stage_id]:
            interval = 1
            if hasattr(self, "set_checkpoint_interval"):
                self.set_checkpoint_interval(interval)
            else:  # DeepSpeed before set_checkpoint_interval existed
                self.activation_checkpoint_interval = interval

    def _partition_layers(self, method: str = "pipeplan") -> None:
        if len(self._planned_parts) != self.num_stages + 1:
            raise ValueError(
                f"the plan has {len(self._planned_parts) - 1} stages but this pipeline has {self.num_stages}: "
                "launch pipeline degree x data-parallel ranks, as the plan says"
            )
        self.parts = list(self._planned_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    @classmethod
    def from_config(cls, layers: Sequence[Any], ds_config: str | dict[str, Any], **kwargs: Any) -> PlannedPipelineModule:
        """Build from a ``ds_config.json`` written by ``pipeplan export --to deepspeed``."""
        if not isinstance(ds_config, dict):
            with open(ds_config, encoding="utf-8") as f:
                ds_config = json.load(f)
        planned = ds_config.get("pipeline", {}).get("pipeplan")
        if planned is None:
            raise ValueError("this DeepSpeed config has no pipeline.pipeplan entry: write it with pipeplan export --to deepspeed")
        names = planned.get("layer_names", [])
        if names and len(names) != len(layers):
            raise ValueError(
                f"the plan has {len(names)} layers ({names[0]} .. {names[-1]}) but `layers` has {len(layers)}: "
                "give one entry per plan layer, in the plan's order"
            )
        return cls(layers, parts=planned["parts"], recompute=planned.get("recompute"), **kwargs)
