"""Checkpoints that outlive the plan: ``torch.distributed.checkpoint`` (DCP), sharded, per rank.

Layout of a checkpoint directory ``DIR``::

    DIR/step-000004/            one checkpoint: DCP's files (every rank writes its own shards,
        __0_0.distcp ...        nothing is gathered to rank 0, but for ``_StridedShard``
                                tensors, see :func:`_savable`) and DCP's .metadata
        .metadata
        pipeplan.json           what was saved: model, structure fingerprint, step, plan, optimizer,
                                float16's loss scale
    DIR/latest                  the name of the newest *complete* checkpoint

Keys are the model's own parameter names (``blocks.0.attn.qkv.weight``) and
``optim.<name>.<state>``, whatever the plan: the stage, tensor-parallel shard or FSDP shard a
rank holds is one slice of the same global tensor, so DCP reshards on load and a checkpoint
written under one plan resumes under another (other K, D, T or ZeRO).

``latest`` is written last, by rank 0, after every rank finished its part and
``pipeplan.json`` is on disk, through a temporary file and ``os.replace`` (atomic): a job killed
mid-save leaves a ``step-*`` directory that no ``latest`` names, and resuming takes the previous
complete checkpoint.  A checkpoint of another model is refused before training
(:func:`check_compatible`), and a damaged one raises an ``InputError`` naming the file.

Where each part lives (every name stays importable from here): this module, saving and loading
(:func:`save_checkpoint`, :func:`load_checkpoint`); :mod:`runtime.checkpoint_info`, the layout's
names, ``pipeplan.json`` and which checkpoint to resume from (no torch);
:mod:`runtime.checkpoint_optimizer`, the optimizer's state in a checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from planner.errors import InputError
from runtime.checkpoint_info import FORMAT as FORMAT
from runtime.checkpoint_info import INFO_FILE as INFO_FILE
from runtime.checkpoint_info import LATEST as LATEST
from runtime.checkpoint_info import CheckpointInfo as CheckpointInfo
from runtime.checkpoint_info import check_compatible as check_compatible
from runtime.checkpoint_info import read_info as read_info
from runtime.checkpoint_info import step_dir as step_dir
from runtime.checkpoint_optimizer import create_optimizer_state, optimizer_state


def _dcp() -> Any:
    """``torch.distributed.checkpoint`` (its names are re-exported without ``__all__`` typing)."""
    import importlib

    return importlib.import_module("torch.distributed.checkpoint")


def _savable(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each DTensor placed ``_StridedShard`` (GPT-2's fused ``c_attn`` at T > 1, and
    its optimizer state), which DCP refuses ("overlapping chunks"), replaced by its full value as a
    plain tensor: every rank of its mesh holds the same value and DCP writes it once (plain
    tensors are replicated entries, deduplicated across ranks).  The key is the same, so a
    checkpoint written under one plan loads under another (:func:`load_checkpoint` copies each
    rank's slice back).  A collective over each such tensor's mesh, in ``state``'s order."""
    from runtime import _strided_shard

    return {k: _strided_shard.full_tensor(v) if _strided_shard.has_strided(v) else v for k, v in state.items()}


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    named: Iterable[tuple[str, Any]],
    optimizer: Any,
    *,
    model: str,
    sha256: str,
    plan: str,
    optimizer_name: str,
    loss_scale: tuple[float, int] | None = None,
) -> Path:
    """Every rank calls this with its parameters (by the model's names; tied copies under one
    name) and its optimizer; returns the checkpoint's path.  Collective over the default group.
    ``loss_scale``: float16's dynamic loss scale and its good-step count, restored on resume."""
    import torch.distributed as dist

    dcp = _dcp()
    named = list(named)
    path = step_dir(directory, step)
    state: dict[str, Any] = {name: p.detach() for name, p in named}
    state.update(optimizer_state(named, optimizer))
    dcp.save(_savable(state), checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        info = CheckpointInfo(
            format=FORMAT, model=model, sha256=sha256, step=step, plan=plan, optimizer=optimizer_name,
            loss_scale=None if loss_scale is None else float(loss_scale[0]),
            loss_scale_good_steps=0 if loss_scale is None else int(loss_scale[1]),
        )
        tmp = path / (INFO_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(info) | {"path": ""}, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path / INFO_FILE)
        marker = Path(directory, LATEST + ".tmp")
        marker.write_text(path.name + "\n", encoding="utf-8")
        os.replace(marker, Path(directory, LATEST))
    dist.barrier()
    return path


def load_checkpoint(
    directory: str | os.PathLike[str],
    named: Iterable[tuple[str, Any]],
    optimizer: Any,
    *,
    model: str,
    sha256: str,
    optimizer_name: str | None = None,
) -> CheckpointInfo:
    """Load the newest complete checkpoint into this rank's parameters and optimizer state, in
    place, whatever plan wrote it (DCP reshards); returns its info (``step``: steps done)."""
    import torch

    dcp = _dcp()
    named = list(named)
    info = read_info(directory)
    check_compatible(info, model=model, sha256=sha256, optimizer=optimizer_name)
    state: dict[str, Any] = {name: p.detach() for name, p in named}
    reader = dcp.FileSystemReader(info.path)
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as err:  # a truncated or foreign .metadata
        raise InputError(f"checkpoint {info.path} is damaged: cannot read its metadata ({err})") from None
    if any(k.startswith("optim.") for k in saved):
        create_optimizer_state(named, optimizer)
        state.update({k: v for k, v in optimizer_state(named, optimizer).items() if k in saved})
    missing = [k for k in state if k not in saved]
    if missing:
        raise InputError(
            f"checkpoint {info.path} lacks {len(missing)} tensor(s) this run needs, e.g. {missing[0]!r}: "
            "it was not written for this model"
        )
    from runtime import _strided_shard

    strided = {k: v for k, v in state.items() if _strided_shard.has_strided(v)}
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, device=v.to_local().device) for k, v in strided.items()}
    try:
        with torch.no_grad():
            dcp.load(state | buffers, checkpoint_id=info.path)
    except Exception as err:
        raise InputError(f"checkpoint {info.path} is damaged: loading it failed ({type(err).__name__}: {err})") from None
    for k, v in strided.items():  # in the order of ``named``, the same on every rank of a mesh
        _strided_shard.copy_from_full(v, buffers[k])
    return info
