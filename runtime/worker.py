"""One rank of a pipelined training job: the torchrun entry module.

``pipeplan run`` launches it for you; it also runs directly under torchrun::

    torchrun --nproc-per-node 2 -m runtime.worker --plan plan.json --model examples.gpt:tiny

Each rank rebuilds the model from the entry point, splits it with the profiler's splitter
(the same code that produced the profile, so layer ``i`` of the plan is unit ``i``), checks
the plan against it, builds its ``PipelineStage`` (s) and the schedule the plan names from
``torch.distributed.pipelining``, and trains ``--steps`` steps on the entry point's data
function when FUNC returns one (every rank computes the same global batch of a step and
keeps its replica's shard; the ranks check that they agree), else on synthetic batches.  With
``D > 1`` the ranks form a ``DeviceMesh`` of shape ``(D, K)`` (rank = d * K + k); gradients
are averaged over the data axis, and tied parameters whose copies sit on different pipeline
ranks have their gradients summed between those ranks.  Rank 0 gathers the measurements,
prints the report, writes it with ``--report``, and with ``--check`` trains the unsplit model
in its own process on the same data and compares.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import InputError, PipeplanError
from runtime.faults import CheckFailedError, RankStatus, error_summary, write_status

#: exit code of a rank whose --check failed (other failures exit 1)
EXIT_CHECK_FAILED = 3
#: exit code of a rank whose watchdog saw it make no progress
EXIT_HUNG = 124

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_TOLERANCE = 1e-5


def add_worker_args(p: argparse.ArgumentParser, *, for_launcher: bool = False) -> None:
    """Flags shared by ``pipeplan run`` and ``python -m runtime.worker``."""
    if not for_launcher:
        p.add_argument("--plan", required=True, help="plan JSON file")
    p.add_argument(
        "--model",
        required=True,
        help="MODULE:FUNC or path/to/file.py:FUNC (the profiled model); FUNC returns (model, example_inputs"
        "[, loss_fn[, data_fn]]), data_fn(step, batch_size) -> that step's global batch of model inputs",
    )
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument(
        "--optimizer",
        default=None,
        help="sgd, sgd-momentum, adam, adamw; must match the plan's training optimizer (default: the plan's)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model set-up and of the synthetic data (a data function from FUNC ignores it; default 0)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"collective timeout in seconds: a rank that waits longer for another fails the job (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="default: nccl on CUDA, else gloo")
    p.add_argument("--check", action="store_true", help="compare losses and final parameters with the unsplit model")
    p.add_argument(
        "--tolerance", type=float, default=DEFAULT_TOLERANCE, help=f"--check relative tolerance (default {DEFAULT_TOLERANCE:g})"
    )
    p.add_argument("--report", metavar="FILE", help="write the measured-vs-predicted report JSON here")
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    # RANK:STEP:MODE (raise|exit|hang): make one rank fail mid-step, for fault tests
    p.add_argument("--inject-fault", help=argparse.SUPPRESS)


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    mode: str  # raise | exit | hang

    @staticmethod
    def parse(text: str) -> Fault:
        try:
            rank, step, mode = text.split(":")
            fault = Fault(int(rank), int(step), mode)
        except ValueError:
            raise InputError(f"--inject-fault {text!r}: write RANK:STEP:MODE, e.g. 1:1:raise") from None
        if fault.mode not in ("raise", "exit", "hang"):
            raise InputError(f"--inject-fault mode {fault.mode!r}: choose raise, exit or hang")
        return fault


@dataclass
class Progress:
    """Last sign of life of the main thread, for the watchdog."""

    beat: float = field(default_factory=time.monotonic)
    done: bool = False
    #: False until the first step: start-up (imports, model building, rendezvous) gets longer
    training: bool = False


def _watchdog(progress: Progress, status: RankStatus, run_dir: str | None, timeout_s: float) -> None:
    """End this process if the main thread makes no progress (a hang no peer would see).

    The limit is 2 x the collective timeout during training (peers normally notice first)
    and max(4 x timeout, 300 s) during start-up (imports and model building can be slow).
    """
    while not progress.done:
        limit_s = 2 * timeout_s if progress.training else max(4 * timeout_s, 300.0)
        time.sleep(min(1.0, limit_s / 4))
        idle = time.monotonic() - progress.beat
        if idle > limit_s and not progress.done:
            status.state = "hung"
            status.error = f"no progress for {idle:.0f} s (watchdog limit {limit_s:g} s, see --timeout)"
            write_status(run_dir, status)
            print(f"[rank{status.rank}] error: {status.error} during {status.where()}", file=sys.stderr, flush=True)
            os._exit(EXIT_HUNG)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.worker", description=__doc__.split("\n\n")[0])
    add_worker_args(parser)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    status = RankStatus(rank=rank, pid=os.getpid(), host=socket.gethostname())
    run_dir = args.run_dir
    write_status(run_dir, status)
    progress = Progress()
    threading.Thread(
        target=_watchdog, args=(progress, status, run_dir, args.timeout), daemon=True, name="pipeplan-watchdog"
    ).start()
    try:
        code = _run(args, rank, status, progress)
    except BaseException as err:  # every failure is reported, then the rank exits
        progress.done = True
        status.state = "failed"
        info = error_summary(err)
        status.error_type, status.error, status.communication = info["error_type"], info["error"], info["communication"]
        status.traceback = traceback.format_exc()
        write_status(run_dir, status)
        if isinstance(err, CheckFailedError):
            if not run_dir:  # under pipeplan run the launcher prints it, once
                print(f"error: {err}", file=sys.stderr, flush=True)
            return EXIT_CHECK_FAILED
        if isinstance(err, PipeplanError):
            print(f"[rank{rank}] error: {err}", file=sys.stderr, flush=True)
        else:
            print(
                f"[rank{rank}] error: {status.error_type}: {status.error} (during {status.where()})",
                file=sys.stderr,
                flush=True,
            )
            if os.environ.get("PIPEPLAN_VERBOSE"):
                print(status.traceback, file=sys.stderr, flush=True)
        return 1
    progress.done = True
    status.state = "done"
    write_status(run_dir, status)
    return code


def _run(args: argparse.Namespace, rank: int, status: RankStatus, progress: Progress) -> int:
    import torch
    import torch.distributed as dist

    from planner.schema import Plan, load_document
    from profiler.loading import load_entrypoint
    from profiler.split import split_model
    from runtime.plan_check import check_optimizer_supported, check_plan_matches

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    plan: Plan = load_document("plan", args.plan)
    optimizer = args.optimizer or plan.training.optimizer
    check_optimizer_supported(optimizer)
    fault = Fault.parse(args.inject_fault) if args.inject_fault else None

    k_deg, v = plan.pipeline_degree, plan.virtual_stages
    num_stages = k_deg * v
    pp_rank, replica = rank % k_deg, rank // k_deg
    my_stages = [s for s in range(num_stages) if s % k_deg == pp_rank]
    status.stages = my_stages

    # ---- devices
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

    status.phase = "building the model"
    write_status(args.run_dir, status)
    torch.manual_seed(args.seed)
    entry = load_entrypoint(args.model)
    entry.model.to(device)  # before the split: every unit shares the model's tensors on the device
    split = split_model(
        entry.model,
        tuple(t.to(device) for t in entry.example_inputs),
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
    )
    status.phase = "joining the process group"
    write_status(args.run_dir, status)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    try:
        return _train(args, plan, entry, split, rank, world, pp_rank, replica, my_stages, device, backend, optimizer, fault, status, progress)
    finally:
        progress.done = True
        dist.destroy_process_group()


def _train(
    args: argparse.Namespace,
    plan: Any,
    entry: Any,
    split: Any,
    rank: int,
    world: int,
    pp_rank: int,
    replica: int,
    my_stages: list[int],
    device: Any,
    backend: str,
    optimizer_name: str,
    fault: Fault | None,
    status: RankStatus,
    progress: Progress,
) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from profiler.split import RngStreams
    from runtime.modules import Recompute, stage_examples
    from runtime.training import (
        batch_fingerprint,
        global_batch,
        make_optimizer,
        replica_shard,
        unique_parameters,
    )

    if not os.environ.get("PIPEPLAN_VERBOSE"):
        # the interleaved schedule logs its whole action table when a rank fails; the status
        # file and the launcher's diagnosis say what matters (PIPEPLAN_VERBOSE=1 keeps it)
        for name in ("torch.distributed.pipelining", "torch.distributed.pipelining.schedules"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    k_deg, d_deg = plan.pipeline_degree, plan.data_parallel_degree
    num_stages = len(plan.stages)
    m = plan.num_microbatches
    pp_group = None
    dp_group = None
    if d_deg > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (d_deg, k_deg), mesh_dim_names=("dp", "pp"))
        pp_group = mesh.get_group("pp")
        dp_group = mesh.get_group("dp")

    # ---- tied parameters whose copies land on different pipeline ranks: one group per replica
    stage_of_unit = {u: st.index for st in plan.stages for u in range(st.start, st.stop)}
    tied: list[tuple[Any, torch.nn.Parameter]] = []
    for group in split.shared_parameters():
        ranks_k = sorted({stage_of_unit[u] % k_deg for u, _ in group})
        if len(ranks_k) < 2:
            continue  # all copies on one rank: one tensor, gradients already summed
        for d in range(d_deg):
            pg = dist.new_group([d * k_deg + kk for kk in ranks_k])
            if d == replica and pp_rank in ranks_k:
                u, name = next((u, n) for u, n in group if stage_of_unit[u] % k_deg == pp_rank)
                tied.append((pg, split.units[u].get_parameter(name)))

    # ---- stages, built from real example activations at the micro-batch size (their dtypes,
    # integer ranges and requires_grad flags are the training run's)
    timings: dict[int, dict[str, list[list[Any]]]] = {s: {"forward": [], "backward": [], "events": []} for s in my_stages}
    step_box = [0]
    streams = RngStreams(seed=args.seed, replica=replica)
    stages: list[Any] = []
    modules = []
    examples = stage_examples(split, entry.example_inputs, plan.microbatch_size, device)
    for s in my_stages:
        sp = plan.stages[s]
        mod: Any = split.stage_module(sp.start, sp.stop, pipeline=True)
        mod.rng = streams
        modules.append(mod)
        if sp.recompute:
            mod = Recompute(mod)
        stage = PipelineStage(
            mod,
            s,
            num_stages,
            device,
            input_args=examples[sp.start][0],
            output_args=examples[sp.stop - 1][1],
            group=pp_group,
        )
        _time_stage(stage, timings[s], step_box, device, fault if fault and fault.rank == rank else None, status, streams)
        stages.append(stage)
    del examples

    last_record = timings.get(num_stages - 1)

    def loss_fn(output: Any, target: Any) -> Any:
        t0 = time.perf_counter()
        value = entry.loss(split.rebuild_output(output if isinstance(output, tuple) else (output,)))
        if last_record is not None:  # the profile counts the loss in the last layer's forward: so do we
            _sync(device)
            _fold_loss(last_record, step_box[0], t0, time.perf_counter())
        return value

    # scale_grads=False: the schedules divide each stage's gradients by M, which would divide
    # a weight shared by two stages of this rank twice; we divide every parameter once below
    if plan.schedule == "gpipe":
        schedule: Any = ScheduleGPipe(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    elif plan.schedule == "1f1b":
        schedule = Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
    params = unique_parameters(modules)
    opt = make_optimizer(optimizer_name, params, lr=args.lr)
    has_first = 0 in my_stages
    has_last = (num_stages - 1) in my_stages
    b = plan.microbatch_size
    target = torch.zeros(m * b, device=device)

    step_ms: list[float] = []
    phases: list[list[float]] = []
    local_losses: list[float | None] = []
    status.state = "running"
    for step in range(args.steps):
        status.step = step
        status.phase = "training"
        write_status(args.run_dir, status)
        progress.beat = time.monotonic()
        progress.training = True
        step_box[0] = step
        streams.step = step
        batch = global_batch(
            entry.example_inputs,
            plan.global_batch_size,
            seed=args.seed,
            step=step,
            data_fn=entry.data_fn,
            spec=args.model,
            keywords=entry.keywords,
        )
        if entry.data_fn is not None:
            _check_same_batch(batch_fingerprint(batch), step, rank, world, device)
        shard = [t.to(device) for t in replica_shard(batch, replica, d_deg)]
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        losses: list[Any] = []
        if has_first:
            schedule.step(*shard, target=target, losses=losses)
        else:
            schedule.step(target=target, losses=losses)
        _sync(device)
        t_schedule = time.perf_counter()
        for p in params:
            if p.grad is not None:
                p.grad.div_(m)  # mean over micro-batches, once per tensor
        if dp_group is not None:
            _allreduce_mean([p.grad for p in params if p.grad is not None], dp_group, d_deg)
        _sync(device)
        t_allreduce = time.perf_counter()
        for pg, p in tied:
            if p.grad is None:  # every holder must join the all-reduce
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=pg)
        _sync(device)
        t_tied = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        t_end = time.perf_counter()
        step_ms.append((t_end - t0) * 1e3)
        # where the step went, for calibration (runtime/report.py): start on the host's clock,
        # then schedule, data-parallel all-reduce, tied-weight all-reduce, optimizer (ms)
        phases.append([t0, t_schedule - t0, t_allreduce - t_schedule, t_tied - t_allreduce, t_end - t_tied])
        local_losses.append(sum(float(x.detach()) for x in losses) / len(losses) if has_last and losses else None)

    # ---- gather to rank 0
    status.step = None
    status.phase = "gathering results"
    write_status(args.run_dir, status)
    progress.beat = time.monotonic()
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    mine: dict[str, Any] = {
        "rank": rank,
        "replica": replica,
        "stages": my_stages,
        "step_ms": step_ms,
        "losses": local_losses,
        "timings": timings,
        "phases": phases,
        "host": socket.gethostname(),
        "allreduce_bytes": sum(p.numel() * p.element_size() for p in params) if dp_group is not None else 0,
        "peak": peak,
        "threads": torch.get_num_threads(),
        "params": None,
    }
    if args.check and replica == 0:
        mine["params"] = {
            name: p.detach().cpu().clone()
            for s in my_stages
            for u in range(plan.stages[s].start, plan.stages[s].stop)
            for name, p in split.units[u].named_parameters()
        }
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    dist.barrier()
    if rank != 0:
        return 0
    # the report and the single-process reference need no other rank: stop the watchdog
    progress.done = True
    return _finish(args, plan, entry, split, gathered, backend, device, optimizer_name)


def _finish(
    args: argparse.Namespace,
    plan: Any,
    entry: Any,
    split: Any,
    gathered: list[Any],
    backend: str,
    device: Any,
    optimizer_name: str,
) -> int:
    import torch

    from runtime.report import RankRecord, build_report, check_report, render_lines
    from runtime.training import compare, train_reference

    steps = args.steps
    step_ms = [max(g["step_ms"][i] for g in gathered) for i in range(steps)]
    losses: list[float | None] = []
    for i in range(steps):
        vals = [g["losses"][i] for g in gathered if g["losses"][i] is not None]
        losses.append(sum(vals) / len(vals) if vals else None)
    fwd: dict[int, list[list[float]]] = {}
    bwd: dict[int, list[list[float]]] = {}
    peak: dict[int, int | None] = {}
    for g in gathered:
        for s in g["stages"]:
            t = g["timings"][s]
            # replicas of one stage: keep every replica's samples
            for i, per in enumerate(t["forward"]):
                fwd.setdefault(s, [[] for _ in t["forward"]])[i].extend(per)
            for i, per in enumerate(t["backward"]):
                bwd.setdefault(s, [[] for _ in t["backward"]])[i].extend(per)
            if g["peak"] is not None:
                peak[s] = max(peak.get(s) or 0, g["peak"])
    notes = []
    if entry.data_fn is not None:
        notes.append(f"data: the data function of {args.model} (global batch {plan.global_batch_size} per step)")
    if any(isinstance(mod, torch.nn.Dropout) and mod.p > 0 for mod in entry.model.modules()):
        notes.append(
            "dropout: every layer draws from its own random stream, seeded by (seed, step, replica, "
            "micro-batch, layer), in the pipelined run and in the --check reference alike"
        )
    report = build_report(
        plan,
        model=args.model,
        step_ms=step_ms,
        losses=losses,
        stage_forward_ms=fwd,
        stage_backward_ms=bwd,
        peak_memory=peak,
        backend=backend,
        device=str(device.type),
        optimizer=optimizer_name,
        lr=args.lr,
        seed=args.seed,
        threads_per_rank=gathered[0]["threads"],
        notes=notes,
        ranks=[
            RankRecord(
                rank=g["rank"],
                replica=g["replica"],
                host=g["host"],
                stages=g["stages"],
                allreduce_bytes=g["allreduce_bytes"],
                phases=g["phases"],
                events={s: g["timings"][s]["events"] for s in g["stages"]},
            )
            for g in gathered
        ],
    )
    failed = None
    if args.check:
        from profiler.loading import load_entrypoint

        torch.manual_seed(args.seed)
        ref_entry = load_entrypoint(args.model)
        reference = train_reference(
            ref_entry.model,
            ref_entry.example_inputs,
            ref_entry.loss,
            keywords=ref_entry.keywords,
            seed_hooks=split.seed_hooks,
            steps=steps,
            global_batch_size=plan.global_batch_size,
            microbatch_size=plan.microbatch_size,
            replicas=plan.data_parallel_degree,
            optimizer=optimizer_name,
            lr=args.lr,
            seed=args.seed,
            device=device,
            data_fn=ref_entry.data_fn,
        )
        params: dict[str, Any] = {}
        for g in gathered:
            if g["params"]:
                params.update(g["params"])
        got_losses = [x if x is not None else float("nan") for x in losses]
        cmp = compare(got_losses, params, reference)
        passed = cmp.max_loss_rel_diff <= args.tolerance and cmp.max_param_rel_diff <= args.tolerance
        check = check_report(
            passed=passed,
            tolerance=args.tolerance,
            max_loss_rel_diff=cmp.max_loss_rel_diff,
            max_param_rel_diff=cmp.max_param_rel_diff,
            worst_param=cmp.worst_param,
            params_compared=cmp.params_compared,
            losses_pipelined=got_losses,
            losses_reference=reference.losses,
        )
        report = report.model_copy(update={"check": check})
        if not passed and optimizer_name in ("adam", "adamw") and cmp.max_loss_rel_diff <= args.tolerance:
            report.notes.append(
                "Adam divides each update by the root of the squared-gradient average, so a parameter whose "
                "true gradient is zero (e.g. attention key biases) moves by about lr on rounding noise alone; "
                "two single-process runs that only group micro-batches differently differ as much. Check "
                "the maths with --optimizer sgd (a plan made for sgd)"
            )
        if not passed:
            failed = (
                f"--check failed: the pipelined run differs from the unsplit model by {cmp.max_loss_rel_diff:.3g} "
                f"(losses) and {cmp.max_param_rel_diff:.3g} (parameters, worst {cmp.worst_param}), more than the "
                f"tolerance {args.tolerance:g}"
            )
    text = report.to_json()
    if args.report:
        Path(args.report).write_text(text + "\n", encoding="utf-8")
    if args.run_dir:
        Path(args.run_dir, "report.json").write_text(text + "\n", encoding="utf-8")
    print("\n".join(render_lines(report)), flush=True)
    if args.report:
        print(f"report written to {args.report}", flush=True)
    if failed:
        raise CheckFailedError(failed)
    return 0


def _check_same_batch(fingerprint: int, step: int, rank: int, world: int, device: Any) -> None:
    """Refuse to train when the data function gave the ranks different batches for a step."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([fingerprint], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    values = [int(t.item()) for t in every]
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise InputError(
            f"the data function gave rank {differ[0]} a different global batch than rank 0 at step {step} "
            f"(rank {rank} sees {len(differ)} of {world} ranks differ): data_fn(step, batch_size) must be "
            "deterministic in its arguments (seed a torch.Generator from step, do not use the global RNG "
            "or the rank)"
        )


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _allreduce_mean(grads: list[Any], group: Any, replicas: int) -> None:
    """Average gradients over the data-parallel group, in one flat buffer."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not grads:
        return
    flat = _flatten_dense_tensors(grads)  # type: ignore[no-untyped-call]
    dist.all_reduce(flat, group=group)
    flat /= replicas
    for g, new in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):  # type: ignore[no-untyped-call]
        g.copy_(new)


def _time_stage(
    stage: Any,
    record: dict[str, list[list[Any]]],
    step_box: list[int],
    device: Any,
    fault: Fault | None,
    status: RankStatus,
    streams: Any = None,
) -> None:
    """Time this stage's forward/backward per micro-batch (and inject a fault when asked);
    tell the RNG streams which micro-batch a forward runs.  ``record["events"][step]`` keeps
    each action as ``(op, micro-batch, start, end)`` on ``time.perf_counter``'s clock."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
    calls = [0]

    def _slot(kind: str) -> list[Any]:
        rows = record[kind]
        while len(rows) <= step_box[0]:
            rows.append([])
        return rows[step_box[0]]

    def timed_forward(*a: Any, **kw: Any) -> Any:
        if streams is not None:
            streams.microbatch = int(a[0] if a else kw["fwd_chunk_id"])
        if fault is not None and step_box[0] == fault.step:
            calls[0] += 1
            if calls[0] == 2:  # mid-step: after one micro-batch went through
                _inject(fault, status)
        _sync(device)
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        _sync(device)
        t1 = time.perf_counter()
        _slot("forward").append((t1 - t0) * 1e3)
        _slot("events").append(("F", int(a[0] if a else kw["fwd_chunk_id"]), t0, t1))
        return out

    def timed_backward(*a: Any, **kw: Any) -> Any:
        _sync(device)
        t0 = time.perf_counter()
        out = backward(*a, **kw)
        _sync(device)
        t1 = time.perf_counter()
        _slot("backward").append((t1 - t0) * 1e3)
        _slot("events").append(("B", int(a[0] if a else kw["bwd_chunk_id"]), t0, t1))
        return out

    stage.forward_one_chunk = timed_forward
    stage.backward_one_chunk = timed_backward


def _fold_loss(record: dict[str, list[list[Any]]], step: int, t0: float, t1: float) -> None:
    """Count the loss, computed by the schedule right after the last stage's forward, in that
    forward (duration and end), as the profile counts it in the last layer's."""
    if step < len(record["events"]) and record["events"][step]:
        op, mb, start, _ = record["events"][step][-1]
        record["events"][step][-1] = (op, mb, start, t1)
        record["forward"][step][-1] += (t1 - t0) * 1e3


def _inject(fault: Fault, status: RankStatus) -> None:
    if fault.mode == "raise":
        raise RuntimeError(f"injected fault on rank {fault.rank} at step {fault.step}")
    if fault.mode == "exit":
        os._exit(17)
    time.sleep(10**6)  # hang


if __name__ == "__main__":
    sys.exit(main())
