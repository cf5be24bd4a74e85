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
        "output.float().mean(), and a loss_fn(output, target) gets the targets of the data's first batch. "
        "Or from a Hugging Face config.json (--hf-config).  With --fake nothing is measured: the model is "
        "traced on fake tensors (no memory, no weights, any size) and the device model of --device-type "
        "prices each layer's operations.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        metavar="SPEC",
        help="MODULE:FUNC or path/to/file.py:FUNC, e.g. examples.gpt:tiny",
    )
    source.add_argument(
        "--hf-config",
        metavar="PATH",
        help="a Hugging Face config.json, or a folder holding one (e.g. examples/configs/llama3-70b): the model "
        "is built from it (nothing downloaded) and trained on input_ids of --seq tokens with its LM loss; "
        "causal decoders without sliding windows (Llama, Mixtral, Qwen, DeepSeek-V3) attend as on a GPU "
        "(SDPA is_causal with grouped-query K/V: no mask, K/V not repeated)",
    )
    p.add_argument(
        "--fake",
        action="store_true",
        help="trace on fake tensors instead of measuring: the real profile's layers, parameter, activation "
        "and cut bytes and operation census, times priced by the device model of --device-type (no memory "
        "or weights allocated)",
    )
    p.add_argument(
        "--device-type",
        metavar="PRESET",
        help="with --fake: the device preset whose device model prices the times, e.g. h100-80g",
    )
    p.add_argument("--seq", type=int, default=2048, help="with --hf-config: tokens per sample (default 2048)")
    p.add_argument(
        "--capacity-factor",
        type=float,
        metavar="F",
        help="with --fake, mixture-of-experts layers: each expert processes F times its balanced share of "
        "tokens (capacity routing; default: balanced, tokens x top_k / experts each)",
    )
    p.add_argument(
        "--trace-every-block",
        action="store_true",
        help="with --fake: trace every block of the model's stack (default: one block of each kind, its layer "
        "copied to the others of that kind; the same profile, a fraction of the time: profiler/repeat.py)",
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
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
        help="parameter and activation dtype (default float32; bfloat16 with --fake)",
    )
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
    _check_fake_options(args)
    from profiler.split import CutWarning

    split_points = [x.strip() for x in args.split_points.split(",") if x.strip()] if args.split_points else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CutWarning)
        if args.fake:
            result = _fake(args, sizes, split_points)
        else:
            from profiler.measure import profile

            result = _profile(profile, _entry(args), args, sizes, split_points)
    for w in caught:
        if issubclass(w.category, CutWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    text = result.model_dump_json(indent=1)
    if args.output:
        _write_whole(args.output, text + "\n")
        print(f"profile of {result.num_layers} layers written to {args.output} (sha256 {result.sha256()[:12]})")
    else:
        print(text)
    note = sizes_note(sizes, args.batch_size)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _check_fake_options(args: argparse.Namespace) -> None:
    from planner.errors import InputError
    from planner.presets import DEVICES

    if args.fake:
        if not args.device_type:
            raise InputError(
                f"--fake needs --device-type: the device whose model prices the times, one of {', '.join(sorted(DEVICES))}"
            )
        if args.device != "cpu":
            raise InputError(f"--fake traces on fake CPU tensors: leave out --device {args.device!r}")
        return
    if args.device_type:
        raise InputError(f"--device-type {args.device_type!r} prices a fake profile: add --fake, or leave it out to measure")
    if args.capacity_factor is not None:
        raise InputError(
            f"--capacity-factor {args.capacity_factor} applies to fake profiles (balanced routing stand-in): add --fake"
        )
    if args.trace_every_block:
        raise InputError("--trace-every-block applies to fake profiles (a measured profile runs every block): add --fake")


def _entry(args: argparse.Namespace) -> Any:
    """The entry point of --model or --hf-config (real tensors)."""
    if args.hf_config:
        from profiler.hf_config import hf_entrypoint

        return hf_entrypoint(args.hf_config, seq=args.seq)
    from profiler.loading import load_entrypoint

    return load_entrypoint(args.model)


def _name(args: argparse.Namespace) -> str:
    if args.name:
        return str(args.name)
    if args.hf_config:
        import os

        path = os.path.abspath(str(args.hf_config))
        return os.path.basename(os.path.dirname(path) if path.endswith(".json") else path)
    return str(args.model)


def _fake(args: argparse.Namespace, sizes: list[int], split_points: list[str] | None) -> Any:
    from profiler.fake import fake_profile
    from profiler.summary import print_summary

    result = fake_profile(
        lambda: _entry(args),
        device_type=args.device_type,
        microbatch_sizes=sizes,
        dtype=args.dtype or "bfloat16",
        split_points=split_points,
        name=_name(args),
        capacity_factor=args.capacity_factor,
        repeated_blocks=not args.trace_every_block,
    )
    if not args.quiet:
        print_summary(result)
    return result


def _write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path`` all at once: a temporary file beside it, renamed into place
    (an error or an interrupt leaves no half-written profile)."""
    import os
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".pipeplan-profile-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as open() would have made it
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _profile(profile: Any, entry: Any, args: argparse.Namespace, sizes: list[int], split_points: list[str] | None) -> Any:
    return profile(
        entry.model,
        entry.example_inputs,
        microbatch_sizes=sizes,
        device=args.device,
        dtype=args.dtype or "float32",
        split_points=split_points,
        loss_fn=entry.output_loss(),  # a loss(output, target) gets the first batch's targets
        warmup=args.warmup,
        repeats=args.repeats,
        num_threads=args.threads,
        progress=not args.quiet,
        name=_name(args),
        clock=args.clock,
        keywords=entry.keywords,
        time_budget_s=args.time_budget,
        target_error=args.target_error,
    )
