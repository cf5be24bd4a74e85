"""Device, interconnect and optimizer presets, with their sources.

All tables are read-only mappings (no module-level mutable state).  Bandwidths are
per direction, in bytes per second; latencies in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

GiB = 2**30


@dataclass(frozen=True)
class InterconnectPreset:
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str


@dataclass(frozen=True)
class DevicePreset:
    memory_bytes: int
    #: dense peak throughput in FLOP/s by dtype (used by ``pipeplan synth``)
    peak_flops: Mapping[str, float]
    #: memory bandwidth in bytes/s
    memory_bandwidth_bytes_per_s: float
    devices_per_node: int
    intra_node: str
    inter_node: str
    source: str


INTERCONNECTS: Mapping[str, InterconnectPreset] = MappingProxyType(
    {
        # PCI-SIG PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b -> 31.5 GB/s per direction.
        "pcie4": InterconnectPreset(31.5e9 * 0.8, 5e-6, "PCI-SIG PCIe 4.0 base spec, x16, 80% achievable"),
        # PCIe 5.0 x16: 32 GT/s x 16 lanes -> 63 GB/s per direction.
        "pcie5": InterconnectPreset(63e9 * 0.8, 5e-6, "PCI-SIG PCIe 5.0 base spec, x16, 80% achievable"),
        # NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s total (300 GB/s per direction).
        "nvlink3": InterconnectPreset(300e9 * 0.8, 3e-6, "NVIDIA A100 Tensor Core GPU datasheet (2021)"),
        # NVIDIA H100 datasheet: fourth-generation NVLink, 900 GB/s total (450 GB/s per direction).
        "nvlink4": InterconnectPreset(450e9 * 0.8, 3e-6, "NVIDIA H100 Tensor Core GPU datasheet (2023)"),
        # InfiniBand HDR: 200 Gb/s per port = 25 GB/s (IBTA roadmap; NVIDIA ConnectX-6).
        "ib-hdr": InterconnectPreset(25e9 * 0.9, 5e-6, "InfiniBand Trade Association roadmap, HDR 200 Gb/s"),
        # InfiniBand NDR: 400 Gb/s per port = 50 GB/s (IBTA roadmap; NVIDIA ConnectX-7).
        "ib-ndr": InterconnectPreset(50e9 * 0.9, 5e-6, "InfiniBand Trade Association roadmap, NDR 400 Gb/s"),
        # gloo over TCP loopback between processes on one host (order of magnitude measured with
        # torch.distributed send/recv on a 2-core CI machine).
        "loopback": InterconnectPreset(2e9, 100e-6, "measured: gloo send/recv over loopback, 2-core host"),
    }
)

DEVICES: Mapping[str, DevicePreset] = MappingProxyType(
    {
        # A CPU process: memory is what one rank may use on a small host; throughput of a few
        # AVX2 cores in float32.
        "cpu": DevicePreset(
            16 * GiB,
            MappingProxyType({"float32": 1e11, "bfloat16": 5e10, "float16": 5e10}),
            20e9,
            1,
            "loopback",
            "loopback",
            "nominal few-core AVX2 host; override memory with --memory",
        ),
        "a100-40g": DevicePreset(
            40 * GiB,
            MappingProxyType({"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12}),
            1555e9,
            8,
            "nvlink3",
            "ib-hdr",
            "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 40GB",
        ),
        "a100-80g": DevicePreset(
            80 * GiB,
            MappingProxyType({"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12}),
            2039e9,
            8,
            "nvlink3",
            "ib-hdr",
            "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 80GB",
        ),
        "h100-80g": DevicePreset(
            80 * GiB,
            MappingProxyType({"float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12}),
            3350e9,
            8,
            "nvlink4",
            "ib-ndr",
            "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5 80GB, dense",
        ),
        "h200-141g": DevicePreset(
            141 * 10**9,
            MappingProxyType({"float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12}),
            4800e9,
            8,
            "nvlink4",
            "ib-ndr",
            "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM 141GB, dense",
        ),
    }
)

# Optimizer state bytes per parameter byte.  Parameters are stored in the profile's dtype.
# Mixed-precision variants keep an fp32 master copy (4 bytes per 2-byte parameter = 2.0) plus
# fp32 states: the ZeRO paper's (Rajbhandari et al. 2020) K=12 bytes per parameter for Adam
# is 12 / 2 = 6.0 bytes of state per bf16 parameter byte.
OPTIMIZERS: Mapping[str, float] = MappingProxyType(
    {
        "sgd": 0.0,
        "sgd-momentum": 1.0,
        "adam": 2.0,
        "adamw": 2.0,
        "sgd-mixed": 2.0,
        "sgd-momentum-mixed": 4.0,
        "adam-mixed": 6.0,
        "adamw-mixed": 6.0,
    }
)


def unknown_preset(kind: str, name: str, known: Mapping[str, object]) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}: choose one of {', '.join(sorted(known))}")
