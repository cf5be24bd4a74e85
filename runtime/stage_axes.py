"""The steps that make one stage, one per axis, in the order :func:`runtime.stages.build_stages`
calls them (context and expert parallelism, between the first two, is ``runtime/axes.py``):

- :func:`stage_module`: the splitter's units of the stage, with the dropout streams (and
  ``--inject-fault R:S:skip-layer``'s skipped layer);
- :func:`parallelize`: selective recompute, tensor (and sequence) parallelism, recompute,
  autocast (:func:`wrap_stage`), then FSDP2 outermost (:func:`runtime.mesh.apply_mesh`);
- :func:`wrap_data_parallel`: torch DDP over the data axis;
- :func:`pipeline_stage`: torch's ``PipelineStage``, its actions timed.
"""

from __future__ import annotations

from typing import Any

from runtime.rank_state import RankState, StageSet
from runtime.stage_timing import time_stage


def stage_module(state: RankState, s: int, skipped_unit: int | None) -> Any:
    """Stage ``s``'s units from the splitter, drawing dropout from the rank's streams; the unit
    ``--inject-fault R:S:skip-layer`` skips is wrapped in :class:`runtime.modules.SkipFrom`."""
    sp = state.plan.stages[s]
    mod: Any = state.job.split.stage_module(sp.start, sp.stop, pipeline=True)
    mod.rng = state.streams
    if skipped_unit is not None and sp.start <= skipped_unit < sp.stop and state.my_fault is not None:
        from runtime.modules import SkipFrom

        i = skipped_unit - sp.start
        mod.units[i] = SkipFrom(mod.units[i], state.step_box, state.my_fault.step)
    return mod


def parallelize(state: RankState, built: StageSet, s: int, mod: Any, examples: Any, holders: dict[int, int]) -> Any:
    """Megatron's selective recompute (the attention cores, found on the units' ``examples``),
    tensor parallelism, recompute, autocast (and the split-backward view guard), then FSDP2
    outermost (ZeRO 2/3), so that PipelineStage sees the FSDP module.  Tied weights stay whole
    (averaged by the flat all-reduce): those whose copies sit on several pipeline ranks, and
    those two stages of this rank hold (a tied embedding and head under a V schedule: two FSDP2
    groups sharding one parameter gave the head a third of its gradient wrong, measured by the
    runtime matrix, ``tests/runtime/test_matrix.py``)."""
    from planner.schedules import SPLIT_BACKWARD
    from runtime.mesh import apply_mesh, stage_shardings

    job, sp = state.job, state.plan.stages[s]
    return apply_mesh(
        mod,
        state.spec,
        state.mesh,
        checkpointed_layers=sp.checkpointed_layers,
        selective_inputs=[examples[u][0] for u in range(sp.start, sp.stop)] if state.plan.selective_recompute else None,
        shardings=stage_shardings(job.coords.shardings, sp.start, sp.stop),
        wrap=lambda inner: wrap_stage(inner, job.opts, job.device, state.plan.schedule in SPLIT_BACKWARD),
        keep_whole=[p for _, p in built.tied] + [p for p in mod.parameters() if holders.get(id(p), 1) > 1],
        sharded_logits=sp.stop == len(job.split),
    )


def wrap_stage(mod: Any, opts: Any, device: Any, split_backward: bool) -> Any:
    """Autocast for a 16-bit run; the view guard of the split-backward schedules."""
    from runtime.modules import Autocast, NoViewOutputs

    if opts.mixed:
        mod = Autocast(mod, device.type, opts.torch_dtype)
    if split_backward:
        mod = NoViewOutputs(mod)
    return mod


def wrap_data_parallel(state: RankState, built: StageSet, mod: Any, holders: dict[int, int]) -> Any:
    """Wrap the stage in torch DDP over the data axis, leaving out the expert-parallel weights
    and those two stages of this rank hold (recorded in ``built``)."""
    from runtime._ddp import wrap_ddp

    ignore = []
    for p in {id(p): p for p in mod.parameters()}.values():
        why = "expert-parallel (reduced over its own groups)" if built.axes.owns(p) else (
            "held by two stages of one rank (flat all-reduce)" if holders.get(id(p), 1) > 1 else "")  # fmt: skip
        if why:
            ignore.append(p)
            built.left_to_us.setdefault(why, set()).add(id(p))
    mine_ddp = [p for p in mod.parameters() if p.requires_grad and all(p is not q for q in ignore)]
    if mine_ddp:  # DDP refuses a module with nothing to reduce (a Tanh alone)
        mod, clock = wrap_ddp(mod, state.dp_group, bucket_mb=built.bucket_mb, ignore=ignore, labels=built.layer_of)
        built.clocks.append(clock)
        built.by_ddp.update(id(p) for p in mine_ddp)
    return mod


def pipeline_stage(state: RankState, built: StageSet, s: int, mod: Any, examples: Any) -> Any:
    """Torch's ``PipelineStage`` of ``mod``, its actions timed into ``built.timings[s]`` (and
    stopped by ``--inject-fault R:S:raise|exit|hang``)."""
    from torch.distributed.pipelining import PipelineStage

    job, sp, fault = state.job, state.plan.stages[s], state.my_fault
    stage = PipelineStage(
        mod,
        s,
        len(state.plan.stages),
        job.device,
        input_args=examples[sp.start][0],
        output_args=examples[sp.stop - 1][1],
        group=state.pp_group,
    )
    stops = fault if fault is not None and fault.mode in ("raise", "exit", "hang") else None
    time_stage(stage, built.timings[s], state.step_box, job.device, stops, job.status, state.streams)
    return stage
