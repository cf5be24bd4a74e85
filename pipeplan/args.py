"""Flags shared by ``estimate`` and ``plan`` (and the service client), so both read the same way."""

from __future__ import annotations

import argparse
import math
from importlib import resources
from typing import Any

from planner.errors import InputError
from planner.limits import (
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_TIME_LIMIT_S,
    loads_strict,
    too_large,
)
from planner.schema import (
    SCHEDULES,
    Cluster,
    Profile,
    StageRange,
    TrainingSetup,
    load_document,
    parse_document,
)

DEFAULT_PROFILE = "gpt-48l-10b.json"


def add_profile_arg(p: argparse.ArgumentParser, *, optional: bool) -> None:
    if optional:
        p.add_argument(
            "profile",
            nargs="?",
            default=None,
            help=f"profile JSON (default: the bundled {DEFAULT_PROFILE}, a synthesized 48-layer "
            "10B-parameter GPT on H100s)",
        )
    else:
        p.add_argument("profile", help="profile JSON")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--cluster", metavar="FILE", help="cluster JSON (instead of the flags below)")
    g.add_argument("--devices", type=int, help="number of devices")
    g.add_argument("--memory", help="memory per device, e.g. 80GiB or 141GB")
    g.add_argument("--device-type", help="preset: cpu, a100-40g, a100-80g, h100-80g, h200-141g, h800-80g")
    g.add_argument("--devices-per-node", type=int, help="devices per node (default: the preset's, or all)")
    g.add_argument("--interconnect", help="intra-node link preset: pcie4, pcie5, nvlink3, nvlink4, loopback")
    g.add_argument("--inter-node", help="inter-node link preset: ib-hdr, ib-ndr, ...")
    g.add_argument("--speeds", help="comma-separated relative speed of each device, e.g. 1,1,0.5,0.5")
    g.add_argument("--memories", help="comma-separated memory of each device, e.g. 80GiB,80GiB,40GiB,40GiB")


def add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--training", metavar="FILE", help="training setup JSON (instead of the flags below)")
    g.add_argument("--batch-size", type=int, help="global batch size (default 32)")
    g.add_argument("--optimizer", help="sgd, sgd-momentum, adam, adamw, or a -mixed variant (default adam)")
    g.add_argument(
        "--fused-optimizer", action="store_true", default=None,
        help="the optimizer step runs fused kernels (torch fused=True, apex/Transformer Engine FusedAdam as in "
        "Megatron-LM and DeepSpeed): no temporaries; default: torch's foreach kernels, whose Adam step holds a "
        "float32 copy of the rank's parameters (pipeplan run uses the kernels the plan says)",
    )
    g.add_argument("--memory-margin", type=float, help="fraction of memory kept free (default 0.1)")
    g.add_argument(
        "--dtype",
        help="compute dtype of the run: bf16, fp16 (autocast, fp32 master weights) or fp32; "
        "activation and parameter bytes are rescaled from the profile's dtype (default: the profile's, unscaled)",
    )


