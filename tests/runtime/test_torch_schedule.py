"""runtime/_torch_schedule.py: the private torch schedule API pipeplan run executes plans with.

If torch renames or changes ``_PipelineScheduleRuntime``, ``_prepare_schedule_with_comms``,
``_load_csv`` or ``_Action.from_str``, these tests fail here, naming the API, instead of deep
inside a pipelined run.  That the lists run action for action, with the gradients of the
unsplit model, is tested end to end in tests/runtime/test_run_schedules.py.
"""

from __future__ import annotations

import pytest
import torch

from runtime import _torch_schedule


def test_every_private_api_is_there() -> None:
    from torch.distributed.pipelining import schedules as ts

    _torch_schedule.check_private_api()  # raises naming what is missing
    for path in _torch_schedule.PRIVATE_API:
        obj: object = ts
        for part in path.split(".schedules.")[1].split("."):
            assert hasattr(obj, part), f"torch {torch.__version__} lost {path}, which runtime/_torch_schedule.py uses"
            obj = getattr(obj, part)
    for name in _torch_schedule.PUBLIC_CLASSES.values():
        assert hasattr(ts, name), name
    # the text form of our actions is torch's
    action = ts._Action.from_str("1W3")
    assert (action.stage_index, action.computation_type.value, action.microbatch_index) == (1, "W", 3)


def test_a_missing_private_api_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.pipelining import schedules as ts

    monkeypatch.delattr(ts._PipelineScheduleRuntime, "_prepare_schedule_with_comms")
    with pytest.raises(RuntimeError, match="_PipelineScheduleRuntime._prepare_schedule_with_comms"):
        _torch_schedule.check_private_api()
