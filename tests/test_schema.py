"""The contracts: validation, shorthands, error messages naming field path and value."""

from __future__ import annotations

import copy
import json
import math

import pytest

from planner.errors import InputError
from planner.presets import DEVICES, INTERCONNECTS, OPTIMIZERS
from planner.schema import (
    Cluster,
    Plan,
    Profile,
    TrainingSetup,
    check_coverage,
    json_schema,
    load_document,
    parse_document,
    structure_sha256,
)
from planner.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 2**30), ("141GB", 141 * 10**9), ("512 MiB", 512 * 2**20), ("1.5kB", 1500), (1024, 1024), ("7", 7)],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["80 gigs", "", "-1GiB", -5, float("nan")])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(100) == "100 B"


def test_profile_roundtrip(tiny_profile: Profile) -> None:
    again = parse_document("profile", json.loads(tiny_profile.model_dump_json()))
    assert again == tiny_profile
    assert again.sha256() == tiny_profile.sha256()


def test_sha_depends_on_structure_not_timings(tiny_profile_dict: dict) -> None:
    a = parse_document("profile", tiny_profile_dict)
    slower = copy.deepcopy(tiny_profile_dict)
    slower["layers"][0]["forward_ms"] = [x * 2 for x in slower["layers"][0]["forward_ms"]]
    assert parse_document("profile", slower).sha256() == a.sha256()
    renamed = copy.deepcopy(tiny_profile_dict)
    renamed["layers"][0]["name"] = "embedding"
    assert parse_document("profile", renamed).sha256() != a.sha256()
    assert a.sha256() == structure_sha256(a.layer_names(), [layer.param_bytes for layer in a.layers])


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [
        (lambda d: d["layers"][2].pop("forward_ms"), "layers[2].forward_ms", "Field required"),
        (lambda d: d["layers"][1]["backward_ms"].__setitem__(0, -1.0), "layers[1].backward_ms[0]", "-1.0"),
        (lambda d: d["layers"][1]["backward_ms"].__setitem__(0, math.nan), "layers[1].backward_ms[0]", "NaN"),
        (lambda d: d["layers"][3]["activation_bytes"].pop(), "layers[3].activation_bytes", "has 2 entries"),
        (lambda d: d.__setitem__("microbatch_sizes", [1, 4, 2]), "microbatch_sizes", "strictly increasing"),
        (lambda d: d["layers"][4].__setitem__("name", "blocks.0"), "layers[4].name", "used twice"),
        (lambda d: d.__setitem__("layers", []), "layers", "at least 1"),
        (lambda d: d["layers"][0].__setitem__("param_bytes", "lots"), "layers[0].param_bytes", "lots"),
    ],
)
def test_bad_profile_names_field_and_value(tiny_profile_dict: dict, mutate, path: str, fragment: str) -> None:  # type: ignore[no-untyped-def]
    mutate(tiny_profile_dict)
    with pytest.raises(InputError) as info:
        parse_document("profile", tiny_profile_dict)
    message = str(info.value)
    assert path.split(".")[0] in message
    assert fragment in message
    assert info.value.errors, "machine-readable errors are attached"


def test_unknown_schema_version(tiny_profile_dict: dict) -> None:
    tiny_profile_dict["schema_version"] = 7
    with pytest.raises(InputError, match="schema_version 7 is not supported"):
        parse_document("profile", tiny_profile_dict)