def add_mesh_args(p: argparse.ArgumentParser, *, fixed_default: bool) -> None:
    """``--tensor-parallel T``, ``--zero 0|1|2|3``, ``--sequence-parallel``: the mesh axes beyond D x K
    (``plan`` chooses those not given; ``estimate`` defaults them to 1, 0, off)."""
    free = "" if fixed_default else " (default: the solver chooses)"
    g = p.add_argument_group("mesh axes beyond data x pipeline")
    g.add_argument("--tensor-parallel", type=int, metavar="T",
                   help="tensor-parallel degree T, devices per stage replica inside a node" + (free or " (default 1)"))
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage over the data-parallel replicas: 0 none, 1 optimizer state, 2 also "
                   "gradients, 3 also parameters" + (free or " (default 0)"))
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="Megatron sequence parallelism inside the tensor-parallel group" + (free or " (default off)"))
    g.add_argument("--tensor-parallel-across-nodes", action="store_true",
                   help="allow a tensor-parallel group to span nodes (T beyond the devices per node)")
    g.add_argument("--selective-recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="Megatron's selective recompute of attention's scores, softmax and dropout on every "
                   "block, instead of full recompute (needs a profile with selective_recompute_bytes, "
                   "e.g. from synth)" + (free or " (default off)"))
    g.add_argument("--context-parallel", type=int, metavar="C",
                   help="context-parallel degree C: devices that split each sequence (long sequences)"
                   + (" (default: the solver chooses; C > 1 for sequences of 16K tokens or more)" if free else " (default 1)"))
    g.add_argument("--context-attention", choices=("all-gather", "ring"), default="all-gather",
                   help="attention under C > 1: all-gather K/V (Llama 3; default) or a ring pass overlapped "
                   "with attention (torch's context_parallel)")
    g.add_argument("--expert-parallel", type=int, metavar="E",
                   help="expert-parallel degree E: ranks a mixture-of-experts layer's experts are sharded over "
                   "(from the D x C ranks of a stage)" + (" (default: the solver chooses, MoE profiles)" if free else " (default 1)"))


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan JSON here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def check_flag(flag: str, value: float | None, limit: float, what: str) -> None:
    """``--devices 20000000``: an error at once, before anything that size is built."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{flag} {value}: give a finite number")
    if value <= limit:
        return
    if isinstance(value, int):
        raise InputError(f"{flag} {value}: {too_large(what, value, int(limit), suggest=True)}")
    raise InputError(f"{flag} {value:g}: more {what} than pipeplan allows (at most {limit:g})")


def check_cluster_flags(args: argparse.Namespace) -> None:
    check_flag("--devices", args.devices, MAX_DEVICES, "devices")
    check_flag("--devices-per-node", args.devices_per_node, MAX_DEVICES, "devices per node")


def check_plan_flags(args: argparse.Namespace) -> None:
    """The size flags of ``plan`` and ``estimate`` against what pipeplan plans."""
    check_cluster_flags(args)
    check_flag("--batch-size", args.batch_size, MAX_GLOBAL_BATCH, "samples per step")
    check_flag("--microbatches", getattr(args, "microbatches", None), MAX_MICROBATCHES, "micro-batches per step")
    check_flag("--data-parallel", getattr(args, "data_parallel", None), MAX_DEVICES, "data-parallel replicas")
    check_flag("--pipeline-degree", getattr(args, "pipeline_degree", None), MAX_DEVICES, "pipeline stages")
    check_flag("--virtual-stages", getattr(args, "virtual_stages", None), MAX_LAYERS, "virtual stages per device")
    check_flag("--time-limit", getattr(args, "time_limit", None), MAX_TIME_LIMIT_S, "seconds of solver time")
    check_flag("--tensor-parallel", getattr(args, "tensor_parallel", None), MAX_DEVICES, "tensor-parallel devices")
    for flag in ("tensor_parallel", "context_parallel", "expert_parallel"):
        name = "--" + flag.replace("_", "-")
        check_flag(name, getattr(args, flag, None), MAX_DEVICES, "devices")
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise InputError(f"{name} {value}: give a degree of at least 1")


def load_profile_arg(path: str | None) -> Profile:
    if path is None:
        text = resources.files("planner").joinpath("data", DEFAULT_PROFILE).read_text(encoding="utf-8")
        result: Profile = parse_document("profile", loads_strict(text), source=DEFAULT_PROFILE)
        return result
    loaded: Profile = load_document("profile", path)
    return loaded


def default_device_type(profile: Profile) -> str | None:
    """The preset a profile was measured (or synthesized) on, if any."""
    kind = profile.measured_on.device
    if kind.startswith("synthetic:"):
        return kind.split(":", 1)[1]
    if kind == "cpu":
        return "cpu"
    return None


def cluster_from_args(args: argparse.Namespace, profile: Profile | None) -> Cluster:
    if args.cluster:
        if any(getattr(args, f) is not None for f in ("devices", "memory", "device_type", "speeds", "memories")):
            raise InputError("give either --cluster FILE or the --devices/--memory/... flags, not both")
        loaded: Cluster = load_document("cluster", args.cluster)
        return loaded
    check_cluster_flags(args)
    data: dict[str, Any] = {}
    memories = _split(args.memories)
    speeds = _split(args.speeds)
    for label, values in (("--memories", memories), ("--speeds", speeds)):
        if values is not None:
            check_flag(label, len(values), MAX_DEVICES, "devices")
    count = args.devices
    if count is None:
        count = len(memories or speeds or []) or None
    if count is None:
        raise InputError("say how many devices: --devices N (or --cluster FILE)")
    for label, values in (("--memories", memories), ("--speeds", speeds)):
        if values is not None and len(values) != count:
            raise InputError(f"{label} lists {len(values)} values for {count} devices: give one per device")
    device_type = args.device_type
    if device_type is None and args.memory is None and memories is None and profile is not None:
        device_type = default_device_type(profile)
    if device_type is None and args.memory is None and memories is None:
        raise InputError(
            f"profile measured on {profile.measured_on.device if profile else '?'!r}: say how much memory "
            "each device has with --memory 80GiB or --device-type h100-80g"
        )
    if device_type is not None:
        data["device_type"] = device_type
    if memories is not None or speeds is not None:
        from planner.presets import DEVICES

        default_mem = args.memory or (DEVICES[device_type].memory_bytes if device_type in DEVICES else None)
        data["devices"] = [
            {
                "name": f"device{i}",
                "memory_bytes": memories[i] if memories else default_mem,
                "speed": float(speeds[i]) if speeds else 1.0,
            }
            for i in range(count)
        ]
    else:
        data["devices"] = count
        if args.memory is not None:
            data["memory"] = args.memory
    if args.devices_per_node is not None:
        data["devices_per_node"] = args.devices_per_node
    if args.interconnect is not None:
        data["intra_node"] = args.interconnect
    if args.inter_node is not None:
        data["inter_node"] = args.inter_node
    result: Cluster = parse_document("cluster", data, source="(from the command line)")
    if profile is not None and profile.calibration is not None:
        # links pipeplan calibrate measured, for devices of the kind the runs used, unless given
        from planner.calibrate import calibrated_cluster

        keep = [name for name, flag in (("intra_node", args.interconnect), ("inter_node", args.inter_node)) if flag is None]
        result = calibrated_cluster(result, profile, links=keep)
    return result


def training_from_args(args: argparse.Namespace) -> TrainingSetup:
    if args.training:
        if any(getattr(args, f, None) is not None
               for f in ("batch_size", "optimizer", "fused_optimizer", "memory_margin", "dtype")):
            raise InputError(
                "give either --training FILE or --batch-size/--optimizer/--fused-optimizer/--memory-margin/--dtype, "
                "not both"
            )
        loaded: TrainingSetup = load_document("training", args.training)
        return loaded
    check_flag("--batch-size", args.batch_size, MAX_GLOBAL_BATCH, "samples per step")
    data: dict[str, Any] = {}
    if args.batch_size is not None:
        data["global_batch_size"] = args.batch_size
    if args.optimizer is not None:
        data["optimizer"] = args.optimizer
    if getattr(args, "fused_optimizer", None):
        data["fused_optimizer"] = True
    if args.memory_margin is not None:
        data["memory_margin"] = args.memory_margin
    if args.dtype is not None:
        data["dtype"] = args.dtype
    result: TrainingSetup = parse_document("training", data, source="(from the command line)")
    return result


def parse_stages(text: str) -> int | list[StageRange]:
    """``"4"`` is a stage count; ``"0:10,10:24,24:40"`` are explicit ``[start, stop)`` ranges."""
    text = text.strip()
    if text.isdigit():
        try:
            count = int(text)
        except ValueError:
            raise InputError(f"cannot read --stages {text[:40]!r}: write a count (4) or ranges like 0:10,10:24") from None
        check_flag("--stages", count, MAX_DEVICES, "stages")
        return count
    ranges = []
    parts = text.split(",")
    check_flag("--stages", len(parts), MAX_LAYERS, "stage ranges")
    for part in parts:
        try:
            start, stop = part.split(":")
            ranges.append(StageRange(start=int(start), stop=int(stop)))
        except ValueError:
            raise InputError(
                f"cannot read stage {part!r} in --stages {text!r}: write a count (4) or ranges like 0:10,10:24"
            ) from None
    return ranges


def parse_bools(text: str) -> list[bool]:
    """``"0,1,0"`` -> ``[False, True, False]``."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("1", "true", "yes", "y"):
            out.append(True)
        elif part in ("0", "false", "no", "n"):
            out.append(False)
        else:
            raise InputError(f"cannot read {part!r} as on/off in {text!r}: write 0 or 1 per stage, e.g. 0,1,1,0")
    return out


def schedule_choices() -> tuple[str, ...]:
    return SCHEDULES


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [x.strip() for x in text.split(",") if x.strip()]
