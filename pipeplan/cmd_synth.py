"""``pipeplan synth transformer``: an analytic profile for a model too big to run here."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "synth",
        help="synthesize a profile from formulas (models too big to run)",
        description="Fill the profile format from formulas: FLOPs over achieved throughput for "
        "time, Korthikanti et al. 2022 for activation bytes, exact parameter counts.",
    )
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    t = kinds.add_parser(
        "transformer",
        help="GPT-style decoder: embedding, N blocks, LM head",
        description="A GPT-style decoder profile, e.g. the GPipe paper's 6B-parameter "
        "128-layer Transformer: --layers 128 --hidden 2048 --ffn 8192 --heads 16 --seq 1024 --vocab 32000",
    )
    t.add_argument("--layers", type=int, required=True, help="Transformer blocks")
    t.add_argument("--hidden", type=int, required=True, help="hidden size h")
    t.add_argument("--ffn", type=int, help="feed-forward size (default 4 x hidden)")
    t.add_argument("--heads", type=int, required=True, help="attention heads")
    t.add_argument("--seq", type=int, required=True, help="sequence length")
    t.add_argument("--vocab", type=int, required=True, help="vocabulary size")
    t.add_argument("--device-type", default="h100-80g", help="preset: cpu, a100-40g, a100-80g, h100-80g, h200-141g")
    t.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (default bf16)")
    t.add_argument("--mfu", type=float, default=None,
                   help="price every layer at this one fraction of peak FLOP/s instead of the device model "
                   "(default: the device model prices each layer's operation census)")
    t.add_argument("--gemm-efficiency", type=float, metavar="F",
                   help="the device model's large-GEMM fraction of peak (default: the device's published "
                   "figure; fitted constants from pipeplan calibrate or benchmarks/published.py)")
    t.add_argument("--memory-efficiency", type=float, metavar="F",
                   help="the device model's fraction of HBM bandwidth for memory-bound kernels (default: the device's)")
    t.add_argument("--microbatch-sizes", default="1,2,4,8", help="comma-separated (default 1,2,4,8)")
    t.add_argument("--tied-embeddings", action="store_true", help="LM head shares the embedding weights")
    t.add_argument("--no-dropout", action="store_true", help="the model trains without dropout")
    t.add_argument("--attention", choices=("fused", "materialized"), default="fused",
                   help="fused (flash attention: the score matrix never reaches memory; default) or "
                   "materialized (Megatron-LM before flash attention: the softmax and dropout passes over "
                   "the scores are timed at the device's memory bandwidth)")
    t.add_argument("--name", help="model name in the profile")
    t.add_argument("-q", "--quiet", action="store_true", help="no summary table")
    t.add_argument("-o", "--output", metavar="FILE", help="write the profile here (default: print it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeplan.cmd_profile import parse_sizes
    from planner.cost.compute import DeviceConstants, default_constants
    from planner.errors import InputError, PipeplanError
    from profiler.summary import print_summary
    from profiler.synth import synth_transformer

    sizes = parse_sizes(args.microbatch_sizes)
    constants = None
    if args.gemm_efficiency is not None or args.memory_efficiency is not None:
        if args.mfu is not None:
            raise InputError("--mfu prices layers without the device model: give it or the device model's "
                             "--gemm-efficiency / --memory-efficiency, not both")
        try:
            base = default_constants(args.device_type)
            constants = DeviceConstants(
                gemm_efficiency=base.gemm_efficiency if args.gemm_efficiency is None else args.gemm_efficiency,
                memory_efficiency=base.memory_efficiency if args.memory_efficiency is None else args.memory_efficiency,
            )
        except ValueError as err:
            raise InputError(str(err)) from None
    if args.ffn is not None and args.ffn < 1:
        raise InputError(f"--ffn must be >= 1, got {args.ffn}")
    try:
        profile = synth_transformer(
            layers=args.layers,
            hidden=args.hidden,
            ffn=args.ffn,
            heads=args.heads,
            seq=args.seq,
            vocab=args.vocab,
            device_type=args.device_type,
            dtype=args.dtype,
            mfu=args.mfu,
            constants=constants,
            microbatch_sizes=tuple(sizes),
            tied_embeddings=args.tied_embeddings,
            dropout=not args.no_dropout,
            attention=args.attention,
            name=args.name,
        )
    except PipeplanError:
        raise
    except ValueError as err:
        raise InputError(str(err)) from None
    text = profile.model_dump_json(indent=1)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        if not args.quiet:
            print_summary(profile)
        params = sum(layer.param_bytes for layer in profile.layers)
        print(
            f"profile of {profile.num_layers} layers ({params / 2**30:.2f} GiB of parameters) "
            f"written to {args.output}"
        )
    else:
        print(text)
    return 0
