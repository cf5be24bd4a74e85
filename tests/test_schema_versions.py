"""Profile and plan schema versions: what 2 and 3 added, and reading version-1 and -2 files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cost import Layout, estimate
from planner.errors import InputError
from planner.schema import SCHEMA_VERSION, Profile, load_document, parse_document

ROOT = Path(__file__).resolve().parents[1]


def _v1_profile() -> dict:
    return {
        "schema_version": 1,
        "model": "m",
        "measured_on": {"device": "cpu"},
        "microbatch_sizes": [1, 2],
        "layers": [
            {"name": n, "param_bytes": 8, "forward_ms": [1, 2], "backward_ms": [2, 4],
             "activation_bytes": [10, 20], "output_bytes": [4, 8]}
            for n in ("embed", "blocks.4", "head")
        ],
        "metadata": {"profiler": {"split_points": ["blocks.4", "head"]}},
    }


def test_version_1_profiles_are_migrated() -> None:
    assert SCHEMA_VERSION == 5
    prof = parse_document("profile", _v1_profile())
    assert prof.schema_version == 5 and prof.split_points == ["blocks.4", "head"]
    assert all(layer.kept_inputs is None for layer in prof.layers)
    again = parse_document("profile", json.loads(prof.model_dump_json()))
    assert again == prof
    # the API validates bodies with the class itself: the migration runs there too
    assert Profile.model_validate(_v1_profile()).split_points == ["blocks.4", "head"]
    bundled = load_document("profile", str(ROOT / "examples" / "profiles" / "tiny.json"))
    assert bundled.schema_version == 5


def test_unknown_versions_are_refused() -> None:
    data = dict(_v1_profile(), schema_version=6)
    with pytest.raises(InputError, match="schema_version 6 is not supported.*reads versions 1, 2, 3, 4, 5"):
        parse_document("profile", data)


def test_plans_record_the_split_points_and_read_version_1() -> None:
    prof = parse_document("profile", _v1_profile())
    cluster = parse_document("cluster", {"devices": 2, "memory": "1GiB"})
    training = parse_document("training", {"global_batch_size": 4})
    plan = estimate(prof, cluster, training, Layout([(0, 1), (1, 3)], num_microbatches=2))
    assert plan.split_points == ["blocks.4", "head"] and plan.schema_version == 5
    old = json.loads(plan.model_dump_json())
    old["schema_version"] = 1
    del old["split_points"]
    read = parse_document("plan", old)
    assert read.schema_version == 5 and read.split_points == []


def test_kept_inputs_are_checked() -> None:
    data = parse_document("profile", _v1_profile()).model_dump(mode="json")
    data["layers"][1]["kept_inputs"] = [{"offset": 0, "bytes": [5]}]
    with pytest.raises(InputError, match=r"layers\[1\].kept_inputs\[0\].bytes has 1 entries"):
        parse_document("profile", data)
    data["layers"][1]["kept_inputs"] = [{"offset": 2, "bytes": [5, 10]}]
    with pytest.raises(InputError, match="points past the last layer"):
        parse_document("profile", data)
    data["layers"][1]["kept_inputs"] = [{"offset": 1, "bytes": [5, -2]}]  # a slice: may be negative
    assert parse_document("profile", data).layers[1].kept_inputs[0].bytes == [5, -2]


def test_version_2_plans_and_profiles_read_as_replicated_d_by_k() -> None:
    """Version 3 added the mesh axes; a version-2 document means T = 1, ZeRO 0, no SP, and
    layers that do not shard."""
    prof = parse_document("profile", dict(_v1_profile(), schema_version=2, split_points=[]))
    assert prof.schema_version == 5 and not any(layer.shards for layer in prof.layers)
    cluster = parse_document("cluster", {"devices": 2, "memory": "1GiB"})
    training = parse_document("training", {"global_batch_size": 4})
    plan = estimate(prof, cluster, training, Layout([(0, 1), (1, 3)], num_microbatches=2))
    old = json.loads(plan.model_dump_json())
    old["schema_version"] = 2
    for key in ("tensor_parallel_degree", "zero_stage", "sequence_parallel"):
        del old[key]
    read = parse_document("plan", old)
    assert read.schema_version == 5
    assert (read.tensor_parallel_degree, read.zero_stage, read.sequence_parallel) == (1, 0, False)
    assert read.world_size == 2


def test_version_4_profiles_read_as_version_5_without_experts() -> None:
    data = json.loads((ROOT / "examples" / "profiles" / "tiny.json").read_text())
    data["schema_version"] = 4
    prof = parse_document("profile", data)
    assert prof.schema_version == 5 and all(layer.moe is None for layer in prof.layers)


def test_moe_marks_are_checked() -> None:
    from planner.schema import MoELayer

    ok = MoELayer(experts=8, top_k=2, expert_param_bytes=10, dispatch_bytes=[4])
    assert ok.routing == "balanced"
    with pytest.raises(ValueError, match="top_k 9 is more than the 8 experts"):
        MoELayer(experts=8, top_k=9, expert_param_bytes=10, dispatch_bytes=[4])
    with pytest.raises(ValueError, match="routing 'capacity' needs a capacity_factor"):
        MoELayer(experts=8, top_k=2, expert_param_bytes=10, dispatch_bytes=[4], routing="capacity")
    data = json.loads((ROOT / "examples" / "profiles" / "tiny.json").read_text())
    layer = data["layers"][1]
    n = len(data["microbatch_sizes"])
    layer["moe"] = {"experts": 4, "top_k": 1, "expert_param_bytes": layer["param_bytes"] + 1, "dispatch_bytes": [0] * n}
    with pytest.raises(InputError, match="expert_param_bytes .* is more than the layer's param_bytes"):
        parse_document("profile", data)
    layer["moe"]["dispatch_bytes"] = [0] * (n + 1)
    layer["moe"]["expert_param_bytes"] = 0
    with pytest.raises(InputError, match="moe.dispatch_bytes has"):
        parse_document("profile", data)