def test_load_document_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InputError, match="does not exist"):
        load_document("profile", str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON.*line 1"):
        load_document("profile", str(bad))


def test_cluster_shorthands() -> None:
    c = parse_document("cluster", {"devices": 8, "device_type": "h100-80g"})
    assert c.num_devices == 8 and c.devices_per_node == 8
    assert c.devices[0].memory_bytes == DEVICES["h100-80g"].memory_bytes
    assert c.intra_node.bandwidth_bytes_per_s == INTERCONNECTS["nvlink4"].bandwidth_bytes_per_s
    m = parse_document("cluster", {"devices": 4, "memory": "141GB", "devices_per_node": 2, "inter_node": "ib-ndr"})
    assert m.devices[3].memory_bytes == 141 * 10**9
    assert m.same_node(0, 1) and not m.same_node(1, 2)
    assert m.link(1, 2) == m.inter_node and m.link(0, 1) == m.intra_node
    full = parse_document("cluster", json.loads(m.model_dump_json()))
    assert full == m


def test_cluster_heterogeneous_list() -> None:
    c = parse_document(
        "cluster",
        {"devices": [{"memory_bytes": "80GiB"}, {"memory_bytes": "40GiB", "speed": 0.5}], "intra_node": "pcie5"},
    )
    assert not c.homogeneous
    assert c.devices[1].speed == 0.5


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"devices": 4}, "needs a memory size"),
        ({"devices": 4, "device_type": "tpu-v9"}, "unknown device_type 'tpu-v9'"),
        ({"devices": 0, "memory": "1GiB"}, "devices must be >= 1"),
        ({"devices": 2, "memory": "1GiB", "intra_node": "carrier-pigeon"}, "unknown interconnect"),
        ({"devices": [{"memory_bytes": "1GiB", "speed": 0}]}, "devices[0].speed"),
    ],
)
def test_bad_cluster(data: dict, fragment: str) -> None:
    with pytest.raises(InputError) as info:
        parse_document("cluster", data)
    assert fragment in str(info.value)


def test_training_presets() -> None:
    assert TrainingSetup().optimizer_state_factor == OPTIMIZERS["adam"]
    assert TrainingSetup(optimizer="sgd").optimizer_state_factor == 0
    custom = TrainingSetup(optimizer="lion", optimizer_state_bytes_per_param_byte=1.0)
    assert custom.optimizer_state_factor == 1.0
    with pytest.raises(InputError, match="unknown optimizer 'lion'"):
        parse_document("training", {"optimizer": "lion"})
    with pytest.raises(InputError, match="memory_margin"):
        parse_document("training", {"memory_margin": 1.5})


def test_check_coverage() -> None:
    check_coverage([(0, 3), (3, 8)], 8)
    with pytest.raises(ValueError, match="leaves layers 3:4 in no stage"):
        check_coverage([(0, 3), (4, 8)], 8)
    with pytest.raises(ValueError, match="overlaps"):
        check_coverage([(0, 3), (2, 8)], 8)
    with pytest.raises(ValueError, match="model has 9 layers"):
        check_coverage([(0, 3), (3, 8)], 9)
    with pytest.raises(ValueError, match="stop must be greater"):
        check_coverage([(0, 0), (0, 8)], 8)


def _plan_dict(tiny_profile: Profile) -> dict:
    from planner.cost import Layout, estimate

    cluster = Cluster.model_validate({"devices": 2, "memory": "1GiB"})
    plan = estimate(
        tiny_profile, cluster, TrainingSetup(global_batch_size=8),
        Layout(
            [(0, 4), (4, 8)],
            num_microbatches=4,
        ),
    )
    return json.loads(plan.model_dump_json())


def test_plan_roundtrip_and_validation(tiny_profile: Profile) -> None:
    d = _plan_dict(tiny_profile)
    assert Plan.model_validate(d).stages[1].layer_names[-1] == "head"
    bad = copy.deepcopy(d)
    bad["stages"][1]["start"] = 5
    with pytest.raises(InputError, match="leaves layers 4:5 in no stage"):
        parse_document("plan", bad)
    bad = copy.deepcopy(d)
    bad["num_microbatches"] = 3
    with pytest.raises(InputError, match="global_batch_size is 8"):
        parse_document("plan", bad)
    bad = copy.deepcopy(d)
    bad["schedule"] = "zero-bubble"
    with pytest.raises(InputError, match="schedule"):
        parse_document("plan", bad)


@pytest.mark.parametrize("kind", ["profile", "cluster", "training", "plan", "options"])
def test_json_schema_exports(kind: str) -> None:
    schema = json_schema(kind)
    assert schema["type"] == "object"
    assert schema["properties"]
