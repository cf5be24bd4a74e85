"""``pipeplan estimate``: the cost model's prediction for a split you give."""

from __future__ import annotations

import argparse

from pipeplan import args as cli_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "estimate",
        help="predict step time and memory of a given split",
        description="Predict the step time, bubble and per-stage memory of a plan you specify.",
    )
    cli_args.add_profile_arg(p, optional=False)
    cli_args.add_cluster_args(p)
    cli_args.add_training_args(p)
    g = p.add_argument_group("the plan")
    g.add_argument("--stages", required=True, help="[start:stop) layer ranges, e.g. 0:10,10:20,20:30,30:40")
    g.add_argument("--microbatches", type=int, required=True, help="micro-batches per step (M)")
    g.add_argument("--schedule", choices=cli_args.schedule_choices(), default="1f1b",
                   help="the pipeline schedule to price (default 1f1b; see the docs' Schedules page)")
    g.add_argument("--recompute", help="per stage 0/1, e.g. 0,1,0,0 (or a single 0/1 for all)")
    g.add_argument("--recompute-layers", metavar="N[,N...]",
                   help="per stage, how many of its first layers are checkpointed (a single N for every "
                   "stage, capped at its layers); 0: none.  Default: all of a recomputing stage's layers")
    g.add_argument("--data-parallel", type=int, default=1, help="data-parallel degree D")
    g.add_argument("--pipeline-degree", type=int, help="K (interleaved: devices per pipeline)")
    cli_args.add_mesh_args(p, fixed_default=True)
    cli_args.add_output_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.cost import Layout, estimate
    from planner.errors import InputError
    from planner.limits import check_schedule_size

    cli_args.check_plan_flags(args)  # before reading anything: a typo is answered at once
    stages = cli_args.parse_stages(args.stages)
    if isinstance(stages, int):
        raise InputError(f"--stages {args.stages!r}: estimate needs explicit ranges such as 0:10,10:20")
    check_schedule_size(len(stages), args.microbatches, what=f"--stages with --microbatches {args.microbatches}")
    profile = cli_args.load_profile_arg(args.profile)
    cluster = cli_args.cluster_from_args(args, profile)
    training = cli_args.training_from_args(args)
    recompute: bool | list[bool] = False
    if args.recompute is not None:
        flags = cli_args.parse_bools(args.recompute)
        recompute = flags[0] if len(flags) == 1 else flags
    plan = estimate(
        profile, cluster, training,
        Layout(
            stages,
            num_microbatches=args.microbatches,
            schedule=args.schedule,
            recompute=recompute,
            recompute_layers=_recompute_layers(args.recompute_layers, [(r.start, r.stop) for r in stages]),
            data_parallel=args.data_parallel,
            pipeline_degree=args.pipeline_degree,
            tensor_parallel=args.tensor_parallel or 1,
            zero_stage=args.zero or 0,
            sequence_parallel=bool(args.sequence_parallel),
            tensor_parallel_across_nodes=args.tensor_parallel_across_nodes,
            selective_recompute=bool(args.selective_recompute),
            context_parallel=args.context_parallel or 1,
            expert_parallel=args.expert_parallel or 1,
            context_attention=args.context_attention,
        ),
    )
    emit_plan(plan, args)
    return 0


def _recompute_layers(text: str | None, stages: list[tuple[int, int]]) -> list[int | None] | None:
    """``--recompute-layers`` as one count per stage (a single count for all, capped at each
    stage's layers)."""
    from planner.errors import InputError

    if text is None:
        return None
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"--recompute-layers {text!r}: give whole numbers, e.g. 2 or 2,2,0,1") from None
    if any(c < 0 for c in counts):
        raise InputError(f"--recompute-layers {text!r}: counts must be >= 0")
    if len(counts) == 1:
        return [min(counts[0], b - a) for a, b in stages]
    if len(counts) != len(stages):
        raise InputError(
            f"--recompute-layers {text!r} gives {len(counts)} counts for {len(stages)} stages: one per stage, or one for all"
        )
    return list(counts)


def emit_plan(plan, args, comparisons=()) -> None:  # type: ignore[no-untyped-def]
    """Print a plan as a table or JSON, and write it with ``-o``."""
    from pipeplan.render import print_plan

    text = plan.model_dump_json(indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        print_plan(plan, comparisons)
        if args.output:
            print(f"plan written to {args.output}")
