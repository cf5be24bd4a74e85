"""The notes of rank 0's report: one line each on what the run did that the tables do not say.

:func:`run_notes` makes them all, in the report's order, from what every rank sent
(:func:`runtime.results_rank.rank_results`): training (dtype, learning rate, clipping, loss scale),
``--resume``, the mesh axes, DDP's buckets, the collectives, memory, tensor parallelism's rows,
the data, dropout.

Its parts: :mod:`runtime.report_notes_mesh` the mesh axes' note (:func:`mesh_note`),
:mod:`runtime.report_notes_data` the data-parallel path and DDP's buckets
(:func:`data_parallel_note`, :func:`bucket_note`); every name is still importable from here.
"""

from __future__ import annotations

from typing import Any

from runtime.rank_state import Job
from runtime.report_notes_data import bucket_note as bucket_note
from runtime.report_notes_data import data_parallel_note as data_parallel_note
from runtime.report_notes_mesh import mesh_note as mesh_note


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
