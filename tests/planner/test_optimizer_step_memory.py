"""The optimizer step's temporaries in a rank's peak (issue 28's "largest transient buffer").

torch's foreach Adam holds one float32 temporary the size of its parameters while it steps
(``planner.presets.OPTIMIZER_STEP_TEMPORARIES``; checked against torch itself in
``tests/runtime/test_optimizer_memory.py``).  The step runs after the last backward, when no
activation is held, so a rank's peak is its static bytes plus the larger of its walk's peak and
those temporaries.  Cases by hand, on the one-stage profile of ``tests/planner/test_mesh.py``:
an embedding of 400 parameter bytes and a block of 1,000, activations 100 + 800.
"""

from __future__ import annotations

import json

import pytest

from planner.cost import Layout, estimate
from planner.schema import PlanOptions, TrainingSetup, parse_document
from planner.solver import solve
from tests.planner.test_mesh import _cluster, _profile

PARAMS = 1400
ACTS = 100 + 800


def _training(**extra: object) -> TrainingSetup:
    return parse_document("training", {"global_batch_size": 2, "tensor_parallel_efficiency": 1.0, **extra})


def _one_stage(training: TrainingSetup, *, d: int = 1, zero: int = 0, profile: object = None) -> object:
    return estimate(
        profile or _profile(), _cluster(max(d, 1)), training,
        Layout([(0, 2)], num_microbatches=1 if d > 1 else 2, schedule="gpipe", data_parallel=d, zero_stage=zero),
    )


def test_adam_peaks_at_its_step_when_the_activations_are_smaller() -> None:
    # Adam: parameters + gradients + 2 moments = 4 x 1,400.  GPipe with two micro-batches holds
    # 2 x 900 = 1,800 of activations, more than the step's temporary of 1,400: the walk's peak
    plan = _one_stage(_training(optimizer="adam"))
    assert plan.stages[0].memory_bytes == 4 * PARAMS + 2 * ACTS
    assert plan.stages[0].memory_parts.optimizer_step == 0
    assert plan.stages[0].memory_parts.activations == 2 * ACTS
    # with one micro-batch of 900 in flight the step's 1,400 make the peak
    one = estimate(_profile(), _cluster(1), _training(optimizer="adam", global_batch_size=1),
                   Layout([(0, 2)], num_microbatches=1, schedule="gpipe"))
    assert one.stages[0].memory_bytes == 4 * PARAMS + PARAMS
    parts = one.stages[0].memory_parts
    assert (parts.activations, parts.optimizer_step) == (0, PARAMS)
    assert parts.parameters + parts.gradients + parts.optimizer + parts.optimizer_step == one.stages[0].memory_bytes


@pytest.mark.parametrize(("training", "step"), [
    ({"optimizer": "adam"}, 1.0),
    ({"optimizer": "adamw"}, 1.0),
    ({"optimizer": "adam-mixed"}, 2.0),  # a float32 temporary per 2-byte parameter
    ({"optimizer": "adam", "fused_optimizer": True}, 0.0),
    ({"optimizer": "sgd-momentum"}, 0.0),
    ({"optimizer": "sgd"}, 0.0),
    ({"optimizer": "adam", "fused_optimizer": True, "optimizer_step_bytes_per_param_byte": 0.5}, 0.5),
    ({"optimizer": "mine", "optimizer_state_bytes_per_param_byte": 1.0}, 0.0),  # no preset: none
])
def test_the_step_factor_of_each_optimizer(training: dict[str, object], step: float) -> None:
    t = _training(**training)
    assert t.optimizer_step_factor == step
    one = estimate(_profile(), _cluster(1), t.model_copy(update={"global_batch_size": 1}),
                   Layout([(0, 2)], num_microbatches=1, schedule="gpipe"))
    static = PARAMS * (1 + 1 + t.optimizer_state_factor)
    assert one.stages[0].memory_bytes == pytest.approx(static + max(ACTS, step * PARAMS), abs=1)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_shards_the_step_with_the_optimizer_state(zero: int) -> None:
    # D = 2, one micro-batch each; activations shrunk to 100 + 100 so the step makes the peak
    profile = _profile(activation_bytes=[100])
    plan = _one_stage(_training(optimizer="adam", zero_overlap=0.0), d=2, zero=zero, profile=profile)
    shard = PARAMS / 2 if zero >= 1 else PARAMS
    static = {0: 4.0, 1: 1 + 1 + 2 / 2, 2: 1 + 1 / 2 + 2 / 2, 3: 1 / 2 + 1 / 2 + 2 / 2}[zero] * PARAMS
    # ZeRO-3's gathered layers (the running and the prefetched one) are held through the walk
    # and freed before the step (FSDP2 reshards after the backward): the step reuses them
    gathered = 2 * 1000 if zero == 3 else 0
    assert plan.stages[0].memory_bytes == pytest.approx(static + max(200 + gathered, shard), abs=2)
    parts = plan.stages[0].memory_parts
    if zero < 3:
        assert parts.optimizer_step == pytest.approx(shard, abs=2)
        assert parts.activations == parts.gathered == 0
    else:  # 200 + 2,000 > the step's 700: the walk makes the peak, gathered layers and all
        assert (parts.optimizer_step, parts.activations, parts.gathered) == (0, 200, gathered)


