"""What a checkpoint directory says about itself, read without torch: the layout's names
(:data:`FORMAT`, :data:`INFO_FILE`, :data:`LATEST`, :func:`step_dir`), ``pipeplan.json``
(:class:`CheckpointInfo`), the newest complete checkpoint (:func:`read_info`) and whether this
run may resume from it (:func:`check_compatible`).  Saving and loading: :mod:`runtime.checkpoint`."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

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
