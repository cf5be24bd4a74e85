"""``pipeplan plan``: choose stages, micro-batches, schedule, recompute and the D x K mesh."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pipeplan import args as cli_args

if TYPE_CHECKING:
    from pipeplan.render import Comparison
    from planner.schema import Plan, PlanOptions


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="find the fastest plan that fits memory",
        description="Choose stage boundaries, micro-batch count, schedule, recompute and the "
        "data x pipeline mesh with the lowest predicted step time whose every stage fits, and "
        "compare it with the usual baselines.  Without PROFILE, plans the bundled "
        f"{cli_args.DEFAULT_PROFILE} (a synthesized 48-layer, 10B-parameter GPT on H100s).",
    )
    cli_args.add_profile_arg(p, optional=True)
    cli_args.add_cluster_args(p)
    cli_args.add_training_args(p)
    g = p.add_argument_group("decisions to fix (the solver chooses the rest)")
    g.add_argument(
        "--stages",
        help="the number of stages (4: with --virtual-stages v, K = 4/v devices per pipeline, else K = 4 "
        "and no interleaving) or explicit ranges (0:10,10:24,24:50)",
    )
    g.add_argument(
        "--pipeline-degree",
        type=int,
        metavar="K",
        help="devices per pipeline; the solver may still interleave v chunks on each (K x v stages)",
    )
    g.add_argument("--microbatches", type=int, help="micro-batches per step (M)")
    g.add_argument(
        "--schedule",
        choices=("auto", *cli_args.schedule_choices()),
        default="auto",
        help="pipeline schedule (default auto)",
    )
    g.add_argument(
        "--schedules",
        metavar="LIST",
        help="with --schedule auto: the schedules the solver may choose among, e.g. 1f1b,interleaved-1f1b "
        "(those your runtime supports; default all)",
    )
    g.add_argument(
        "--virtual-stages", type=int, help="chunks per device (interleaved-1f1b, interleaved-zb; zbv and dualpipev use 2)"
    )
    g.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    g.add_argument("--recompute", help="fix recompute per stage, e.g. 0,1,1,0 (needs --stages)")
    g.add_argument("--no-partial-recompute", action="store_true",
                   help="recompute whole stages only (default: then checkpoint only the first N layers of each "
                   "recomputing stage, the least N that fits)")
    g.add_argument("--data-parallel", type=int, help="data-parallel degree D")
    g.add_argument("--time-limit", type=float, default=5.0, help="solver time limit in seconds (default 5)")
    cli_args.add_mesh_args(p, fixed_default=False)
    p.add_argument(
        "--server",
        metavar="URL",
        help="plan on a planning service (pipeplan serve) instead of locally, e.g. http://127.0.0.1:8000; "
        "sends PIPEPLAN_API_TOKEN as the bearer token when set",
    )
    cli_args.add_output_args(p)
    p.set_defaults(func=run)


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    from planner.errors import InputError
    from planner.schema import parse_document

    data: dict[str, object] = {"time_limit_s": args.time_limit}
    pipeline_degree = getattr(args, "pipeline_degree", None)
    if args.stages is not None and pipeline_degree is not None:
        raise InputError(
            f"give either --stages {args.stages} (stages) or --pipeline-degree {pipeline_degree} (devices per "
            "pipeline), not both"
        )
    if pipeline_degree is not None:
        if pipeline_degree < 1:
            raise InputError(f"--pipeline-degree {pipeline_degree}: give a positive number of devices")
        data["stages"] = pipeline_degree
    if args.stages is not None:
        stages = cli_args.parse_stages(args.stages)
        if isinstance(stages, int):
            # a count of stages: K = stages / v, and no interleaving unless --virtual-stages says so
            v = args.virtual_stages or 1
            if stages % v:
                raise InputError(
                    f"--stages {stages} with --virtual-stages {v}: the stage count must be a multiple of the "
                    f"chunks per device (K = stages / v devices per pipeline)"
                )
            data["stages"] = stages // v
            if args.virtual_stages is None:
                data["virtual_stages"] = 1
        else:
            data["stages"] = [r.model_dump() for r in stages]
    if args.microbatches is not None:
        data["num_microbatches"] = args.microbatches
    if args.schedule != "auto":
        data["schedule"] = args.schedule
    if args.schedules:
        allowed = cli_args.schedule_choices()
        names = [x.strip() for x in args.schedules.split(",") if x.strip()]
        unknown = [x for x in names if x not in allowed]
        if unknown or not names:
            raise InputError(
                f"--schedules {args.schedules!r}: unknown schedule(s) {', '.join(unknown) or '(none given)'}; "
                f"choose among {', '.join(allowed)}"
            )
        data["schedules"] = names
    if args.virtual_stages is not None:
        data["virtual_stages"] = args.virtual_stages
    if args.no_recompute and args.recompute is not None:
        raise InputError("give either --no-recompute or --recompute 0,1,..., not both")
    if args.no_recompute:
        data["recompute"] = False
    elif args.recompute is not None:
        flags = cli_args.parse_bools(args.recompute)
        data["recompute"] = flags[0] if len(flags) == 1 else flags
    if args.data_parallel is not None:
        data["data_parallel"] = args.data_parallel
    if args.no_partial_recompute:
        data["partial_recompute"] = False
    if getattr(args, "tensor_parallel", None) is not None:
        data["tensor_parallel"] = args.tensor_parallel
    if getattr(args, "zero", None) is not None:
        data["zero_stage"] = args.zero
    if getattr(args, "sequence_parallel", None) is not None:
        data["sequence_parallel"] = args.sequence_parallel
    if getattr(args, "tensor_parallel_across_nodes", False):
        data["tensor_parallel_across_nodes"] = True
    if getattr(args, "selective_recompute", None) is not None:
        data["selective_recompute"] = args.selective_recompute
    if getattr(args, "context_parallel", None) is not None:
        data["context_parallel"] = args.context_parallel
    if getattr(args, "context_attention", None) not in (None, "all-gather"):
        data["context_attention"] = args.context_attention
    if getattr(args, "expert_parallel", None) is not None:
        data["expert_parallel"] = args.expert_parallel
    options: PlanOptions = parse_document("options", data, source="(from the command line)")
    return options


def solve_from_args(args: argparse.Namespace) -> tuple[Plan, list[Comparison]]:
    """Solve locally, or on the service named by ``--server``: the plan and one comparison per baseline.

    Baselines are evaluated here in both cases (they are cheap), so the output is the same.
    """
    from pipeplan.render import Comparison
    from planner.baselines import evaluate_baselines

    cli_args.check_plan_flags(args)  # before reading anything: a typo is answered at once
    profile = cli_args.load_profile_arg(args.profile)
    cluster = cli_args.cluster_from_args(args, profile)
    training = cli_args.training_from_args(args)
    options = options_from_args(args)
    if getattr(args, "server", None):
        import os

        from api.client import remote_plan

        _, plan = remote_plan(
            args.server,
            profile=profile,
            cluster=cluster,
            training=training,
            options=options,
            token=os.environ.get("PIPEPLAN_API_TOKEN"),
            timeout_s=options.time_limit_s + 120,
        )
    else:
        from planner.solver import solve

        plan = solve(profile, cluster, training, options)
    comparisons = []
    # Unless M is fixed, baselines run at the plan's micro-batch size (one pipeline over all the
    # devices, so M x D micro-batches), which isolates what the split and schedule are worth.
    baseline_m = options.num_microbatches or plan.num_microbatches * plan.data_parallel_degree
    for result in evaluate_baselines(profile, cluster, training, num_microbatches=baseline_m, options=options):
        if result.plan is None:
            comparisons.append(Comparison(f"baseline {result.name}", None, result.note))
        else:
            comparisons.append(
                Comparison(f"baseline {result.name}", result.plan.predicted.step_time_ms, result.note)
            )
    return plan, comparisons


def run(args: argparse.Namespace) -> int:
    from pipeplan.cmd_estimate import emit_plan

    plan, comparisons = solve_from_args(args)
    emit_plan(plan, args, comparisons)
    return 0
