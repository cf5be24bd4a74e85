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

Its parts: :mod:`runtime.stage_weights` the weights the stages share and the data-parallel
path (:func:`tied_parameters`, :func:`data_reduction`, :func:`layer_owners`),
:mod:`runtime.stage_axes` the steps per axis above (1, 3, 4 and 5); every name is still
importable from here.
"""

from __future__ import annotations

from runtime.fault_injection import layer_to_skip
from runtime.rank_state import Job, RankState, StageSet
from runtime.stage_axes import parallelize as parallelize
from runtime.stage_axes import pipeline_stage as pipeline_stage
from runtime.stage_axes import stage_module as stage_module
from runtime.stage_axes import wrap_data_parallel as wrap_data_parallel
from runtime.stage_axes import wrap_stage as wrap_stage
from runtime.stage_weights import data_reduction as data_reduction
from runtime.stage_weights import layer_owners
from runtime.stage_weights import tied_parameters as tied_parameters


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
    holders = layer_owners(state, built)
    for s in job.my_stages:
        mod = stage_module(state, s, skipped_unit)
        built.modules.append(mod)
        axes.apply(mod)
        mod = parallelize(state, built, s, mod, examples, holders)
        if reduction.path == "ddp":
            mod = wrap_data_parallel(state, built, mod, holders)
        built.stages.append(pipeline_stage(state, built, s, mod, examples))
    return built
