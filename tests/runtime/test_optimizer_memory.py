"""The optimizer step's temporaries the planner counts (``TrainingSetup.optimizer_step_factor``,
``planner.presets.OPTIMIZER_STEP_TEMPORARIES``) against what the runtime's optimizers really
allocate in ``step()``, measured by torch's own ``MemTracker``: foreach Adam/AdamW one float32
copy of the parameters, fused Adam/AdamW and SGD nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.schema import TrainingSetup
from runtime.training import make_optimizer


def _step_temporaries(name: str, *, fused: bool) -> tuple[float, float]:
    """(peak during ``step()`` less what is held after it, state held after it), per parameter
    byte, for the runtime's optimizer ``name`` on a small MLP whose largest tensor is a third of
    its parameters (so a one-tensor-at-a-time step would show 2 x 0.4, not 1)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 64))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = make_optimizer(name, model.parameters(), lr=1e-3, fused=fused)
    for _ in range(2):  # the second backward leaves gradients; the first step made the state
        opt.zero_grad(set_to_none=False)
        model(torch.randn(4, 64)).sum().backward()
        if _ == 0:
            opt.step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        opt.step()
    (device,) = tracker.get_tracker_snapshot("peak")
    peak = tracker.get_tracker_snapshot("peak")[device]["Total"]
    held = tracker.get_tracker_snapshot("current")[device]["Total"]
    # held: parameters + gradients + state
    return (peak - held) / params, held / params - 2.0


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", ["sgd", "sgd-momentum", "adam", "adamw"])
def test_the_planned_step_temporaries_are_what_torch_allocates(name: str, fused: bool) -> None:
    training = TrainingSetup(optimizer=name, fused_optimizer=fused)
    temporaries, state = _step_temporaries(name, fused=fused)
    assert temporaries == pytest.approx(training.optimizer_step_factor, abs=0.01)
    assert state == pytest.approx(training.optimizer_state_factor, abs=0.01)
