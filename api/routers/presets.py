"""``/v1/presets``: the device, interconnect and optimizer presets the planner knows."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.deps import require_token
from api.models import DevicePresetOut, InterconnectPresetOut, Presets
from planner.presets import DEVICES, INTERCONNECTS, OPTIMIZERS

router = APIRouter(prefix="/v1", tags=["presets"], dependencies=[Depends(require_token)])


@router.get("/presets", response_model=Presets, summary="device and interconnect presets")
async def get_presets() -> Presets:
    return Presets(
        devices={
            name: DevicePresetOut(
                memory_bytes=d.memory_bytes,
                peak_flops=dict(d.peak_flops),
                memory_bandwidth_bytes_per_s=d.memory_bandwidth_bytes_per_s,
                devices_per_node=d.devices_per_node,
                intra_node=d.intra_node,
                inter_node=d.inter_node,
                source=d.source,
            )
            for name, d in DEVICES.items()
        },
        interconnects={
            name: InterconnectPresetOut(
                bandwidth_bytes_per_s=i.bandwidth_bytes_per_s, latency_s=i.latency_s, source=i.source
            )
            for name, i in INTERCONNECTS.items()
        },
        optimizers=dict(OPTIMIZERS),
    )
