"""``pipeplan synth transformer``: an analytic profile for a model too big to run here."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from profiler.decoder import DecoderSpec


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
    t.add_argument("--hf-config", metavar="PATH",
                   help="read the architecture from a Hugging Face config.json (or a folder holding one; "
                   "model types gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe; torch-free). "
                   "--layers/--hidden/--heads/--vocab then come from it")
    t.add_argument("--layers", type=int, help="Transformer blocks")
    t.add_argument("--hidden", type=int, help="hidden size h")
    t.add_argument("--ffn", type=int, help="feed-forward size (default 4 x hidden)")
    t.add_argument("--heads", type=int, help="attention heads")
    t.add_argument("--seq", type=int, required=True, help="sequence length")
    t.add_argument("--vocab", type=int, help="vocabulary size")
    arch = t.add_argument_group("architecture (default: GPT-3's)")
    arch.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default --heads)")
    arch.add_argument("--head-dim", type=int, help="dimensions per head (default hidden / heads)")
    arch.add_argument("--gated-mlp", action="store_true", help="SwiGLU/GeGLU MLP: three matrices")
    arch.add_argument("--norm", choices=("layernorm", "rmsnorm"), default="layernorm", help="block norms")
    arch.add_argument("--no-bias", action="store_true", help="linear layers without biases (Llama)")
    arch.add_argument("--positions", choices=("learned", "rotary"), default="learned",
                      help="learned position embeddings (GPT) or rotary (no parameters)")
    moe = t.add_argument_group("mixture of experts")
    moe.add_argument("--experts", type=int, help="routed experts per MoE block (makes the blocks MoE)")
    moe.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    moe.add_argument("--expert-ffn", type=int, help="each expert's FFN size (default --ffn)")
    moe.add_argument("--shared-experts", type=int, default=0, help="experts every token passes (default 0)")
    moe.add_argument("--shared-expert-ffn", type=int, help="the shared experts' FFN size, all together "
                     "(default shared experts x expert FFN)")
    moe.add_argument("--dense-layers", type=int, default=0, help="the first N blocks stay dense (default 0)")
    moe.add_argument("--capacity-factor", type=float,
                     help="tokens per expert over the balanced share (default: balanced routing)")
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
    from profiler.synth import synth_decoder

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
    try:
        spec = _spec(args)
        profile = synth_decoder(
            spec,
            device_type=args.device_type,
            dtype=args.dtype,
            mfu=args.mfu,
            constants=constants,
            microbatch_sizes=tuple(sizes),
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


def _spec(args: argparse.Namespace) -> DecoderSpec:
    """The decoder the flags (or ``--hf-config``) describe."""
    from dataclasses import replace

    from planner.errors import InputError
    from profiler.decoder import DecoderSpec, MoESpec
    from profiler.hf_spec import read_config, spec_from_config

    if args.hf_config:
        given = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab", "ffn", "kv_heads", "head_dim", "experts")
                 if getattr(args, k) is not None]
        if given:
            raise InputError(f"--hf-config gives the architecture: drop {', '.join(given).replace('_', '-')} "
                             "(or drop --hf-config and give every size)")
        spec = spec_from_config(read_config(args.hf_config), seq=args.seq, name=args.name)
        return replace(spec, attention=args.attention, tied_embeddings=spec.tied_embeddings or args.tied_embeddings)
    missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab") if getattr(args, k) is None]
    if missing:
        raise InputError(f"synth transformer needs {', '.join(missing)} (or --hf-config PATH to read them from a "
                         "Hugging Face config.json)")
    moe = None
    if args.experts is not None:
        moe = MoESpec(experts=args.experts, top_k=args.top_k,
                      expert_ffn=args.expert_ffn if args.expert_ffn is not None else (args.ffn or 4 * args.hidden),
                      shared_experts=args.shared_experts, shared_ffn=args.shared_expert_ffn,
                      dense_layers=args.dense_layers, capacity_factor=args.capacity_factor)
    elif args.expert_ffn is not None or args.shared_experts or args.dense_layers or args.capacity_factor is not None:
        raise InputError("--expert-ffn, --shared-experts, --dense-layers and --capacity-factor describe a mixture "
                         "of experts: give --experts N too")
    return DecoderSpec(
        layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=args.heads, seq=args.seq, vocab=args.vocab,
        kv_heads=args.kv_heads, head_dim=args.head_dim, gated_mlp=args.gated_mlp, norm=args.norm,
        bias=not args.no_bias, positions=args.positions, tied_embeddings=args.tied_embeddings,
        dropout=not args.no_dropout, attention=args.attention, moe=moe, name=args.name,
    )
