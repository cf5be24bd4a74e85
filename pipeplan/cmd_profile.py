"""``pipeplan profile``: measure a PyTorch model per layer and write a profile JSON."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "profile",
        help="measure a PyTorch model per layer (time, activation memory, cut bytes)",
        description="Measure a model's layers at several micro-batch sizes and write a profile. "
        "The model comes from a function taking no arguments that returns (model, example_inputs), "
        "(model, example_inputs, loss_fn) or (model, example_inputs, loss_fn, data); the default loss is "
        "output.float().mean(), and a loss_fn(output, target) gets the targets of the data's first batch.",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        help="MODULE:FUNC or path/to/file.py:FUNC, e.g. examples.gpt:tiny",
    )
    p.add_argument("--microbatch-sizes", default="1,2,4,8", help="comma-separated, e.g. 1,2,4,8")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"))
    p.add_argument("--split-points", help="module names to cut before, e.g. blocks.4,blocks.8 (default: every block)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up training steps, not timed (default 2)")
    p.add_argument("--repeats", type=int, default=7, help="timed training steps; each layer keeps its median (default 7)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's current setting)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="CPU timing: wall (perf_counter, default) or cpu (thread CPU time: steady on a busy "
        "machine; needs --threads 1)",
    )
    p.add_argument("--name", help="model name in the profile (default: the entry point)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary table")
    p.add_argument("-o", "--output", metavar="FILE", help="write the profile here (default: print it)")
    p.set_defaults(func=run)


def parse_sizes(text: str) -> list[int]:
    from planner.errors import InputError

    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"cannot read --microbatch-sizes {text!r}: write positive integers such as 1,2,4,8") from None
    if not sizes or min(sizes) < 1:
        raise InputError(f"--microbatch-sizes {text!r}: give positive integers such as 1,2,4,8")
    return sizes


def run(args: argparse.Namespace) -> int:
    import sys
    import warnings

    sizes = parse_sizes(args.microbatch_sizes)
    from profiler.loading import load_entrypoint
    from profiler.measure import profile
    from profiler.split import CutWarning

    entry = load_entrypoint(args.model)
    split_points = [x.strip() for x in args.split_points.split(",") if x.strip()] if args.split_points else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CutWarning)
        result = _profile(profile, entry, args, sizes, split_points)
    for w in caught:
        if issubclass(w.category, CutWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    text = result.model_dump_json(indent=1)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"profile of {result.num_layers} layers written to {args.output} (sha256 {result.sha256()[:12]})")
    else:
        print(text)
    return 0


def _profile(profile: Any, entry: Any, args: argparse.Namespace, sizes: list[int], split_points: list[str] | None) -> Any:
    return profile(
        entry.model,
        entry.example_inputs,
        microbatch_sizes=sizes,
        device=args.device,
        dtype=args.dtype,
        split_points=split_points,
        loss_fn=entry.output_loss(),  # a loss(output, target) gets the first batch's targets
        warmup=args.warmup,
        repeats=args.repeats,
        num_threads=args.threads,
        progress=not args.quiet,
        name=args.name or args.model,
        clock=args.clock,
        keywords=entry.keywords,
    )
