"""``pipeplan schema KIND``: print the JSON Schema of a document."""

from __future__ import annotations

import argparse
import json

from planner.schema import DOCUMENTS


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of a document: profile, cluster, training, plan, options, sweep or report")
    p.add_argument("kind", choices=sorted(DOCUMENTS), help="which document's schema to print")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.schema import json_schema

    print(json.dumps(json_schema(args.kind), indent=2))
    return 0
