"""The report's mesh note (:func:`mesh_note`): what tensor and sequence parallelism, the
vocabulary-parallel loss, MoE experts, ZeRO, the data-parallel path (:mod:`runtime.report_notes_data`)
and the context and expert axes (:func:`runtime.axes.axes_note`) did, on one line.
"""

from __future__ import annotations

from typing import Any

from runtime.report_notes_data import data_parallel_note


def mesh_note(plan: Any, split: Any, gathered: list[Any]) -> str:
    """One line on what the mesh axes did (empty for a K x D plan with ZeRO 0)."""
    from runtime.mesh import MeshSpec

    spec = MeshSpec.of(plan)
    parts = []
    if spec.tensor_parallel_degree > 1:
        from runtime.mesh import profiled_kinds

        sharded = sorted({u for g in gathered for u in g["mesh"]["tp_layers"]})
        kinds = profiled_kinds(split)
        whole = [
            split.names[u] + (f" (priced as {kinds[u]}-sharded by the plan: its memory is above the prediction)"
                              if kinds[u] != "replicated" else "")
            for u in range(len(split.names))
            if u not in sharded
        ]  # fmt: skip
        parts.append(
            f"tensor parallelism T = {spec.tensor_parallel_degree} on {len(sharded)} layer(s) "
            f"({', '.join(split.names[u] for u in sharded)})"
            + (f"; run whole on every tensor-parallel rank: {', '.join(whole)}" if whole else "")
        )
        if any(g["mesh"].get("vocab_parallel_losses") for g in gathered):
            parts.append(
                "vocabulary-parallel loss: the head's logits stay sharded along the vocabulary into the "
                "cross-entropy (torch's loss_parallel; no rank gathers them, as Megatron's vocab-parallel loss)"
            )
        from runtime.mesh import _has_grouped_experts

        moe = [split.names[u] for u in sharded if _has_grouped_experts(split.units[u])]
        if moe:
            parts.append(
                f"mixture-of-experts layers {', '.join(moe)}: each expert's FFN (and a shared expert's) split along "
                f"its hidden width over T, the router replicated; their MoE modules run on local tensors with "
                "Megatron's collectives (the experts' input gradient; the output, combined first and reduced "
                "once), not counted among DTensor's collectives"
                + ("; under sequence parallelism their input is all-gathered and their output reduce-scattered "
                   "along the sequence" if spec.sequence_parallel else "")
            )  # fmt: skip
        if spec.sequence_parallel:
            from runtime.mesh import KIND_RULES, sequence_parallel_note

            # the embedding and head shard over T but run on the whole sequence
            parts.append(sequence_parallel_note(spec, sum(kinds[u] not in KIND_RULES for u in sharded)))
    if spec.zero_stage and spec.data_parallel_degree > 1:
        if spec.zero_stage >= 2:
            first = [g for g in gathered if g["replica"] == 0 and g["tp_rank"] == 0]
            n = sum(g["mesh"]["fsdp"] for g in first)
            layers = sum(g["mesh"]["fsdp_layers"] for g in first)
            parts.append(
                f"ZeRO {spec.zero_stage}: FSDP2 fully_shard over the {spec.data_parallel_degree} replicas of each "
                f"stage, layer by layer ({layers} layer group(s), then each stage's rest; "
                f"{n} parameter tensor(s) sharded, reshard after forward: "
                f"{'yes' if spec.reshard_after_forward() else 'no'}; tied weights across stages stay whole)"
            )
        else:
            kinds = sorted({str(g["mesh"]["optimizer"]) for g in gathered})
            parts.append(
                f"ZeRO 1: optimizer state sharded over the {spec.data_parallel_degree} replicas ({', '.join(kinds)})"
            )
    parts += data_parallel_note(spec, gathered, context=plan.context_parallel_degree)
    from runtime.axes import axes_note

    parts += axes_note(plan, [g["mesh"] for g in gathered if g["replica"] == 0 and g["tp_rank"] == 0 and g["cp_rank"] == 0])
    return "mesh: " + "; ".join(parts) if parts else ""
