"""planner.limits: the ceilings' messages, strict JSON, the pre-checks on parsed documents."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.errors import InputError
from planner.limits import (
    MAX_DEVICES,
    check_cluster_data,
    check_profile_data,
    json_depth_exceeds,
    loads_strict,
    too_large,
)
from planner.schema import Cluster, parse_document


@pytest.mark.parametrize(
    ("value", "limit", "guess"),
    [(20_000_000, 16_384, "2,000"), (10**9, 4096, "1,000"), (16_385, 16_384, None), (12_345_678, 4096, None)],
)
def test_suggestion_drops_extra_zeros(value: int, limit: int, guess: str | None) -> None:
    text = too_large("devices", value, limit, suggest=True)
    assert text.startswith(f"{value:,} devices is beyond what pipeplan plans (at most {limit:,})")
    assert (f"did you mean {guess}?" in text) if guess else ("did you mean" not in text)


@pytest.mark.parametrize(
    ("text", "loc", "shown"),
    [
        ('{"a": [1, NaN]}', "a[1]", "NaN"),
        ('{"a": {"b": Infinity}}', "a.b", "Infinity"),
        ('[-Infinity]', "[0]", "-Infinity"),
        ('{"x": 1e999}', "x", "1e999"),
        ('{"x": -2.5E+400}', "x", "-2.5E+400"),
        ('{"x": 1' + "1" * 400 + '.0}', "x", None),
    ],
)
def test_non_finite_numbers_are_named(text: str, loc: str, shown: str | None) -> None:
    with pytest.raises(InputError, match="JSON has no NaN or Infinity") as err:
        loads_strict(text)
    assert err.value.errors[0]["loc"] == loc
    if shown is not None:
        assert err.value.errors[0]["input"] == shown


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4)))
def test_strict_reading_agrees_with_json_on_finite_documents(doc: object) -> None:
    text = json.dumps(doc)
    assert loads_strict(text) == json.loads(text)
    assert loads_strict(text.encode()) == json.loads(text)


def test_deep_nesting_and_long_integers_are_clear_errors() -> None:
    with pytest.raises(InputError, match="nested too deeply"):
        loads_strict("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputError, match="cannot read"):
        loads_strict("1" * 5000)
    assert json_depth_exceeds({"a": [[{}]]}, 3) and not json_depth_exceeds({"a": [[{}]]}, 4)


def test_cluster_count_is_checked_before_expansion() -> None:
    with pytest.raises(InputError, match="did you mean 10,000"):
        parse_document("cluster", {"devices": 10**9, "memory": "1GiB"})
    with pytest.raises(InputError, match=r"100,000 devices is beyond"):
        check_cluster_data({"devices": [{}] * 100_000})
    cluster = Cluster.model_validate({"devices": MAX_DEVICES, "memory": "1GiB"})
    assert cluster.num_devices == MAX_DEVICES
    assert len({id(d) for d in cluster.devices}) == 1  # one shared device, not N objects


def test_profile_precheck() -> None:
    with pytest.raises(InputError, match="5 layers is beyond what this server plans"):
        check_profile_data({"layers": [{}] * 5}, max_layers=4, by="this server plans")
    with pytest.raises(InputError, match=r"layers\[1\].forward_ms holds 1e\+300 ms"):
        check_profile_data({"layers": [{}, {"forward_ms": [1, 1e300]}]})
    with pytest.raises(InputError, match=r"layers\[0\].param_bytes holds a 151-digit number of bytes"):
        check_profile_data({"layers": [{"param_bytes": 10**150}]})
    check_profile_data({"layers": [{"param_bytes": 2**62, "activation_bytes": [2**62]}]})
    with pytest.raises(InputError, match="metadata nests deeper"):
        check_profile_data({"metadata": json.loads('{"a":' * 40 + "1" + "}" * 40)})
    check_profile_data({"layers": [{"forward_ms": ["x", 1]}], "metadata": "wrong type"})  # left to validation
