"""A plan that does not fit the model or the job is refused, naming the mismatch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import PlanMismatchError
from planner.schema import LayerProfile, MeasuredOn, Profile, parse_document
from runtime.plan_check import check_optimizer_supported, check_plan_matches, plan_mismatches
from tests.runtime.helpers import make_plan


def _profile(names: list[str], params: list[int]) -> Profile:
    layers = [
        LayerProfile(name=n, param_bytes=p, forward_ms=[1.0], backward_ms=[2.0], activation_bytes=[8], output_bytes=[8])
        for n, p in zip(names, params, strict=True)
    ]
    return Profile(model="m", measured_on=MeasuredOn(device="cpu"), microbatch_sizes=[1], layers=layers)


NAMES = ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
PARAMS = [100, 200, 200, 200, 50]


@pytest.fixture()
def plan():  # type: ignore[no-untyped-def]
    return make_plan(_profile(NAMES, PARAMS), [(0, 2), (2, 5)])


def test_matching_plan_passes(plan) -> None:  # type: ignore[no-untyped-def]
    assert plan_mismatches(plan, layer_names=NAMES, param_bytes=PARAMS, world_size=2, optimizer="sgd") == []
    check_plan_matches(plan, layer_names=NAMES, param_bytes=PARAMS, world_size=2, optimizer="sgd")


def test_renamed_layer_is_named(plan) -> None:  # type: ignore[no-untyped-def]
    names = [*NAMES[:3], "blocks.X", NAMES[4]]
    with pytest.raises(PlanMismatchError) as err:
        check_plan_matches(plan, layer_names=names, param_bytes=PARAMS)
    text = str(err.value)
    assert "layer 3 is 'blocks.2' in the plan but 'blocks.X' in the model" in text
    assert "profile_sha256" in text and "pipeplan profile" in text


def test_missing_layer_is_named(plan) -> None:  # type: ignore[no-untyped-def]
    """Megatron-LM#1304: 28 layers built out of 30 must not pass silently."""
    with pytest.raises(PlanMismatchError) as err:
        check_plan_matches(plan, layer_names=NAMES[:4], param_bytes=PARAMS[:4])
    text = str(err.value)
    assert "the plan is for 5 layers but the model splits into 4" in text
    assert "'head'" in text or "head" in text


def test_changed_parameters_change_the_fingerprint(plan) -> None:  # type: ignore[no-untyped-def]
    params = [*PARAMS[:2], 999, *PARAMS[3:]]
    problems = plan_mismatches(plan, layer_names=NAMES, param_bytes=params)
    assert len(problems) == 1
    assert "fingerprint" in problems[0] and "stage 1: plan 450 B, model 1249 B" in problems[0]


def test_world_size_and_optimizer(plan) -> None:  # type: ignore[no-untyped-def]
    problems = plan_mismatches(plan, layer_names=NAMES, param_bytes=PARAMS, world_size=3, optimizer="adam")
    assert any("2 processes but the job has 3" in p for p in problems)
    assert any("--optimizer 'adam' does not match the plan's training optimizer 'sgd'" in p for p in problems)


def test_dtype_must_match_the_plan(plan) -> None:  # type: ignore[no-untyped-def]
    assert plan.training.dtype is None
    assert not plan_mismatches(plan, layer_names=NAMES, param_bytes=PARAMS, dtype="float32")
    (problem,) = plan_mismatches(plan, layer_names=NAMES, param_bytes=PARAMS, dtype="bfloat16")
    assert "--dtype bfloat16 does not match the dtype the plan was made for, float32" in problem
    assert "make the plan with --dtype bfloat16" in problem
    bf16 = plan.model_copy(update={"training": plan.training.model_copy(update={"dtype": "bfloat16"})})
    (problem,) = plan_mismatches(bf16, layer_names=NAMES, param_bytes=PARAMS, dtype="float32")
    assert "made for, bfloat16" in problem and "pass --dtype bfloat16" in problem


def test_unsupported_optimizer() -> None:
    with pytest.raises(PlanMismatchError, match="mixed precision.*--optimizer adam"):
        check_optimizer_supported("adam-mixed")
    check_optimizer_supported("sgd-momentum")


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=10_000), min_size=2, max_size=8),
    st.data(),
)
def test_any_single_change_is_refused(params: list[int], data: st.DataObject) -> None:
    names = [f"layer{i}" for i in range(len(params))]
    cut = data.draw(st.integers(min_value=1, max_value=len(params) - 1))
    plan = make_plan(_profile(names, params), [(0, cut), (cut, len(params))])
    assert plan_mismatches(plan, layer_names=names, param_bytes=params) == []
    i = data.draw(st.integers(min_value=0, max_value=len(params) - 1))
    kind = data.draw(st.sampled_from(["rename", "bytes", "drop", "add"]))
    n2, p2 = list(names), list(params)
    if kind == "rename":
        n2[i] = n2[i] + "_renamed"
    elif kind == "bytes":
        p2[i] += data.draw(st.integers(min_value=1, max_value=100))
    elif kind == "drop":
        del n2[i], p2[i]
    else:
        n2.insert(i, "extra")
        p2.insert(i, 1)
    problems = plan_mismatches(plan, layer_names=n2, param_bytes=p2)
    assert problems, f"{kind} at {i} went unnoticed"


def test_cluster_fixture_is_valid() -> None:
    cluster = parse_document("cluster", {"devices": 2, "device_type": "cpu"})
    assert cluster.num_devices == 2


def test_stage_range_inconsistent_with_its_names_is_named(plan) -> None:  # type: ignore[no-untyped-def]
    data = plan.model_dump()
    data["stages"][0]["stop"], data["stages"][1]["start"] = 3, 3  # names still say 0:2 / 2:5
    edited = type(plan).model_validate(data)
    problems = plan_mismatches(edited, layer_names=NAMES, param_bytes=PARAMS)
    assert any("stage 0 covers layers 0:3" in p and "embed, blocks.0" in p for p in problems), problems
