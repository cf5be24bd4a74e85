"""``pipeplan export``: write a plan as Megatron-LM flags, a torchtitan fragment, a DeepSpeed
config, or a ``torch.distributed.pipelining`` split spec (logic in :mod:`planner.export`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.schema import Plan, Profile


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from planner.export import TARGETS

    p = sub.add_parser(
        "export",
        help="write a plan for Megatron-LM, torchtitan, DeepSpeed or torch.distributed.pipelining",
        description="Write the settings that make another framework run a plan: megatron (command-line "
        "flags), torchtitan (a TOML [parallelism] fragment, and the same as 0.3 command-line overrides), "
        "deepspeed (ds_config.json with the stage boundaries, for examples/deepspeed_pipeline.py), torch "
        "(pipeline() split spec and schedule).  A plan the target cannot express is refused with the "
        "reason and the nearest plan it can express, priced with the profile.",
    )
    p.add_argument("plan", help="plan JSON (from `pipeplan plan -o` or `pipeplan estimate -o`)")
    p.add_argument("--to", required=True, choices=tuple(TARGETS), help="the framework to export to")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (default: print to standard output)")
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="the model's profile, to price the nearest plan of a refused one (default: the bundled "
        "profile when the plan was made from it)",
    )
    p.add_argument(
        "--nearest",
        action="store_true",
        help="when the target cannot express the plan, export the nearest plan it can express instead",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.errors import InputError
    from planner.export import export_plan
    from planner.schema import load_document

    plan: Plan = load_document("plan", args.plan)
    profile: Profile | None = None
    if args.profile:
        profile = load_document("profile", args.profile)
    else:
        profile = _bundled_profile_for(plan)
    export, near = export_plan(plan, args.to, profile=profile, use_nearest=args.nearest, output=args.output)
    if near is not None:
        print(f"note: this plan is not expressible; exporting the nearest plan {args.to} can express:", file=sys.stderr)
        print(near.describe(plan), file=sys.stderr)
    main, *side = export.files
    if args.output is None:
        if side:
            raise InputError(
                f"this export has {len(side)} more file(s) ({', '.join(f.suffix for f in side)}): give -o FILE to write them"
            )
        sys.stdout.write(main.text)
    else:
        for f in (main, *side):
            path = args.output + f.suffix
            try:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(f.text)
            except OSError as err:
                raise InputError(f"cannot write {path!r}: {err.strerror or err}: check that its folder exists and is writable") from None
            print(f"{args.to} export written to {path}", file=sys.stderr)
    for note in export.notes:
        print(note, file=sys.stderr)
    return 0


def _bundled_profile_for(plan: Plan) -> Profile | None:
    """The bundled default profile, when ``plan`` was made from it."""
    from pipeplan.args import load_profile_arg

    profile = load_profile_arg(None)
    return profile if profile.sha256() == plan.profile_sha256 else None