@pytest.mark.parametrize("step_factor", [3.0, 4.0, 6.0])
def test_zero3_step_reuses_the_gathered_layers(step_factor: float) -> None:
    # a step of 700 x factor (2,100; 2,800; 4,200) against the walk's 200 + 2,000 gathered bytes:
    # the peak is the larger of the two, never their sum (which an upper bound once added)
    profile = _profile(activation_bytes=[100])
    training = _training(optimizer="adam", zero_overlap=0.0, optimizer_step_bytes_per_param_byte=step_factor)
    plan = _one_stage(training, d=2, zero=3, profile=profile)
    static, walk, step = (1 / 2 + 1 / 2 + 2 / 2) * PARAMS, 200 + 2000, step_factor * PARAMS / 2
    st = plan.stages[0]
    assert st.memory_bytes == pytest.approx(static + max(walk, step), abs=2)
    parts = st.memory_parts
    held = parts.parameters + parts.gradients + parts.optimizer + parts.activations + parts.optimizer_step
    assert held + parts.gathered == pytest.approx(st.memory_bytes, abs=3)
    assert (parts.optimizer_step > 0) == (step >= walk)
    assert parts.gathered == (0 if step >= walk else 2000)


def test_zero3_fits_where_walk_plus_gathered_and_the_step_each_fit() -> None:
    # a device between max(walk + gathered, step) and their old sum: ZeRO-3 at D = 2 fits it
    profile = _profile(activation_bytes=[100])
    training = _training(optimizer="adam", zero_overlap=0.0, optimizer_step_bytes_per_param_byte=6.0,
                         memory_margin=0.0)
    exact = _one_stage(training, d=2, zero=3, profile=profile).stages[0].memory_bytes
    limit = exact + 1000  # the sum would be exact + 2,000
    link = {"bandwidth_bytes_per_s": 1e9}
    cluster = parse_document("cluster", {"devices": 2, "memory": limit, "intra_node": link, "inter_node": link})
    plan = estimate(profile, cluster, training,
                    Layout([(0, 2)], num_microbatches=1, schedule="gpipe", data_parallel=2, zero_stage=3))
    assert plan.stages[0].memory_bytes == exact <= plan.stages[0].memory_limit_bytes


def test_the_step_decides_what_fits() -> None:
    # usable memory between the walk's peak and the step's: Adam's foreach step does not fit on
    # one device, the fused one does; on two such devices the solver finds a plan that fits with
    # the step (ZeRO-1 shards it, or two stages halve it)
    walk = 4 * PARAMS + ACTS  # 6,500
    step = 5 * PARAMS  # 7,000
    limit = (walk + step) // 2

    def cluster(n: int) -> object:
        link = {"bandwidth_bytes_per_s": 1e9}
        return parse_document("cluster", {"devices": n, "memory": limit, "intra_node": link, "inter_node": link})

    training = _training(optimizer="adam", memory_margin=0.0, global_batch_size=1)
    layout = Layout([(0, 2)], num_microbatches=1, schedule="gpipe")
    plan = estimate(_profile(), cluster(1), training, layout)
    assert plan.stages[0].memory_bytes == step > plan.stages[0].memory_limit_bytes
    fused = estimate(_profile(), cluster(1), training.model_copy(update={"fused_optimizer": True}), layout)
    assert fused.stages[0].memory_bytes == walk <= fused.stages[0].memory_limit_bytes
    best = solve(_profile(), cluster(2), training.model_copy(update={"global_batch_size": 2}),
                 PlanOptions(time_limit_s=5))
    assert all(s.memory_bytes <= s.memory_limit_bytes for s in best.stages)
    assert best.zero_stage >= 1 or best.pipeline_degree == 2, best


def test_plans_without_the_part_still_read() -> None:
    plan = _one_stage(_training(optimizer="adam"))
    data = json.loads(plan.model_dump_json())
    for st in data["stages"]:
        del st["memory_parts"]["optimizer_step"]
    del data["training"]["fused_optimizer"]
    del data["training"]["optimizer_step_bytes_per_param_byte"]
    back = parse_document("plan", data)
    assert back.stages[0].memory_parts.optimizer_step == 0
    assert back.training.optimizer_step_factor == 1.0
