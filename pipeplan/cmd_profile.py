"""``pipeplan profile``: measure a PyTorch model per layer and write a profile JSON."""

from __future__ import annotations

import argparse
from typing import Any

from profiler.sampling import TARGET_ERROR, TIME_BUDGET_S

#: micro-batch sizes measured when neither --microbatch-sizes nor --batch-size says
DEFAULT_SIZES = (1, 2, 4, 8)


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
    p.add_argument(
        "--microbatch-sizes",
        help="comma-separated, e.g. 1,2,4,8 (default: 1,2,4,... up to --batch-size, else 1,2,4,8)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        metavar="G",
        help="the global batch you will plan with: the default sizes then reach every micro-batch a plan for it "
        "can use (1,2,4,... up to G), so no plan extrapolates",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"))
    p.add_argument("--split-points", help="module names to cut before, e.g. blocks.4,blocks.8 (default: every block)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up training steps, not timed (default 2)")
    p.add_argument(
        "--repeats",
        type=int,
        help="timed training steps per size, exactly (default: adaptive, until every layer's median is "
        "known within --target-error or --time-budget is spent)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=TIME_BUDGET_S,
        metavar="SECONDS",
        help=f"adaptive repeats: seconds of timed steps over all sizes, at least 5 steps each (default {TIME_BUDGET_S:g})",
    )
    p.add_argument(
        "--target-error",
        type=float,
        default=TARGET_ERROR,
        metavar="FRACTION",
        help=f"adaptive repeats: each layer's median within this relative error (default {TARGET_ERROR:g})",
    )
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


def default_sizes(batch_size: int | None) -> list[int]:
    """1, 2, 4, ... up to the global batch (itself included), or :data:`DEFAULT_SIZES`."""
    if batch_size is None:
        return list(DEFAULT_SIZES)
    sizes = []
    b = 1
    while b < batch_size:
        sizes.append(b)
        b *= 2
    return [*sizes, batch_size]


def sizes_note(sizes: list[int], batch_size: int | None) -> str | None:
    """What the measured sizes mean for plans, and how to measure the sizes a plan can use."""
    largest = max(sizes)
    if batch_size is None:
        return (
            f"measured micro-batch sizes {','.join(map(str, sizes))}: a plan whose micro-batch is larger than "
            f"{largest} extrapolates (its notes say so); give the global batch you will plan with "
            "(--batch-size G) to measure every size a plan for it can use"
        )
    if largest < batch_size:
        more = ",".join(map(str, sorted({*sizes, *default_sizes(batch_size)})))
        return (
            f"plans for a global batch of {batch_size} can use micro-batches up to {batch_size}; the largest measured "
            f"here is {largest}, so larger ones are extrapolated (the plan says so): profile with "
            f"--microbatch-sizes {more} to measure them"
        )
    return None


def run(args: argparse.Namespace) -> int:
    import sys
    import warnings

    from planner.errors import InputError
    from planner.limits import MAX_GLOBAL_BATCH, MAX_PROFILE_SIZES

    if args.batch_size is not None and not 1 <= args.batch_size <= MAX_GLOBAL_BATCH:
        raise InputError(f"--batch-size {args.batch_size}: give the global batch, 1 to {MAX_GLOBAL_BATCH:,}")
    sizes = parse_sizes(args.microbatch_sizes) if args.microbatch_sizes is not None else default_sizes(args.batch_size)
    if len(sizes) > MAX_PROFILE_SIZES or max(sizes) > MAX_GLOBAL_BATCH:
        raise InputError(
            f"--microbatch-sizes: {len(sizes)} sizes up to {max(sizes):,}; pipeplan profiles at most "
            f"{MAX_PROFILE_SIZES} sizes of at most {MAX_GLOBAL_BATCH:,} samples (e.g. 1,2,4,8)"
        )
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
    note = sizes_note(sizes, args.batch_size)
    if note:
        print(f"note: {note}", file=sys.stderr)
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
        time_budget_s=args.time_budget,
        target_error=args.target_error,
    )
