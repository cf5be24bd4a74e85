"""``pipeplan show``: look at a plan - a text grid of its schedule, or Gantt and memory charts."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

#: the widest text grid ``show`` draws
MAX_COLUMNS = 10_000

if TYPE_CHECKING:
    from planner.schema import Plan


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "show",
        help="draw a plan: text grid of the schedule, Gantt and memory charts",
        description="Show a plan's schedule.  Without --gantt/--memory/--actions, print a text grid of "
        "the schedule (device x time slot: F3 = forward of micro-batch 3, B = backward, I/W = its "
        "input/weight-gradient halves, R = recompute, . = idle).  With them, write the charts (.svg or "
        ".png by the file name) or the action list as torch's schedule CSV.",
    )
    p.add_argument("plan", help="plan JSON (from `pipeplan plan -o` or `pipeplan estimate -o`)")
    p.add_argument("--gantt", metavar="FILE", help="write the schedule Gantt chart here (.svg or .png)")
    p.add_argument("--memory", metavar="FILE", help="write the per-device memory chart here (.svg or .png)")
    p.add_argument(
        "--actions",
        metavar="FILE",
        help="write what each rank runs as torch.distributed.pipelining's compute-only CSV (one row per "
        "rank, e.g. 0F0,0F1,0I0,0W0; _PipelineScheduleRuntime._load_csv reads it); '-' for stdout",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="re-evaluate the plan with this profile (e.g. a fresh measurement of the same model) "
        "before showing it",
    )
    p.add_argument("--slot-ms", type=float, help="text grid: milliseconds per column (default: shortest event)")
    p.add_argument("--width", type=int, default=96, help="text grid: most columns (default 96)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.errors import InputError
    from planner.schema import load_document

    plan: Plan = load_document("plan", args.plan)
    if args.profile:
        plan = reevaluate(plan, args.profile)
    if args.actions is not None:
        write_actions(plan, args.actions)
        if args.gantt is None and args.memory is None:
            return 0
    if args.gantt is None and args.memory is None:
        from planner.grid import text_grid

        if args.slot_ms is not None and not (args.slot_ms > 0 and math.isfinite(args.slot_ms)):
            raise InputError(f"--slot-ms must be a positive number of milliseconds, got {args.slot_ms}")
        if args.width < 1:
            raise InputError(f"--width must be >= 1 column, got {args.width}")
        if args.width > MAX_COLUMNS:
            raise InputError(f"--width {args.width}: at most {MAX_COLUMNS:,} columns")
        if args.slot_ms is not None:
            from planner.cost import simulate_plan

            columns = simulate_plan(plan).makespan_ms / args.slot_ms
            if columns > MAX_COLUMNS:
                raise InputError(
                    f"--slot-ms {args.slot_ms:g} cuts the {plan.predicted.step_time_ms:.4g} ms step into "
                    f"{columns:,.0f} columns (at most {MAX_COLUMNS:,}): give a larger slot, or leave "
                    "--slot-ms out to fit --width"
                )
        print(text_grid(plan, slot_ms=args.slot_ms, max_columns=args.width))
        return 0
    from planner.charts import gantt_figure, memory_figure, save_chart

    for path, build, what in ((args.gantt, gantt_figure, "Gantt chart"), (args.memory, memory_figure, "memory chart")):
        if path is None:
            continue
        _check_suffix(path)
        written = save_chart(build(plan), path)
        print(f"{what} written to {written}")
    return 0


def write_actions(plan: Plan, path: str) -> None:
    """The plan's per-rank actions as torch's compute-only CSV (``-``: standard output)."""
    from planner.cost import plan_orders
    from planner.errors import InputError
    from planner.schedules import to_csv

    text = to_csv(plan_orders(plan))
    if path == "-":
        print(text, end="")
        return
    try:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    except OSError as err:
        raise InputError(f"cannot write the actions to {path!r}: {err}") from None
    print(f"actions of {plan.pipeline_degree} ranks ({plan.schedule}) written to {path}")


def _check_suffix(path: str) -> None:
    from planner.errors import InputError

    if not path.lower().endswith((".svg", ".png")):
        raise InputError(f"cannot write a chart to {path!r}: the file name must end in .svg or .png")


def reevaluate(plan: Plan, profile_path: str) -> Plan:
    """The plan's decisions re-evaluated by the cost model on another profile of the same model."""
    from planner.cost import reestimate
    from planner.errors import PlanMismatchError
    from planner.schema import Profile, load_document

    profile: Profile = load_document("profile", profile_path)
    if profile.sha256() != plan.profile_sha256:
        raise PlanMismatchError(
            f"profile {profile_path!r} (model {profile.model!r}, {profile.num_layers} layers) is not the "
            f"model the plan was made for ({plan.model!r}, {plan.num_layers} layers): its structure "
            f"fingerprint {profile.sha256()[:12]}... differs from the plan's {plan.profile_sha256[:12]}...; "
            "give a profile of the same model, or make a new plan for this one"
        )
    new = reestimate(plan, profile, solver=plan.solver)
    print(
        f"re-evaluated on {profile_path}: predicted step {plan.predicted.step_time_ms:.2f} ms in the plan, "
        f"{new.predicted.step_time_ms:.2f} ms with this profile"
    )
    return new
