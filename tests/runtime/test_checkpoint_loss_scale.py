"""float16's dynamic loss scale survives a checkpoint (runtime/checkpoint.py, runtime/training.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from planner.errors import InputError
from runtime.checkpoint import INFO_FILE, load_checkpoint, read_info, save_checkpoint
from runtime.training import LossScaler


@pytest.fixture
def one_rank(tmp_path: Path):  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_loss_scale_is_saved_and_restored(tmp_path: Path, one_rank: None) -> None:
    scaler = LossScaler(True, growth_interval=4)
    for found_inf in (True, False, False, False):  # halved once, then 3 good steps
        scaler.update(found_inf)
    assert scaler.state() == (2.0**15, 3)
    model, opt = _model()
    named = list(model.named_parameters())
    save_checkpoint(tmp_path / "ck", 4, named, opt, model="m:f", sha256="a" * 64, plan="K=1", optimizer_name="sgd",
                    loss_scale=scaler.state())
    info = read_info(tmp_path / "ck")
    assert (info.loss_scale, info.loss_scale_good_steps) == (2.0**15, 3)

    fresh = LossScaler(True, growth_interval=4)
    model2, opt2 = _model()
    loaded = load_checkpoint(tmp_path / "ck", list(model2.named_parameters()), opt2, model="m:f", sha256="a" * 64)
    fresh.restore(loaded.loss_scale, loaded.loss_scale_good_steps)
    assert fresh.state() == scaler.state()
    fresh.update(False)  # the 4th good step in a row doubles it, as it would have without the restart
    assert fresh.state() == (2.0**16, 0)


def test_a_checkpoint_without_a_loss_scale_reads_as_none(tmp_path: Path, one_rank: None) -> None:
    model, opt = _model()
    save_checkpoint(tmp_path / "ck", 2, list(model.named_parameters()), opt, model="m:f", sha256="a" * 64,
                    plan="K=1", optimizer_name="sgd")
    info = read_info(tmp_path / "ck")
    assert info.loss_scale is None and info.loss_scale_good_steps == 0
    scaler = LossScaler(True)
    scaler.restore(info.loss_scale, info.loss_scale_good_steps)
    assert scaler.state() == (2.0**16, 0)  # a bfloat16 or float32 run's checkpoint: float16 starts afresh
    off = LossScaler(False)
    off.restore(1024.0, 5)  # a float16 checkpoint resumed in bfloat16: no scaling
    assert off.state() is None and off.scale == 1.0


@pytest.mark.parametrize("bad", [-1.0, 0, "big", True, float("inf")])
def test_a_damaged_loss_scale_is_refused(tmp_path: Path, one_rank: None, bad: object) -> None:
    model, opt = _model()
    path = save_checkpoint(tmp_path / "ck", 2, list(model.named_parameters()), opt, model="m:f", sha256="a" * 64,
                           plan="K=1", optimizer_name="sgd", loss_scale=(8.0, 1))
    data = json.loads((path / INFO_FILE).read_text())
    data["loss_scale"] = bad if bad != float("inf") else 1e400
    (path / INFO_FILE).write_text(json.dumps(data).replace("Infinity", "1e400"))
    with pytest.raises(InputError, match="is damaged.*loss_scale"):
        read_info(tmp_path / "ck")
