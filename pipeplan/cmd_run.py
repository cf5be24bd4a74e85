"""``pipeplan run``: execute a plan with torch.distributed.pipelining and measure it."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from runtime.worker import add_worker_args

    p = sub.add_parser(
        "run",
        help="run a plan on torch.distributed.pipelining and compare with the prediction",
        description="Launch the processes a plan needs (torchrun-compatible), train --steps steps on "
        "the data FUNC returns as its 4th element (data_fn(step, batch_size), an iterable of global batches "
        "such as a DataLoader, or runtime.data.Loader; else synthetic data shaped like the example inputs), "
        "with targets for a loss_fn(output, target), in fp32 or under bf16/fp16 autocast, print measured "
        "against predicted step and stage times, and with --check prove the pipelined run matches the "
        "unsplit model.",
    )
    p.add_argument("--plan", required=True, help="plan JSON file, or an http(s):// URL of the planning service")
    add_worker_args(p, for_launcher=True)
    g = p.add_argument_group("launch (torchrun rendezvous; default: every rank on this host)")
    g.add_argument("--nnodes", type=int, default=1, help="hosts taking part (run the same command on each)")
    g.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    g.add_argument("--master-addr", help="address of the host with node rank 0")
    g.add_argument("--master-port", type=int, help="port on the master host (default 29500)")
    g.add_argument("--nproc-per-node", type=int, help="ranks on this host (default: world size / nnodes)")
    g.add_argument("--threads", type=int, help="intra-op threads per rank (default: $OMP_NUM_THREADS or 1)")
    g.add_argument(
        "--verbose", action="store_true", help="keep torchrun's and the schedules' logs, print rank tracebacks"
    )
    p.set_defaults(func=run)


def _load_plan(value: str) -> Any:
    from planner.schema import load_document

    if value.startswith(("http://", "https://")):
        from api.client import fetch_plan

        return fetch_plan(value, token=os.environ.get("PIPEPLAN_API_TOKEN"))
    return load_document("plan", value)


def _model_spec(spec: str) -> str:
    """Make a ``file.py:FUNC`` path absolute so every rank finds it."""
    target, sep, func = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target) and os.path.exists(target):
        return f"{os.path.abspath(target)}:{func}"
    return spec


def run(args: argparse.Namespace) -> int:
    from planner.errors import InputError
    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.axes import local_examples, refuse_new_axes
    from runtime.launch import Rendezvous, launch
    from runtime.mesh import MeshSpec, split_sharding
    from runtime.plan_check import check_optimizer_supported, check_plan_matches
    from runtime.worker import train_options

    if args.steps < 1:
        raise InputError(f"--steps {args.steps}: give at least 1")
    if args.timeout <= 0:
        raise InputError(f"--timeout {args.timeout}: give a positive number of seconds")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise InputError(f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: need 0 <= node rank < nnodes")
    plan = _load_plan(args.plan)
    optimizer = args.optimizer or plan.training.optimizer
    check_optimizer_supported(optimizer)
    opts = train_options(args, plan, optimizer)
    world = plan.world_size
    nproc = args.nproc_per_node or world // args.nnodes
    if nproc * args.nnodes != world:
        raise InputError(
            f"the plan needs {world} processes (K={plan.pipeline_degree} x D={plan.data_parallel_degree} x "
            f"T={plan.tensor_parallel_degree}"
            + (f" x C={plan.context_parallel_degree}" if plan.context_parallel_degree > 1 else "")
            + ") "
            f"but {args.nnodes} host(s) x {nproc} per host = {nproc * args.nnodes}: choose --nnodes and "
            f"--nproc-per-node whose product is {world}"
        )
    t_deg = plan.tensor_parallel_degree
    if args.nnodes > 1 and t_deg > 1 and nproc % t_deg:
        print(
            f"note: {nproc} ranks per host is not a multiple of T={t_deg}: tensor-parallel groups span hosts "
            f"(rank = (k * D + d) * T + t); give --nproc-per-node a multiple of {t_deg} to keep them inside one",
            file=sys.stderr,
        )
    model = _model_spec(args.model)
    # refuse a plan that does not fit the model before starting any process
    entry = load_entrypoint(model)
    split = split_model(
        entry.model, entry.example_inputs, split_points=plan.split_points or None, keywords=entry.keywords
    )
    check_plan_matches(
        plan,
        layer_names=split.names,
        param_bytes=split.param_bytes(),
        sha256=split.sha256(),
        world_size=nproc * args.nnodes,
        optimizer=optimizer,
        dtype=opts.dtype,
    )
    # refuse an axis the runtime cannot execute (e.g. tensor parallelism on a layer without a
    # sharding rule), naming the layer, on this process's own split
    split_sharding(split, MeshSpec.of(plan))
    refuse_new_axes(split, plan)  # context and expert parallelism (runtime/axes.py)
    local_examples(entry.example_inputs, plan, 0)  # C > 1: refuses a sequence 2C does not divide
    _check_data(entry, plan, args.steps)
    sha256 = split.sha256()
    del entry, split
    stage_of = _stage_of(plan)
    with tempfile.TemporaryDirectory(prefix="pipeplan-run-") as run_dir:
        plan_path = os.path.join(run_dir, "plan.json")
        with open(plan_path, "w", encoding="utf-8") as f:
            f.write(plan.model_dump_json())
        worker_args = [
            "--plan", plan_path,
            "--model", model,
            "--steps", str(args.steps),
            "--optimizer", optimizer,
            "--lr", repr(args.lr),
            "--lr-schedule", args.lr_schedule,
            "--warmup-steps", str(args.warmup_steps),
            "--min-lr", repr(args.min_lr),
            "--dtype", opts.dtype,
            "--seed", str(args.seed),
            "--timeout", repr(args.timeout),
            "--backend", args.backend,
        ]  # fmt: skip
        if args.tolerance is not None:
            worker_args += ["--tolerance", repr(args.tolerance)]
        if args.clip_grad_norm is not None:
            worker_args += ["--clip-grad-norm", repr(args.clip_grad_norm)]
        if args.log_file:
            worker_args += ["--log-file", os.path.abspath(args.log_file)]
        if args.check:
            worker_args.append("--check")
        if args.report:
            worker_args += ["--report", os.path.abspath(args.report)]
        if args.inject_fault:
            worker_args += ["--inject-fault", args.inject_fault]
        if args.dp_bucket_mb is not None:
            worker_args += ["--dp-bucket-mb", repr(args.dp_bucket_mb)]
        if args.dp_reduction != "auto":
            worker_args += ["--dp-reduction", args.dp_reduction]
        worker_args += _checkpoint_args(args, model=model, sha256=sha256, optimizer=optimizer)
        launch(
            worker_args,
            world_size=world,
            run_dir=run_dir,
            timeout_s=args.timeout,
            nproc_per_node=nproc,
            rendezvous=Rendezvous(
                nnodes=args.nnodes,
                node_rank=args.node_rank,
                master_addr=args.master_addr,
                master_port=args.master_port,
            ),
            threads=args.threads,
            stage_of=stage_of,
            verbose=args.verbose,
        )
    return 0


def _checkpoint_args(args: argparse.Namespace, *, model: str, sha256: str, optimizer: str) -> list[str]:
    """``--checkpoint DIR [--every N]`` and ``--resume DIR`` for the worker, checked here first: a
    checkpoint of another model (or optimizer) is refused before any rank starts."""
    from planner.errors import InputError
    from runtime.checkpoint import check_compatible, read_info

    out: list[str] = []
    if getattr(args, "resume", None):
        info = read_info(args.resume)
        check_compatible(info, model=model, sha256=sha256, optimizer=optimizer)
        if info.step >= args.steps:
            raise InputError(f"--resume {args.resume}: its checkpoint is at step {info.step}; give --steps above it")
        out += ["--resume", os.path.abspath(args.resume)]
    if getattr(args, "checkpoint", None):
        every = getattr(args, "every", 0) or 0
        if every < 0:
            raise InputError(f"--every {every}: give 0 (save at the end) or a positive number of steps")
        out += ["--checkpoint", os.path.abspath(args.checkpoint), "--every", str(every)]
    return out


def _stage_of(plan: Any) -> dict[int, str]:
    """What each rank runs, for the launcher's messages: its stages, replica and tensor-parallel
    rank (the mesh's layout, pipeline axis outermost: rank = (k * D + d) * T + t)."""
    from planner.schedules import rank_stages
    from runtime.mesh import MeshSpec

    spec = MeshSpec.of(plan)
    per_rank = rank_stages(plan.placement, plan.pipeline_degree, plan.virtual_stages)
    out = {}
    c_deg = plan.context_parallel_degree  # folded into the mesh's data axis: d * C + c
    for r in range(spec.world_size):
        k, d, t = spec.coords(r)
        out[r] = (
            f"stage{'s' if len(per_rank[k]) > 1 else ''} "
            + ",".join(map(str, per_rank[k]))
            + (f", replica {d // c_deg}" if plan.data_parallel_degree > 1 else "")
            + (f", cp rank {d % c_deg}" if c_deg > 1 else "")
            + (f", tp rank {t}" if plan.tensor_parallel_degree > 1 else "")
        )
    return out


def _check_data(entry: Any, plan: Any, steps: int) -> None:
    """Read the first batch of every replica's data here, so that data that does not fit the
    model or the plan (wrong shapes, no targets for a loss that takes them, fewer batches than
    --steps) is refused before any rank starts.  This process's own copy of the data is read:
    the ranks call FUNC again."""
    from runtime.data import DataSource

    source = DataSource.of(entry, global_batch_size=plan.global_batch_size, steps=steps)
    if source.kind == "synthetic":
        return
    d = plan.data_parallel_degree
    for replica in range(d if source.kind == "per-replica" else 1):
        source.open(replica, d if source.kind == "per-replica" else 1).next(0)
