"""The profiler measures each layer's backward split into its input-gradient (I) and
weight-gradient (W) parts, and the bytes held between them; the cost model uses them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import profiler
from planner.cost import Layout, estimate
from planner.schema import TrainingSetup
from tests.planner.helpers import cluster

WIDTH, BATCH = 768, 64  # (each matrix product about 1-2 ms: a fixed per-call overhead stays small beside it)


@pytest.fixture(scope="module")
def prof():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    return profiler.profile(
        model, torch.randn(BATCH, WIDTH), microbatch_sizes=(BATCH,), num_threads=1, repeats=7, progress=False, clock="cpu"
    )


def test_split_is_measured_and_sums_to_about_the_backward(prof) -> None:  # type: ignore[no-untyped-def]
    first, tanh, mid, last = prof.layers
    for layer in prof.layers:
        assert layer.backward_input_ms is not None and layer.backward_weight_ms is not None
        assert layer.weight_grad_bytes is not None
    # the first layer's input needs no gradient: its whole backward is W (as the runtime runs it)
    assert first.backward_input_ms[0] < 0.2 * first.backward_weight_ms[0]
    # a layer without weights has (almost) nothing to do in W
    assert tanh.backward_weight_ms[0] < 0.2 * tanh.backward_input_ms[0]
    for layer in (mid, last):  # two matrix products of equal cost
        i, w, b = layer.backward_input_ms[0], layer.backward_weight_ms[0], layer.backward_ms[0]
        assert 0.7 * b <= i + w <= 1.6 * b, (layer.name, i, w, b)
        assert 0.4 <= i / w <= 2.5, (layer.name, i, w)


def test_bytes_held_between_i_and_w_are_the_weight_layers_inputs_and_output_gradients(prof) -> None:  # type: ignore[no-untyped-def]
    first, tanh, mid, last = prof.layers
    act = BATCH * WIDTH * 4  # one float32 activation
    # W of a Linear needs its input and the gradient of its output: nothing else is held
    assert mid.weight_grad_bytes == [2 * act]
    assert last.weight_grad_bytes is not None and last.weight_grad_bytes[0] >= act
    # the Tanh's saved output is the next Linear's input: counted there, once
    assert tanh.weight_grad_bytes == [0]
    # the first layer's W runs its whole backward: it holds what its forward saved
    assert first.weight_grad_bytes == first.activation_bytes


def test_the_cost_model_uses_the_measured_split(prof) -> None:  # type: ignore[no-untyped-def]
    plan = estimate(
        prof, cluster(2, "4GiB"), TrainingSetup(global_batch_size=2 * BATCH, optimizer="sgd"),
        Layout(
            [(0, 2), (2, 4)],
            num_microbatches=2,
            schedule="zb-h1",
        ),
    )  # fmt: skip
    for stage in plan.stages:
        layers = prof.layers[stage.start : stage.stop]
        i = w = 0.0
        for la in layers:  # each layer's measured parts, scaled up together when they sum to less than its backward
            li, lw, lb = la.backward_input_ms[0], la.backward_weight_ms[0], la.backward_ms[0]  # type: ignore[index]
            scale = lb / (li + lw) if 0 < li + lw < lb else 1.0
            i, w = i + li * scale, w + lw * scale
        assert stage.backward_input_ms is not None and stage.backward_weight_ms is not None
        # the measured parts, scaled up together when they sum to less than the backward
        assert stage.backward_input_ms / (stage.backward_input_ms + stage.backward_weight_ms) == pytest.approx(i / (i + w), rel=1e-6)
