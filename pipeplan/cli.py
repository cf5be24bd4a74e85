"""Entry points of the ``pipeplan`` and ``plan`` console scripts."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from planner.errors import InfeasibleError, PipeplanError

#: subcommand modules, in the order ``--help`` lists them
COMMAND_MODULES = (
    "pipeplan.cmd_profile",
    "pipeplan.cmd_synth",
    "pipeplan.cmd_estimate",
    "pipeplan.cmd_plan",
    "pipeplan.cmd_sweep",
    "pipeplan.cmd_serve",
    "pipeplan.cmd_run",
    "pipeplan.cmd_calibrate",
    "pipeplan.cmd_show",
    "pipeplan.cmd_export",
    "pipeplan.cmd_schema",
)

EXIT_INPUT_ERROR = 1
EXIT_INFEASIBLE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeplan",
        description="Plan pipeline-parallel training: profile a model, choose stages, micro-batches, "
        "schedule, recompute and the data x pipeline mesh, serve plans, run them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue  # a command not built yet
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except InfeasibleError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except PipeplanError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def plan_main(argv: Sequence[str] | None = None) -> int:
    """The ``plan`` console script: ``plan ARGS`` is ``pipeplan plan ARGS``."""
    return main(["plan", *(sys.argv[1:] if argv is None else argv)])
