"""After the last step: every rank's measurements go to rank 0, which makes the report.

:func:`rank_results` is what one rank sends (times, losses, memory, what the mesh axes did and,
with ``--check``, its gradients and final parameters); :func:`gather` sends it; rank 0's
:func:`finish` folds every rank's into the measured-vs-predicted report
(:func:`runtime.report.build_report`, its notes from :mod:`runtime.report_notes`), adds the
check (:mod:`runtime.rank_check`), prints it and writes it.

:func:`rank_results` lives in :mod:`runtime.results_rank` (still importable from here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.faults import CheckFailedError
from runtime.rank_check import add_check
from runtime.rank_state import Job
from runtime.report_notes import run_notes
from runtime.results_rank import rank_results as rank_results


def gather(rank: int, world: int, mine: dict[str, Any]) -> list[Any]:
    """Every rank's :func:`rank_results` on rank 0 (empty elsewhere)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    dist.barrier()
    return gathered


def finish(job: Job, source: Any, gathered: list[Any]) -> int:
    """Rank 0: the report of every rank's measurements (and the check), printed and written;
    raises :class:`runtime.faults.CheckFailedError` when the check failed."""
    from runtime.report import RankRecord, build_report, collective_times, render_lines

    args, plan, opts = job.args, job.plan, job.opts
    run_steps = args.steps - gathered[0]["first_step"]  # first_step > 0 when resumed from a checkpoint
    step_ms = [max(g["step_ms"][i] for g in gathered) for i in range(run_steps)]
    losses: list[float | None] = []
    for i in range(run_steps):
        vals = [g["losses"][i] for g in gathered if g["losses"][i] is not None]
        losses.append(sum(vals) / len(vals) if vals else None)
    fwd, bwd, peak = _stage_times(gathered)
    t_deg = plan.tensor_parallel_degree
    collectives = collective_times(plan, [g["comm"] for g in gathered])
    report = build_report(
        plan,
        model=args.model,
        step_ms=step_ms,
        losses=losses,
        stage_forward_ms=fwd,
        stage_backward_ms=bwd,
        peak_memory=peak,
        backend=job.backend,
        device=str(job.device.type),
        optimizer=opts.optimizer,
        lr=args.lr,
        seed=args.seed,
        threads_per_rank=gathered[0]["threads"],
        notes=run_notes(job, source, gathered, collectives),
        ranks=[
            RankRecord(
                # T > 1: tensor-parallel rank 0 of each (stage, replica), numbered k * D + d (see the note)
                # C > 1: context-parallel rank 0 of each, numbered the same way ((k * D + d) * C * T is its rank)
                rank=g["rank"] // t_deg // plan.context_parallel_degree,
                pipeline_rank=g["pipeline_rank"],
                replica=g["replica"],
                host=g["host"],
                stages=g["stages"],
                allreduce_bytes=g["allreduce_bytes"],
                phases=g["phases"],
                events={s: g["timings"][s]["events"] for s in g["stages"]},
            )
            for g in gathered
            if g["tp_rank"] == 0 and g["cp_rank"] == 0  # context-parallel ranks: in step with rank c = 0
        ],
        collectives=collectives,
    )
    failed = None
    if args.check:
        report, failed = add_check(job, gathered, losses, report)
    text = report.to_json()
    if args.report:
        Path(args.report).write_text(text + "\n", encoding="utf-8")
    if args.run_dir:
        Path(args.run_dir, "report.json").write_text(text + "\n", encoding="utf-8")
    print("\n".join(render_lines(report)), flush=True)
    if args.report:
        print(f"report written to {args.report}", flush=True)
    if args.log_file:
        print(f"per-step log written to {args.log_file}", flush=True)
    if failed:
        raise CheckFailedError(failed)
    return 0


def _stage_times(
    gathered: list[Any],
) -> tuple[dict[int, list[list[float]]], dict[int, list[list[float]]], dict[int, int | None]]:
    """Per stage: forward and backward times per step (every replica's samples) and the peak
    device memory of its ranks."""
    fwd: dict[int, list[list[float]]] = {}
    bwd: dict[int, list[list[float]]] = {}
    peak: dict[int, int | None] = {}
    for g in gathered:
        if g["tp_rank"] != 0:  # the other tensor-parallel ranks ran the same actions at the same time
            if g["peak"] is not None:
                for s in g["stages"]:
                    peak[s] = max(peak.get(s) or 0, g["peak"])
            continue
        for s in g["stages"]:
            t = g["timings"][s]
            # replicas of one stage: keep every replica's samples
            for i, per in enumerate(t["forward"]):
                fwd.setdefault(s, [[] for _ in t["forward"]])[i].extend(per)
            for i, per in enumerate(t["backward"]):
                bwd.setdefault(s, [[] for _ in t["backward"]])[i].extend(per)
            if g["peak"] is not None:
                peak[s] = max(peak.get(s) or 0, g["peak"])
    return fwd, bwd, peak
