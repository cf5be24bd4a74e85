"""runtime/_comm_timing.py relies on where torch routes FSDP2's collectives and the pipeline
schedule's sends and receives; these fail, naming what moved, when torch changes them (the mesh
runs in test_mesh_run.py check that the timed figures are above zero)."""

from __future__ import annotations

import importlib

import pytest


def test_fsdp_collectives_and_pipeline_transfers_are_where_the_timing_expects_them() -> None:
    import torch.distributed as dist

    from runtime._comm_timing import (
        FSDP_CALLS,
        PIPELINE_MODULE,
        POST,
        WAIT,
        FsdpClock,
        TransferClock,
        check_available,
        timed_fsdp_collectives,
        timed_transfers,
    )

    check_available()
    pipe = importlib.import_module(PIPELINE_MODULE)
    names = [fn for _, fn in FSDP_CALLS]
    before = [getattr(dist, n) for n in names] + [getattr(pipe, POST), getattr(pipe, WAIT)]
    with timed_fsdp_collectives(FsdpClock()), timed_transfers(TransferClock()):
        now = [getattr(dist, n) for n in names] + [getattr(pipe, POST), getattr(pipe, WAIT)]
        assert all(a is not b for a, b in zip(now, before, strict=True))
    assert [getattr(dist, n) for n in names] + [getattr(pipe, POST), getattr(pipe, WAIT)] == before  # restored


def test_a_moved_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime._comm_timing import FSDP_MODULE, PIPELINE_MODULE, WAIT, check_available

    monkeypatch.delattr(importlib.import_module(PIPELINE_MODULE), WAIT)
    with pytest.raises(RuntimeError, match=f"{PIPELINE_MODULE}.{WAIT} is gone"):
        check_available()
    monkeypatch.undo()
    fsdp = importlib.import_module(FSDP_MODULE)

    class Other:
        def __call__(self) -> None:
            return None

    monkeypatch.setattr(fsdp, "DefaultAllGather", Other)
    with pytest.raises(RuntimeError, match="DefaultAllGather no longer calls torch.distributed.all_gather_single"):
        check_available()
