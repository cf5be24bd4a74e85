"""What one rank sends to rank 0 after the last step (:func:`rank_results`): its times, losses,
memory, what the mesh axes did and, with ``--check``, its gradients and final parameters.
:func:`runtime.results.gather` sends it; :func:`runtime.results.finish` reads it on rank 0.
"""

from __future__ import annotations

import socket
from typing import Any

from runtime.gradients import local
from runtime.rank_state import RankState, StageSet, StepRecords, Training
from runtime.stage_timing import bucket_rows


def rank_results(state: RankState, built: StageSet, training: Training, records: StepRecords) -> dict[str, Any]:
    """What this rank sends to rank 0 (with ``--check``: a collective, every rank joins it)."""
    import torch

    from runtime.mesh import full_parameters, reduces_data_gradients
    from runtime.report import peak_rss_bytes

    job, plan, spec, c = state.job, state.plan, state.spec, state.job.coords
    params, opt = training.params, training.opt
    peak = int(torch.cuda.max_memory_allocated(job.device)) if job.device.type == "cuda" else None
    mine: dict[str, Any] = {
        "rss": (peak_rss_bytes(), records.rss_first_step, job.rss_before_model, records.peak_in_training),
        "rank": c.rank,
        # the data-parallel replica d (the mesh's data axis folds context parallelism in: d * C + c)
        "replica": training.data_replica,
        "cp_rank": c.replica % plan.context_parallel_degree,
        "stages": job.my_stages,
        "step_ms": records.step_ms,
        "losses": records.losses,
        "timings": built.timings,
        "phases": records.phases,
        "host": socket.gethostname(),
        "tp_rank": c.tp_rank,
        "mesh": {
            "tp_layers": [u for s in job.my_stages for u in range(plan.stages[s].start, plan.stages[s].stop) if u in c.shardings],
            "fsdp": sum(1 for p in params if reduces_data_gradients(spec, p)),
            # layers FSDP2 gathers one by one (runtime.mesh.apply_data_sharding)
            "fsdp_layers": sum(1 for m in built.modules for u in m.units if _is_fsdp(u)),
            "optimizer": type(opt).__name__ if opt is not None else None,
            # which path reduced the data-parallel gradients (runtime.mesh.gradient_reduction)
            "dp_path": built.reduction.path,
            "dp_why": built.reduction.why,
            "dp_bucket_mb": built.bucket_mb,
            "dp_ddp_tensors": len(built.by_ddp),
            "dp_left": {why: len(ids) for why, ids in built.left_to_us.items()},
            "dp_last_buckets": bucket_rows(*records.last_buckets),
            "vocab_parallel_losses": built.vocab_parallel_losses,
            **built.axes.report(),  # context- and expert-parallel layers (runtime/axes.py)
        },
        "pipeline_rank": c.pp_rank,
        "comm": records.comm,
        "first_step": training.first_step,
        # what the flat all-reduce after the schedule carries (the phase calibration times)
        "allreduce_bytes": sum(
            local(p).numel() * p.element_size()
            for p in params
            if not reduces_data_gradients(spec, p) and id(p) not in built.by_ddp
        )
        if state.dp_group is not None
        else 0,
        "peak": peak,
        "threads": torch.get_num_threads(),
        "params": None,
        "reads": training.reads,
        "batches_read": training.reader.read if training.reader is not None else 0,
        "grad_norms": records.grad_norms,
        "skipped": records.skipped,
        "warnings": records.warnings,
    }
    if job.args.check:  # every rank gathers its DTensors whole (a collective); replica 0, tp rank 0 sends them
        full = full_parameters(training.named)
        if c.replica == 0 and c.tp_rank == 0:
            mine["params"] = full
            mine["check_norms"] = records.check_norms
            mine["check_grads"] = records.check_grads
    return mine


def _is_fsdp(module: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
