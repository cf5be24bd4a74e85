"""The axes of a plan's device mesh and the ``DeviceMesh`` made of them (part of
:mod:`runtime.mesh`).

Axes, ordered like torchtitan's: ``("pp", "dp_replicate", "dp_shard", "tp")`` (:data:`MESH_AXES`);
row-major, so the tensor-parallel ranks of one stage replica are consecutive (one host) and the
pipeline axis is outermost.  ZeRO 0 and 1 put the plan's D on ``dp_replicate``, ZeRO 2 and 3 on
``dp_shard``.  :class:`MeshSpec` computes the coordinates without torch; :func:`build_mesh` makes
the ``DeviceMesh``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.errors import InputError

#: mesh dimension names, outermost first (torchtitan's order)
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


#: schedules that split the backward into input- and weight-gradient parts: FSDP2 must not
#: reshard after the forward under them (the weight-gradient step needs the parameters)
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb-h1", "zb-h2", "zbv", "dualpipev", "interleaved-zb", "planned"})


@dataclass(frozen=True)
class MeshSpec:
    """The mesh axes of a plan (``planner.schema.Plan`` or any object with its fields)."""

    pipeline_degree: int = 1
    data_parallel_degree: int = 1
    tensor_parallel_degree: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"

    @staticmethod
    def of(plan: Any) -> MeshSpec:
        """The plan's mesh; context parallelism (C > 1, :mod:`runtime.context_parallel`) is
        folded into the data axis: ``D x C`` ranks, ``d * C + c``, whose gradients are averaged
        together as Megatron-LM averages over its data- and context-parallel ranks."""
        return MeshSpec(
            pipeline_degree=plan.pipeline_degree,
            data_parallel_degree=plan.data_parallel_degree * getattr(plan, "context_parallel_degree", 1),
            tensor_parallel_degree=getattr(plan, "tensor_parallel_degree", 1),
            zero_stage=getattr(plan, "zero_stage", 0),
            sequence_parallel=getattr(plan, "sequence_parallel", False),
            schedule=plan.schedule,
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Sizes of :data:`MESH_AXES`."""
        d = self.data_parallel_degree
        sharded = self.zero_stage >= 2
        return (self.pipeline_degree, 1 if sharded else d, d if sharded else 1, self.tensor_parallel_degree)

    @property
    def world_size(self) -> int:
        return self.pipeline_degree * self.data_parallel_degree * self.tensor_parallel_degree

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pipeline rank, data-parallel replica, tensor-parallel rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise InputError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        t_deg, d_deg = self.tensor_parallel_degree, self.data_parallel_degree
        return rank // (d_deg * t_deg), (rank // t_deg) % d_deg, rank % t_deg

    def rank_of(self, pp: int, replica: int, tp: int = 0) -> int:
        return (pp * self.data_parallel_degree + replica) * self.tensor_parallel_degree + tp

    def reshard_after_forward(self) -> bool:
        """FSDP2's policy: ZeRO 3 reshards after the forward, ZeRO 2 keeps the gathered
        parameters until the backward; never under a split-backward schedule."""
        return self.zero_stage == 3 and self.schedule not in SPLIT_BACKWARD_SCHEDULES


def build_mesh(spec: MeshSpec, *, device_type: str = "cpu") -> Any:
    """The ``DeviceMesh`` of ``spec`` over the default process group (its world size must be
    ``spec.world_size``), dimensions :data:`MESH_AXES`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world != spec.world_size:
        raise InputError(
            f"the plan's mesh needs {spec.world_size} ranks (K={spec.pipeline_degree} x "
            f"D={spec.data_parallel_degree} x T={spec.tensor_parallel_degree}) but the job has {world}"
        )
    return init_device_mesh(device_type, spec.shape, mesh_dim_names=MESH_AXES)


def data_mesh(mesh: Any, spec: MeshSpec) -> Any:
    """The 1-D mesh of the data-parallel axis (``dp_shard`` for ZeRO 2/3, else ``dp_replicate``)."""
    return mesh["dp_shard" if spec.zero_stage >= 2 else "dp_replicate"]
