"""Device, interconnect and optimizer presets, with their sources.

All tables are read-only mappings (no module-level mutable state).  Bandwidths are
per direction, in bytes per second; latencies in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

GiB = 2**30
MiB = 2**20

#: memory a CUDA training process holds outside PyTorch's caching allocator (A100 and H100 alike),
#: the sum of two published measurements:
#: * the CUDA context with lazy module loading (CUDA >= 11.7): "the currently used ~300MB",
#:   P. Bialecki (NVIDIA), pytorch/pytorch#107667 (2023); 300-700 MB before lazy loading,
#:   pytorch/pytorch#28113, #20532;
#: * NCCL's buffers: 544 MB for a 2-GPU and 688 MB for a larger process group on A100 with NVLink,
#:   measured with PyTorch, NVIDIA/nccl#964 (2023); NCCL's maintainer: memory grows with the
#:   channels (more for H100's NVLink) and with more communicators unless split with shared
#:   resources (NVIDIA/nccl#864, #986).  A Megatron rank has tensor-, pipeline- and data-parallel
#:   communicators, split from one; we count one group's buffers, 700 MB.
CUDA_CONTEXT_BYTES = 300 * MiB + 700 * MiB
#: the caching allocator's fragmentation, as a share of its reserved memory.  Published range:
#: GMLake (Guo et al., ASPLOS 2024, arXiv 2401.08156), stitching PyTorch's fragments on eight LLMs
#: trained on A100-80GB with recompute, ZeRO and offloading, cuts fragmentation by 15 % on average
#: (up to 33 %) and saves 9.2 GB on average (up to 25 GB) of the default allocator's reserved
#: memory; STWeaver (Huang et al. 2025, arXiv 2507.16274): the default allocator wastes up to 43 %
#: with virtual pipelines and recompute.  Expandable segments (PyTorch >= 2.1, pytorch/pytorch#96995), which the
#: large-model trainers enable, remove most of it.  5 % is an assumption inside that range, not a
#: measurement; override it in a cluster file (``"fragmentation"``) where a run measured its own
#: (``torch.cuda.memory_reserved`` / ``memory_allocated``).
ALLOCATOR_FRAGMENTATION = 0.05


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
    #: network interfaces per node (each of ``inter_node``'s bandwidth)
    nics_per_node: int = 1
    # Facts the device model (planner/cost/compute.py) needs for shape effects.  The defaults
    # (one SM, 1x1 tiles, no overheads) switch every shape effect off: a device without them
    # is priced by peak x efficiency alone.
    #: streaming multiprocessors: thread blocks (GEMM tiles) that run at once, one wave
    sm_count: int = 1
    #: output tile (rows, columns) of the GEMM kernel cuBLAS picks for large 16-bit products
    gemm_tile: tuple[int, int] = (1, 1)
    #: a GEMM kernel's pipeline fill and epilogue, in units of the inner dimension k: a product
    #: of inner size k runs at k / (k + gemm_k_overhead) of the large-k rate (its k-tile x stages)
    gemm_k_overhead: int = 0
    #: query rows per thread block of the fused (flash) attention kernel
    attention_block: int = 1
    #: fused attention's efficiency as a fraction of the GEMM efficiency: (forward, backward)
    attention_fraction: tuple[float, float] = (1.0, 1.0)
    #: the shortest time one kernel (or one CPU operator) occupies the device, in seconds
    launch_floor_s: float = 0.0
    # Memory the framework's allocator never hands to tensors (planner/cost/memory.py,
    # ``usable_bytes``).  0 and 0.0 (a CPU process: its plans are measured truth) switch both off.
    #: bytes each process holds outside the caching allocator: the CUDA context (driver, loaded
    #: kernels) and the communication libraries' buffers (NCCL channels, cuBLAS workspaces)
    cuda_context_bytes: int = 0
    #: the caching allocator's fragmentation: the share of its reserved memory no tensor uses
    #: (reserved = allocated / (1 - this))
    allocator_fragmentation: float = 0.0


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
        # the H800's export-limited NVLink as DeepSeek measured it: "NVLink offers a bandwidth of
        # 160 GB/s, roughly 3.2 times that of IB (50 GB/s)" (DeepSeek-AI, DeepSeek-V3 Technical
        # Report, arXiv:2412.19437, 2024, sec. 3.2.2): achieved, so no further derating
        "nvlink-h800": InterconnectPreset(160e9, 3e-6, "DeepSeek-V3 Technical Report (2024), sec. 3.2.2: 160 GB/s achieved"),
        "ib-hdr": InterconnectPreset(25e9 * 0.9, 5e-6, "InfiniBand Trade Association roadmap, HDR 200 Gb/s"),
        # InfiniBand NDR: 400 Gb/s per port = 50 GB/s (IBTA roadmap; NVIDIA ConnectX-7).
        "ib-ndr": InterconnectPreset(50e9 * 0.9, 5e-6, "InfiniBand Trade Association roadmap, NDR 400 Gb/s"),
        # gloo over TCP loopback between processes on one host (order of magnitude measured with
        # torch.distributed send/recv on a 2-core CI machine).
        "loopback": InterconnectPreset(2e9, 100e-6, "measured: gloo send/recv over loopback, 2-core host"),
    }
)

#: the device model's shape facts of the GA100 chip (A100 40 GB and 80 GB), with their sources
_GA100_SHAPES: Mapping[str, Any] = MappingProxyType(
    dict(
        sm_count=108,  # NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs
        # cuBLAS's large bf16 kernels on sm80, e.g. ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_
        # stages_64x3_tn (kernel names in PyTorch-profiler / Nsight traces); NVIDIA, "Matrix
        # Multiplication Background User's Guide" (DU-09799-001, 2023), sec. 2.3: 128x128 and
        # 256x128 are the typical cuBLAS tiles
        gemm_tile=(128, 128),
        gemm_k_overhead=192,  # that kernel's k-tile x stages: 64 x 3
        # FlashAttention-2 (Dao 2023): kBlockM = 128 query rows per thread block, head_dim <= 128
        attention_block=128,
        # FlashAttention-2 (Dao 2023) reaches 50-73% of A100 peak forward, less backward; at the
        # default GEMM efficiency (0.88, planner/cost/compute.py) 0.75 x 0.88 = 66% forward and
        # 0.6 x 0.88 = 53% backward
        attention_fraction=(0.75, 0.6),
        # NVIDIA Technical Blog, "Getting Started with CUDA Graphs" (A. Gray, 2019): about 4 us
        # per short kernel launched back to back in a stream; rounded up for PyTorch's dispatch
        launch_floor_s=5e-6,
    )
)
#: what a CUDA GPU's training process holds outside its tensors (the same on every preset GPU)
_CUDA_MEMORY: Mapping[str, Any] = MappingProxyType(
    dict(cuda_context_bytes=CUDA_CONTEXT_BYTES, allocator_fragmentation=ALLOCATOR_FRAGMENTATION)
)
#: the same of the GH100 chip (H100 SXM5; the H200 is the same chip with more, faster memory:
#: NVIDIA H200 datasheet, 2024)
_GH100_SHAPES: Mapping[str, Any] = MappingProxyType(
    dict(
        sm_count=132,  # NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs (SXM5)
        # cuBLAS's large 16-bit kernels on sm90: sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_
        # tilesize256x128x64_warpgroupsize2x1x1_... and ..._f16f16_..._tilesize128x256x64_... (kernel
        # names in Nsight traces); 128 x 256 outputs per thread block either way
        gemm_tile=(128, 256),
        # that kernel's k-tile x stages: 64 x 4 (a (128 + 256) x 64 bf16 stage is 48 KiB; four
        # fit the 228 KiB of shared memory per SM)
        gemm_k_overhead=256,
        attention_block=128,  # FlashAttention-2 (Dao 2023): kBlockM = 128, head_dim <= 128
        # PyTorch's flash SDPA backend is FlashAttention-2, which is not Hopper-tuned:
        # FlashAttention-3 (Shah et al. 2024) measures it at about 35% of H100 peak forward and
        # less backward; at the default GEMM efficiency (0.78): 0.5 x 0.78 = 39%, 0.42 x 0.78 = 33%
        attention_fraction=(0.5, 0.42),
        launch_floor_s=5e-6,  # as the A100 (Gray 2019, "Getting Started with CUDA Graphs")
    )
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
            # measured: torch.mm / torch.add on 1-element tensors, torch 2.13 CPU build, the 2-core
            # CI host: 1.2-1.9 us per operator (the dispatcher's overhead)
            launch_floor_s=2e-6,
        ),
        "a100-40g": DevicePreset(
            40 * GiB,
            MappingProxyType({"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12}),
            1555e9,
            8,
            "nvlink3",
            "ib-hdr",
            "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 40GB",
            nics_per_node=8,  # DGX A100: 8 single-port HDR ConnectX-6 for the compute fabric
            **_GA100_SHAPES,
            **_CUDA_MEMORY,
        ),
        "a100-80g": DevicePreset(
            80 * GiB,
            MappingProxyType({"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12}),
            2039e9,
            8,
            "nvlink3",
            "ib-hdr",
            "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 80GB",
            # DGX A100 / Selene: 8 HDR InfiniBand per node (Narayanan et al. SC'21, section 5)
            nics_per_node=8,
            **_GA100_SHAPES,  # the same GA100 chip as the 40 GB
            **_CUDA_MEMORY,
        ),
        "h100-80g": DevicePreset(
            80 * GiB,
            MappingProxyType({"float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12}),
            3350e9,
            8,
            "nvlink4",
            "ib-ndr",
            "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5 80GB, dense",
            # DGX H100: 8 ConnectX-7 400 Gb/s for the compute fabric (Llama 3: 400 Gb/s per GPU)
            nics_per_node=8,
            **_GH100_SHAPES,
            **_CUDA_MEMORY,
        ),
        "h200-141g": DevicePreset(
            141 * 10**9,
            MappingProxyType({"float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12}),
            4800e9,
            8,
            "nvlink4",
            "ib-ndr",
            "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM 141GB, dense",
            nics_per_node=8,  # HGX H200: 8 ConnectX-7 400 Gb/s, as DGX H100
            **_GH100_SHAPES,  # the H100's GH100 chip
            **_CUDA_MEMORY,
        ),
        "h800-80g": DevicePreset(
            80 * GiB,
            MappingProxyType({"float32": 67e12, "tfloat32": 494.5e12, "bfloat16": 989.5e12, "float16": 989.5e12}),
            3350e9,
            8,
            "nvlink-h800",
            "ib-ndr",
            "NVIDIA H800 Tensor Core GPU datasheet (2023), SXM5 80GB, dense (the H100's compute, NVLink cut to "
            "400 GB/s); links as DeepSeek-V3's cluster (arXiv:2412.19437, sec. 3.1-3.2)",
            # DeepSeek-V3's nodes: 8 GPUs, one 400 Gb/s InfiniBand NIC each (sec. 3.2.2: IB 50 GB/s)
            nics_per_node=8,
            **_GH100_SHAPES,  # the GH100 chip
            **_CUDA_MEMORY,
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


# What the optimizer step allocates while it runs, per parameter byte of the rank's optimizer
# shard (its temporaries; the state above is held).  torch's foreach kernels, its default on
# GPUs: Adam and AdamW take the square root of every second moment at once
# (``torch._foreach_sqrt(exp_avg_sqs)`` in ``torch/optim/adam.py``'s ``_multi_tensor_adam``), one
# float32 temporary per parameter (4 bytes per 2-byte parameter of a -mixed preset); SGD updates
# in place.  Measured with ``torch.distributed._tools.MemTracker`` on torch 2.13: foreach Adam
# peaks at 5.0x the float32 parameter bytes during ``step()`` against 4.0x held, fused Adam
# (``fused=True``; apex's and Transformer Engine's FusedAdam likewise) at 4.0x, SGD with and
# without momentum allocates nothing (``tests/runtime/test_optimizer_memory.py`` checks these
# against torch).  ``TrainingSetup.fused_optimizer`` sets it to 0.
OPTIMIZER_STEP_TEMPORARIES: Mapping[str, float] = MappingProxyType(
    {
        "sgd": 0.0,
        "sgd-momentum": 0.0,
        "adam": 1.0,
        "adamw": 1.0,
        "sgd-mixed": 0.0,
        "sgd-momentum-mixed": 0.0,
        "adam-mixed": 2.0,
        "adamw-mixed": 2.0,
    }
)


def unknown_preset(kind: str, name: str, known: Mapping[str, object]) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}: choose one of {', '.join(sorted(known))}")
