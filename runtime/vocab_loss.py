"""The vocabulary-parallel loss (part of :mod:`runtime.mesh`): where the last stage's
logits are sharded along the vocabulary, torch's ``loss_parallel`` computes the cross-entropy on
them (:func:`vocab_parallel_loss`), inside :func:`loss_parallel_context`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.mesh_spec import MeshSpec


def vocab_parallel_loss(loss_of: Callable[[Any], Any], output: Any) -> tuple[Any, bool]:
    """``loss_of(output)`` of the last stage's ``output``, and whether it ran vocabulary-parallel.

    Where the logits in ``output`` are sharded along the vocabulary (:func:`apply_tensor_parallel`'s
    ``sharded_logits``), torch's ``loss_parallel`` computes the cross-entropy on them (each rank's
    log-softmax over its share of the vocabulary, the maximum and the sum of exponentials
    all-reduced, as Megatron's vocabulary-parallel cross-entropy: the full logits are never
    gathered), and the loss is returned as a plain tensor.  A loss DTensor cannot run on sharded
    logits (an operator without a sharding rule) gets them gathered instead, on every
    tensor-parallel rank alike.  It must run inside :func:`loss_parallel_context`, which the
    backward needs too (``loss_parallel`` is not reentrant: an inner one would switch it off on
    exit)."""
    from torch.distributed.tensor import DTensor, Replicate

    leaves = output if isinstance(output, tuple) else (output,)
    if not any(isinstance(t, DTensor) for t in leaves):
        return loss_of(output), False
    try:
        value = loss_of(output)
    except (RuntimeError, NotImplementedError):
        whole = tuple(
            t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local() if isinstance(t, DTensor) else t
            for t in leaves
        )
        return loss_of(whole if isinstance(output, tuple) else whole[0]), False
    return (value.full_tensor() if isinstance(value, DTensor) else value), True


def loss_parallel_context(spec: MeshSpec) -> Any:
    """The context a pipeline step runs in: torch's ``loss_parallel`` under tensor parallelism
    (the vocabulary-parallel loss's backward needs it), else nothing."""
    import contextlib

    if spec.tensor_parallel_degree == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
