"""From the worker's flags to this rank's :class:`runtime.rank_state.Job`, before any rank joins
the process group: the checked training options (:func:`train_options`), the backend and
device (:func:`pick_device`), and the plan, model and split (:func:`build_job`: read the plan,
build the model from the entry point, split it with the profiler's splitter, check the plan
against it and refuse an axis the runtime cannot execute)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from planner.errors import InputError
from runtime.fault_injection import Fault
from runtime.faults import RankStatus, write_status
from runtime.rank_state import Coords, Job, Progress


def train_options(args: argparse.Namespace, plan: Any, optimizer: str) -> Any:
    """The :class:`runtime.training.TrainOptions` of the flags, checked (``--dtype`` defaults
    to the plan's)."""
    from runtime.training import RUN_DTYPES, TrainOptions

    if args.lr <= 0:
        raise InputError(f"--lr {args.lr}: give a positive learning rate")
    if args.warmup_steps < 0:
        raise InputError(f"--warmup-steps {args.warmup_steps}: give 0 or more")
    if not 0 <= args.min_lr <= args.lr:
        raise InputError(f"--min-lr {args.min_lr}: give a value between 0 and --lr {args.lr}")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        raise InputError(f"--clip-grad-norm {args.clip_grad_norm}: give a positive norm")
    return TrainOptions(
        optimizer=optimizer,
        lr=args.lr,
        steps=args.steps,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        min_lr=args.min_lr,
        clip_grad_norm=args.clip_grad_norm,
        dtype=RUN_DTYPES[args.dtype] if args.dtype else plan.training.run_dtype,
        fused_optimizer=plan.training.fused_optimizer,
    )


def pick_device(args: argparse.Namespace, local_rank: int) -> tuple[str, Any]:
    """The backend and this rank's device: nccl on a CUDA device of its own, else gloo on CPU."""
    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    use_cuda = args.backend != "gloo" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    backend = args.backend if args.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise InputError(
            f"--backend nccl needs one CUDA device per rank ({local_world} on this host, "
            f"{torch.cuda.device_count()} visible): use --backend gloo"
        )
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend, device


def build_job(args: argparse.Namespace, rank: int, status: RankStatus, progress: Progress) -> Job:
    """Read the plan, build and split the model and check the plan against it: this rank's
    :class:`Job`, ready to join the process group."""
    import torch

    from planner.schedules import rank_stages
    from planner.schema import Plan, load_document
    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.axes import local_examples, refuse_new_axes
    from runtime.mesh import MeshSpec, split_sharding
    from runtime.plan_check import check_optimizer_supported, check_plan_matches
    from runtime.report import current_rss_bytes

    rss_before_model = current_rss_bytes()  # the interpreter and torch: the report's memory note subtracts it
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    plan: Plan = load_document("plan", args.plan)
    optimizer = args.optimizer or plan.training.optimizer
    check_optimizer_supported(optimizer)
    opts = train_options(args, plan, optimizer)
    fault = Fault.parse(args.inject_fault) if args.inject_fault else None

    k_deg, v = plan.pipeline_degree, plan.virtual_stages
    # the mesh ("pp", "dp_replicate", "dp_shard", "tp"), pipeline axis outermost:
    # rank = (k * D + d) * T + t
    spec = MeshSpec.of(plan)
    pp_rank, replica, tp_rank = spec.coords(rank) if rank < spec.world_size else (rank, 0, 0)
    my_stages = rank_stages(plan.placement, k_deg, v)[pp_rank % k_deg]  # loop: s % K == rank; V: r and 2K-1-r
    status.stages = my_stages

    backend, device = pick_device(args, local_rank)
    status.phase = "building the model"
    write_status(args.run_dir, status)
    torch.manual_seed(args.seed)
    entry = load_entrypoint(args.model)
    entry.model.to(device)  # before the split: every unit shares the model's tensors on the device
    # under context parallelism the units are split on this rank's tokens (runtime/axes.py)
    split = split_model(
        entry.model,
        tuple(t.to(device) for t in local_examples(entry.example_inputs, plan, replica)),
        split_points=plan.split_points or None,
        keywords=entry.keywords,
    )
    check_plan_matches(
        plan,
        layer_names=split.names,
        param_bytes=split.param_bytes(),
        sha256=split.sha256(),
        world_size=world,
        optimizer=optimizer,
        dtype=opts.dtype,
    )
    # refuse an axis the runtime cannot execute (naming the layer) before joining the group
    shardings = split_sharding(split, spec)
    refuse_new_axes(split, plan)
    return Job(
        args, plan, entry, split, Coords(rank, world, pp_rank, replica, tp_rank, spec, shardings),
        my_stages, device, backend, opts, fault, status, progress, rss_before_model=rss_before_model,
    )  # fmt: skip
