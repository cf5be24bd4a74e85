"""This rank's pipeline stages, each built by the same steps in a fixed order.

:func:`join_mesh` builds the plan's DeviceMesh and this rank's groups; :func:`build_stages`
finds the tied weights whose copies sit on several pipeline ranks (one group each), the
context- and expert-parallel axes (``runtime/axes.py``) and the data-parallel path, then makes
each of the rank's stages, torchtitan's way, one step per axis:

1. :func:`stage_module`: the splitter's units of the stage (the plan's layers), with the
   dropout streams (and ``--inject-fault R:S:skip-layer``'s skipped layer);
2. ``axes.apply``: context and expert parallelism;
3. :func:`parallelize`: tensor (and sequence) parallelism, recompute, autocast, then FSDP2
   outermost (ZeRO 2/3): :func:`runtime.mesh.apply_mesh` applies them in this order;
4. :func:`wrap_data_parallel`: torch DDP, where :func:`runtime.mesh.gradient_reduction` allows it;
5. :func:`pipeline_stage`: torch's ``PipelineStage``, its actions timed (:mod:`runtime.stage_timing`).
"""

from __future__ import annotations

import argparse
from typing import Any

from planner.errors import InputError
from runtime.fault_injection import layer_to_skip
from runtime.rank_state import Job, RankState, StageSet
from runtime.stage_timing import time_stage


def join_mesh(job: Job) -> RankState:
    """The DeviceMesh ``("pp", "dp_replicate", "dp_shard", "tp")`` and this rank's groups."""
    from profiler.split import RngStreams
    from runtime.mesh import build_mesh, data_mesh

    spec, fault = job.coords.spec, job.fault
    mesh = build_mesh(spec, device_type=job.device.type)
    return RankState(
        job=job,
        mesh=mesh,
        pp_group=mesh["pp"].get_group(),
        dp_group=data_mesh(mesh, spec).get_group() if spec.data_parallel_degree > 1 else None,
        step_box=[0],
        streams=RngStreams(seed=job.args.seed, replica=job.coords.replica),
        my_fault=fault if fault is not None and fault.rank == job.coords.rank else None,
    )


def build_stages(state: RankState) -> StageSet:
    """This rank's stages (see the module's docstring for the order of the steps)."""
    from runtime.axes import local_examples, new_axes
    from runtime.modules import stage_examples

    job, plan = state.job, state.plan
    tied, not_mine_in_norm = tied_parameters(state)
    # stages are built from real example activations at the micro-batch size (their dtypes,
    # integer ranges and requires_grad flags are the training run's, autocast included)
    examples = stage_examples(
        job.split, local_examples(job.entry.example_inputs, plan, job.coords.replica), plan.microbatch_size,
        job.device, dtype=job.opts.dtype,
    )  # fmt: skip
    skipped_unit = layer_to_skip(plan, job.my_stages, examples, state.my_fault) if state.my_fault is not None else None
    # context and expert parallelism (runtime/axes.py): built on every rank (their meshes are collectives)
    axes = new_axes(plan, replica=job.coords.replica, example_inputs=job.entry.example_inputs,
                    device_type=job.device.type, step_box=state.step_box, fault=state.my_fault)  # fmt: skip
    reduction, bucket_mb = data_reduction(job.args, state.spec)
    built = StageSet(
        axes=axes, modules=[], stages=[], timings={s: {"forward": [], "backward": [], "events": []} for s in job.my_stages},
        tied=tied, not_mine_in_norm=not_mine_in_norm, reduction=reduction, bucket_mb=bucket_mb,
    )  # fmt: skip
    holders = _layer_owners(state, built)
    for s in job.my_stages:
        mod = stage_module(state, s, skipped_unit)
        built.modules.append(mod)
        axes.apply(mod)
        mod = parallelize(state, built, s, mod, examples, holders)
        if reduction.path == "ddp":
            mod = wrap_data_parallel(state, built, mod, holders)
        built.stages.append(pipeline_stage(state, built, s, mod, examples))
    return built


def tied_parameters(state: RankState) -> tuple[list[tuple[Any, Any]], set[int]]:
    """Tied parameters whose copies land on different pipeline ranks: one group per replica
    (and tensor-parallel rank), and this rank's copy in it.  The lowest pipeline rank holding a
    copy counts it in the gradient norm: the ids of the others' are the second value."""
    import torch.distributed as dist

    from planner.schedules import stage_ranks

    plan, split, spec, c = state.plan, state.job.split, state.spec, state.job.coords
    rank_of_stage = stage_ranks(plan.placement, plan.pipeline_degree, plan.virtual_stages)
    stage_of_unit = {u: st.index for st in plan.stages for u in range(st.start, st.stop)}
    tied: list[tuple[Any, Any]] = []
    not_mine_in_norm: set[int] = set()
    for group in split.shared_parameters():
        ranks_k = sorted({rank_of_stage[stage_of_unit[u]] for u, _ in group})
        if len(ranks_k) < 2:
            continue  # all copies on one rank: one tensor, gradients already summed
        for d, t in [(d, t) for d in range(spec.data_parallel_degree) for t in range(spec.tensor_parallel_degree)]:
            pg = dist.new_group([spec.rank_of(kk, d, t) for kk in ranks_k])  # every rank creates every group
            if d == c.replica and t == c.tp_rank and c.pp_rank in ranks_k:
                u, name = next(
                    (u, n) for u, n in group if rank_of_stage[stage_of_unit[u]] == c.pp_rank
                )
                param = split.units[u].get_parameter(name)
                tied.append((pg, param))
                if c.pp_rank != ranks_k[0]:
                    not_mine_in_norm.add(id(param))
    return tied, not_mine_in_norm


def data_reduction(args: argparse.Namespace, spec: Any) -> tuple[Any, float]:
    """The data-parallel gradients' path and DDP's bucket size (MiB): torch DDP (bucketed,
    during each stage's last backward) where :func:`runtime.mesh.gradient_reduction` allows it,
    else the flat all-reduce after the schedule."""
    from runtime.mesh import DEFAULT_BUCKET_MB, GradientReduction, gradient_reduction

    reduction = gradient_reduction(spec)
    if args.dp_reduction == "flat" and reduction.path == "ddp":
        reduction = GradientReduction("all-reduce", "asked for with --dp-reduction flat")
    bucket_mb = args.dp_bucket_mb if args.dp_bucket_mb is not None else DEFAULT_BUCKET_MB
    if bucket_mb <= 0:
        raise InputError(f"--dp-bucket-mb {bucket_mb:g}: give a bucket size above 0 MiB (DDP's default is 25)")
    return reduction, bucket_mb


def _layer_owners(state: RankState, built: StageSet) -> dict[int, int]:
    """Fill ``built.layer_of`` (a weight by the first layer holding it); return how many of this
    rank's stages hold each weight (two: a tied embedding and head under a V schedule; two DDP
    reducers would each average it, the flat all-reduce does it once)."""
    plan, split = state.plan, state.job.split
    for s in state.job.my_stages:
        for u in range(plan.stages[s].start, plan.stages[s].stop):
            for p in split.units[u].parameters():
                built.layer_of.setdefault(id(p), split.names[u])
    holders: dict[int, int] = {}
    for s in state.job.my_stages:
        for i in {id(p) for u in range(plan.stages[s].start, plan.stages[s].stop) for p in split.units[u].parameters()}:
            holders[i] = holders.get(i, 0) + 1
    return holders


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
