"""The notes of rank 0's report: one line each on what the run did that the tables do not say.

:func:`run_notes` makes them all, in the report's order, from what every rank sent
(:func:`runtime.results.rank_results`): training (dtype, learning rate, clipping, loss scale),
``--resume``, the mesh axes, DDP's buckets, the collectives, memory, tensor parallelism's rows,
the data, dropout.
"""

from __future__ import annotations

from typing import Any

from runtime.rank_state import Job


def run_notes(job: Job, source: Any, gathered: list[Any], collectives: Any) -> list[str]:
    """Every note of the report before the check's, in order; ``source``: the run's
    :class:`runtime.data.DataSource`, ``collectives``: :func:`runtime.report.collective_times`."""
    import torch

    from runtime.report import RssRow, collectives_note, rss_note

    args, plan, entry, split, opts = job.args, job.plan, job.entry, job.split, job.opts
    steps, first_step = args.steps, gathered[0]["first_step"]
    notes = [training_note(opts, gathered)]
    if first_step:
        notes.append(
            f"resumed from {args.resume} at step {first_step}: this run trained steps {first_step}..{steps - 1}, "
            f"numbered from 0 in the tables"
        )
    t_deg = plan.tensor_parallel_degree
    mesh_line = mesh_note(plan, split, gathered)
    if mesh_line:
        notes.append(mesh_line)
    bucket_line = bucket_note(gathered)
    if bucket_line:
        notes.append(bucket_line)
    comm_line = collectives_note(plan, collectives)
    if comm_line:
        notes.append(comm_line)
    rss = [RssRow(g["rank"], tuple(g["stages"]), *g["rss"]) for g in gathered if g["rss"][0] is not None]
    if rss:
        notes.append(rss_note(rss))
    if t_deg > 1:
        notes.append(
            f"tensor parallelism T = {t_deg}: the per-rank rows and the timeline show tensor-parallel rank 0 of "
            f"each (stage, replica), numbered k * D + d (its global rank is that number x {t_deg}); the other "
            "tensor-parallel ranks run the same actions in step with it"
        )
    if entry.has_data:
        readers = [g["rank"] for g in gathered if g["reads"]]
        notes.append(
            f"{source.describe(plan.data_parallel_degree)}; read by rank(s) "
            f"{', '.join(map(str, readers))} (the first stage's inputs"
            + (", the last stage's targets" if entry.takes_target else "")
            + "; no other rank reads data)"
        )
    notes.extend(f"warning: {w}" for w in gathered[0]["warnings"])  # every rank judged the same reports
    if any(isinstance(mod, torch.nn.Dropout) and mod.p > 0 for mod in entry.model.modules()):
        notes.append(
            "dropout: every layer draws from its own random stream, seeded by (seed, step, replica, "
            "micro-batch, layer), in the pipelined run and in the --check reference alike"
        )
    return notes


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


def data_parallel_note(spec: Any, gathered: list[Any], *, context: int = 1) -> list[str]:
    """The mesh note's part on which path reduced the data-parallel gradients (empty for D = 1
    and ZeRO 2/3, whose note says FSDP2); ``context``: C, folded into the data axis."""
    meshes = [g["mesh"] for g in gathered]
    path = meshes[0].get("dp_path", "none")
    if path == "ddp":
        left: dict[str, int] = {}
        for m in (g["mesh"] for g in gathered if g["replica"] == 0 and g["tp_rank"] == 0 and g["cp_rank"] == 0):
            for why, n in m["dp_left"].items():
                left[why] = left.get(why, 0) + n
        tensors = sum(g["mesh"]["dp_ddp_tensors"] for g in gathered if g["replica"] == 0 and g["tp_rank"] == 0
                      and g["cp_rank"] == 0)  # fmt: skip
        n = spec.data_parallel_degree
        over = f"ranks of each stage's data axis (D x C = {n // context} x {context})" if context > 1 else "replicas of each stage"
        left_note = ", ".join(f"{k} tensor(s) {why}" for why, k in sorted(left.items()))
        return [
            f"data-parallel gradients: torch DDP over the {n} {over} ({tensors} tensor(s)), bucketed "
            f"({meshes[0]['dp_bucket_mb']:g} MiB buckets, built on the first step's gradient order: the first step "
            "reduces one bucket) and all-reduced during each stage's last micro-batch's backward"
            + (f"; left to the runtime's reductions after the schedule: {left_note}" if left else "")
        ]
    if path == "all-reduce":
        return [f"data-parallel gradients: the runtime's flat all-reduce after the schedule ({meshes[0]['dp_why']})"]
    return []


def bucket_note(gathered: list[Any]) -> str:
    """The report's note on the DDP buckets of each rank's last step: when each was launched and
    done, in ms from the start of the rank's last backward, beside that backward's end (the
    evidence that the reduction ran during the backward)."""
    parts = []
    for g in gathered:
        if g["tp_rank"] != 0 or g["cp_rank"] != 0:
            continue
        rec = g["mesh"].get("dp_last_buckets")
        if not rec:
            continue
        buckets = "; ".join(
            f"#{b['index']} [{', '.join(b['layers'])}] {b['bytes']} B launched {b['launched_ms']:.3f} done "
            f"{b['done_ms']:.3f}"
            for b in rec["buckets"]
        )
        parts.append(f"rank {g['rank']}: {buckets}; backward ended {rec['backward_ms']:.3f}")
    if not parts:
        return ""
    return (
        "data-parallel buckets of the last step (ms from the start of the rank's last backward; a bucket is "
        "launched when its last gradient is ready): " + " | ".join(parts)
    )


def training_note(opts: Any, gathered: list[Any]) -> str:
    """One line: dtype, learning-rate schedule, clipping (and how often it clipped), loss scaling."""
    parts = [
        "float32"
        if not opts.mixed
        else f"{opts.dtype} autocast with float32 master weights, gradients and optimizer state"
        + (" and dynamic loss scaling" if opts.dtype == "float16" else "")
    ]
    lr = f"lr {opts.lr:g}"
    if opts.warmup_steps:
        lr += f" after {opts.warmup_steps} linear warm-up step(s)"
    if opts.lr_schedule == "cosine":
        lr += f", cosine decay to {opts.min_lr:g}"
    parts.append(lr)
    if opts.clip_grad_norm is not None:
        norms = [n for n in gathered[0]["grad_norms"] if n is not None]
        clipped = sum(1 for n in norms if n > opts.clip_grad_norm)
        parts.append(
            f"gradients clipped to global norm {opts.clip_grad_norm:g} (norm above it on {clipped} of {len(norms)} steps)"
        )
    skipped = sum(gathered[0]["skipped"])
    if skipped:
        parts.append(f"{skipped} step(s) skipped for inf/NaN gradients")
    return "training: " + ", ".join(parts)
