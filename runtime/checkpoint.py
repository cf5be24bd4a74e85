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
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from planner.errors import InputError

FORMAT = "pipeplan-checkpoint/1"
INFO_FILE = "pipeplan.json"
LATEST = "latest"


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``pipeplan.json`` records about one checkpoint."""

    format: str
    model: str
    sha256: str
    step: int
    plan: str
    optimizer: str
    path: str = ""
    #: float16 training: the dynamic loss scale and its count of good steps (None otherwise)
    loss_scale: float | None = None
    loss_scale_good_steps: int = 0


def _dcp() -> Any:
    """``torch.distributed.checkpoint`` (its names are re-exported without ``__all__`` typing)."""
    import importlib

    return importlib.import_module("torch.distributed.checkpoint")


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory, f"step-{step:06d}")


def read_info(directory: str | os.PathLike[str]) -> CheckpointInfo:
    """The newest complete checkpoint in ``directory`` (what ``latest`` names); no torch."""
    root = Path(directory)
    latest = root / LATEST
    if not root.is_dir():
        raise InputError(f"--resume {directory}: no such checkpoint directory")
    if not latest.exists():
        raise InputError(
            f"--resume {directory}: no complete checkpoint there ({LATEST} is missing: nothing was saved, "
            "or every save was interrupted)"
        )
    name = latest.read_text(encoding="utf-8").strip()
    path = root / name
    info_file = path / INFO_FILE
    try:
        data = json.loads(info_file.read_text(encoding="utf-8"))
        info = CheckpointInfo(**{k: data[k] for k in ("format", "model", "sha256", "step", "plan", "optimizer")})
        scale, good = data.get("loss_scale"), data.get("loss_scale_good_steps", 0)
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0
        ):
            raise ValueError(f"loss_scale {scale!r} is not a positive number")
        if isinstance(good, bool) or not isinstance(good, int) or good < 0:
            raise ValueError(f"loss_scale_good_steps {good!r} is not a count")
        info = CheckpointInfo(**{**asdict(info), "loss_scale": None if scale is None else float(scale),
                                 "loss_scale_good_steps": good})
    except FileNotFoundError:
        raise InputError(f"checkpoint {path} is damaged: {INFO_FILE} is missing (named by {latest})") from None
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(f"checkpoint {path} is damaged: {info_file} does not parse ({err})") from None
    if info.format != FORMAT:
        raise InputError(f"checkpoint {path} has format {info.format!r}; this pipeplan reads {FORMAT!r}")
    if not (path / ".metadata").exists():
        raise InputError(f"checkpoint {path} is damaged: DCP's .metadata is missing")
    return CheckpointInfo(**{**asdict(info), "path": str(path)})


def check_compatible(info: CheckpointInfo, *, model: str, sha256: str, optimizer: str | None = None) -> None:
    """Refuse a checkpoint of another model (structure fingerprint) or another optimizer."""
    if info.sha256 != sha256:
        raise InputError(
            f"checkpoint {info.path} is of model {info.model!r} (fingerprint {info.sha256[:12]}...) but this run "
            f"trains {model!r} (fingerprint {sha256[:12]}...): resume from a checkpoint of this model, or "
            "start without --resume"
        )
    if optimizer is not None and info.optimizer != optimizer:
        raise InputError(
            f"checkpoint {info.path} holds {info.optimizer} optimizer state but this run uses {optimizer}: "
            f"resume with --optimizer {info.optimizer}"
        )


def _optimizer_state(named: Sequence[tuple[str, Any]], optimizer: Any) -> dict[str, Any]:
    """``optim.<param name>.<key>`` -> tensor, for the parameters this rank's optimizer holds
    state for (a ZeRO-1 rank: its share)."""
    if optimizer is None:  # a rank whose stages hold no parameter
        return {}
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    out = {}
    for name, p in named:
        for key, value in inner.state.get(p, {}).items():
            if hasattr(value, "dim"):
                out[f"optim.{name}.{key}"] = value
    return out


def _init_optimizer_state(named: Sequence[tuple[str, Any]], optimizer: Any) -> None:
    """Make the optimizer create its state (a step with zero gradients and learning rate 0), so
    that DCP has tensors to load into."""
    import torch

    if optimizer is None:
        return
    inner = getattr(optimizer, "optim", optimizer)
    params = [p for _, p in named]
    if all(p in inner.state for p in params if any(p is q for g in inner.param_groups for q in g["params"])):
        return
    saved = [g["lr"] for g in inner.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in inner.param_groups:
        g["lr"] = 0.0
    inner.step()
    for g, lr in zip(inner.param_groups, saved, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


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
    state.update(_optimizer_state(named, optimizer))
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
        _init_optimizer_state(named, optimizer)
        state.update({k: v for k, v in _optimizer_state(named, optimizer).items() if k in saved})
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
