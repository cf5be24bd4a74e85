"""``pipeplan sweep``: the best plan on several cluster sizes and device kinds."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pipeplan import args as cli_args

if TYPE_CHECKING:
    from planner.schema import SweepResult


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sweep",
        help="what-if: the best plan on several cluster sizes and device kinds",
        description="Plan the same model and training on each device count (times each device "
        "type or memory size): throughput, scaling efficiency, memory headroom and proven gap per "
        "point, the Pareto front of devices against step time, the fewest devices reaching a "
        "target throughput, and where a device kind's memory is too small.",
    )
    cli_args.add_profile_arg(p, optional=True)
    g = p.add_argument_group("the points")
    g.add_argument("--devices", required=True, help="device counts, e.g. 8,16,32,64")
    g.add_argument("--device-type", help="device preset(s) to compare, e.g. a100-40g,h100-80g")
    g.add_argument("--memory", help="memory size(s) per device to compare, e.g. 40GiB,80GiB")
    g.add_argument("--devices-per-node", type=int, help="devices per node (default: the preset's)")
    g.add_argument("--interconnect", help="intra-node link preset: pcie4, pcie5, nvlink3, nvlink4, loopback")
    g.add_argument("--inter-node", help="inter-node link preset: ib-hdr, ib-ndr, ...")
    cli_args.add_training_args(p)
    g = p.add_argument_group("planning")
    g.add_argument("--schedule", choices=("auto", *cli_args.schedule_choices()), default="auto",
                   help="fix the schedule at every point (default auto)")
    g.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    g.add_argument("--time-limit", type=float, default=1.0, help="solver time limit per point (default 1 s)")
    g.add_argument("--target-samples-per-s", type=float, help="report the fewest devices reaching this throughput")
    p.add_argument("--chart", metavar="FILE", help="write a chart of throughput and efficiency (.svg or .png)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the sweep JSON (with every plan) here")
    p.add_argument("--json", action="store_true", help="print the sweep as JSON instead of a table")
    p.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> tuple[dict[str, object], dict[str, object]]:
    """The sweep spec document and the cluster defaults of every point."""
    from planner.errors import InputError

    data: dict[str, object] = {"devices": _ints(args.devices, "--devices"), "time_limit_s": args.time_limit}
    if args.device_type and args.memory:
        raise InputError("give --device-type or --memory to compare, not both")
    if args.device_type:
        data["device_types"] = _list(args.device_type)
    if args.memory:
        data["memories"] = _list(args.memory)
    for flag, field in (("devices_per_node", "devices_per_node"), ("interconnect", "intra_node"), ("inter_node", "inter_node")):
        if getattr(args, flag) is not None:
            data[field] = getattr(args, flag)
    if args.target_samples_per_s is not None:
        data["target_samples_per_s"] = args.target_samples_per_s
    return data, {}


def run(args: argparse.Namespace) -> int:
    from planner.errors import InputError
    from planner.schema import PlanOptions, SweepSpec, parse_document
    from planner.sweep import sweep

    profile = cli_args.load_profile_arg(args.profile)
    training = cli_args.training_from_args(args)
    data, defaults = spec_from_args(args)
    spec: SweepSpec = parse_document("sweep", data, source="(from the command line)")
    if not spec.device_types and not spec.memories:
        device_type = cli_args.default_device_type(profile)
        if device_type is None:
            raise InputError(
                f"profile measured on {profile.measured_on.device!r}: say what devices to sweep with "
                "--memory 80GiB or --device-type h100-80g"
            )
        defaults["device_type"] = device_type
    options: dict[str, object] = {}
    if args.schedule != "auto":
        options["schedule"] = args.schedule
    if args.no_recompute:
        options["recompute"] = False
    plan_options: PlanOptions = parse_document("options", options, source="(from the command line)")
    if args.chart:
        from planner.charts import _require_matplotlib

        _require_matplotlib()  # fail before the work, not after it
    result = sweep(profile, training, spec, options=plan_options, defaults=defaults)
    text = result.model_dump_json(indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        print_sweep(result)
    if args.chart:
        from planner.charts import save_chart, sweep_figure

        save_chart(sweep_figure(result), args.chart)
        if not args.json:
            print(f"chart written to {args.chart}")
    return 0


def print_sweep(result: SweepResult) -> None:
    from rich.table import Table

    from pipeplan.render import make_console

    console = make_console()
    table = Table(title=f"{result.model}: best plan per cluster")
    kinds = any(p.device_kind for p in result.points)
    columns = [("devices", "right"), ("plan", "left"), ("step ms", "right"), ("samples/s", "right"),
               ("efficiency", "right"), ("headroom", "right"), ("gap", "right"), ("Pareto", "center")]
    if kinds:
        columns.insert(0, ("device", "left"))
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for p in result.points:
        row: list[str]
        if p.plan is None:
            reason = p.message.splitlines()[0] if p.message else "no plan"
            row = [str(p.devices), f"[red]does not fit[/]: {reason[:90]}", "", "", "", "", "", ""]
        else:
            plan = p.plan
            mesh = f"D{plan.data_parallel_degree}xK{plan.pipeline_degree}" + (
                f"v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
            desc = f"{mesh} M{plan.num_microbatches} {plan.schedule}"
            if plan.idle_devices:
                desc += f", {plan.idle_devices} idle"
            row = [
                str(p.devices), desc, f"{p.step_time_ms:.1f}", f"{p.throughput_samples_per_s:.1f}",
                f"{p.scaling_efficiency:.0%}" if p.scaling_efficiency is not None else "",
                f"{p.memory_headroom:.0%}" if p.memory_headroom is not None else "",
                f"{p.gap:.1%}" if p.gap is not None else "", "*" if p.pareto else "",
            ]
        if kinds:
            row.insert(0, p.device_kind)
        table.add_row(*row)
    console.print(table)
    if result.target_samples_per_s is not None:
        for kind, n in result.fewest_devices_for_target.items():
            where = f" of {kind}" if kind else ""
            if n is None:
                console.print(f"no point{where} reaches {result.target_samples_per_s:g} samples/s", highlight=False)
            else:
                console.print(f"fewest devices{where} reaching {result.target_samples_per_s:g} samples/s: {n}",
                              highlight=False)
    console.print(f"swept {len(result.points)} points in {result.wall_time_s:.1f} s "
                  "(Pareto: no point with as few devices is as fast)", highlight=False)


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str, flag: str) -> list[int]:
    from planner.errors import InputError

    out = []
    for part in _list(text):
        if not part.isdigit():
            raise InputError(f"cannot read {part!r} in {flag} {text!r}: give device counts such as 8,16,32")
        out.append(int(part))
    if not out:
        raise InputError(f"{flag} {text!r} names no device count: give counts such as 8,16,32")
    return out
