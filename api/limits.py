"""Size limits on what a request may ask the planner to do."""

from __future__ import annotations

from api.settings import ApiSettings
from planner.errors import InputError
from planner.schema import Cluster, Profile


def check_limits(
    settings: ApiSettings, profile: Profile, cluster: Cluster, *, num_microbatches: int | None = None
) -> None:
    """Raise :class:`InputError` (422) when the request is larger than the server allows."""
    if profile.num_layers > settings.max_layers:
        raise InputError(
            f"the profile has {profile.num_layers} layers but this server plans at most "
            f"{settings.max_layers}: merge layers into blocks, or raise PIPEPLAN_MAX_LAYERS",
            [{"loc": "body.profile.layers", "msg": f"at most {settings.max_layers} layers", "input": profile.num_layers}],
        )
    if cluster.num_devices > settings.max_devices:
        raise InputError(
            f"the cluster has {cluster.num_devices} devices but this server plans for at most "
            f"{settings.max_devices}: plan one data-parallel group, or raise PIPEPLAN_MAX_DEVICES",
            [{"loc": "body.cluster.devices", "msg": f"at most {settings.max_devices} devices", "input": cluster.num_devices}],
        )
    if num_microbatches is not None and num_microbatches > settings.max_microbatches:
        raise InputError(
            f"num_microbatches={num_microbatches} is more than this server simulates "
            f"({settings.max_microbatches}): use fewer, larger micro-batches, or raise PIPEPLAN_MAX_MICROBATCHES",
            [{"loc": "body.num_microbatches", "msg": f"at most {settings.max_microbatches}", "input": num_microbatches}],
        )
