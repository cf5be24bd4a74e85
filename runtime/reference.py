"""``--check``'s unsplit reference: the model trained in one process exactly as GPipe's maths
says (:func:`train_reference`), on the same batches, optimizer, schedule, loss scale and clipping
as the pipelined run, and what it keeps for the comparison (:class:`ReferenceResult`).

Its parts: :mod:`runtime.reference_trainer` (the model, optimizer and loss scale, and one step:
micro-batches, gradient averages, unscaling, clipping, the optimizer step) and
:mod:`runtime.reference_result` (what the steps record, and :class:`ReferenceResult`); here the
loop and each step's batches (:class:`_ReplicaBatches`).  Every name stays importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from runtime.batches import global_batch
from runtime.reference_result import ReferenceResult as ReferenceResult
from runtime.reference_result import _mark_noise as _mark_noise
from runtime.reference_trainer import ReferenceTrainer
from runtime.train_options import TrainOptions


def train_reference(
    model: nn.Module,
    example_inputs: Sequence[Tensor],
    loss: Any,
    *,
    steps: int,
    global_batch_size: int,
    microbatch_size: int,
    replicas: int = 1,
    optimizer: str,
    lr: float,
    seed: int,
    device: torch.device | None = None,
    data_fn: Callable[[int, int], Any] | None = None,
    keywords: Sequence[str] = (),
    seed_hooks: Callable[[nn.Module, Any], list[Any]] | None = None,
    source: Any = None,
    options: TrainOptions | None = None,
    grad_steps: Sequence[int] = (),
    first_step: int = 0,
) -> ReferenceResult:
    """Train the unsplit ``model`` in this process exactly as GPipe's maths says.

    Each step runs the global batch as ``global_batch_size / microbatch_size`` micro-batches,
    replica by replica as the pipelined run shards it, averages the gradients in the same
    order the schedule and the data-parallel all-reduce do (mean over a replica's
    micro-batches, then mean over replicas), unscales them (float16), clips them to the
    global norm, sets the step's learning rate and takes one optimizer step, every
    micro-batch's forward and loss under the same autocast as the stages.  The batches come
    from ``source`` (a :class:`runtime.data.DataSource`: one reading of the global batches, or
    one per replica for per-replica data) or else from :func:`global_batch` (``data_fn``
    when given, else synthetic with ``seed``), as on every rank; ``loss(output)``, or
    ``loss(output, targets)`` for batches with targets.  ``options`` default to the plain
    float32 run of ``optimizer`` and ``lr``.  Returns per-step mean losses and the final
    parameters by qualified name (tied weights under every name).  ``keywords``: the names
    of the trailing inputs passed by keyword.  ``seed_hooks(model, streams)``
    (:meth:`profiler.split.SplitModel.seed_hooks`) makes every layer draw from the random
    stream of (seed, step, replica, micro-batch, layer), as the pipelined stages do.  Every
    step records each tensor's gradient norm as the optimizer sees it, and the steps in
    ``grad_steps`` the gradients themselves, for :func:`compare`.

    ``first_step``: the step a resumed run (``--resume``) started at.  The reference still
    trains from step 0 (the seed's weights), so the check covers the save, the resharding and
    the load as well as the steps after them; with Adam or AdamW it also records, per element,
    where its gradient was rounding noise at a step before ``first_step``
    (:attr:`ReferenceResult.noise_before`), since the parameters' difference accumulated there too.
    """
    opts = options or TrainOptions(optimizer=optimizer, lr=lr, steps=steps)
    trainer = ReferenceTrainer(
        model, opts, device or torch.device("cpu"), seed=seed,
        microbatches=global_batch_size // replicas // microbatch_size, microbatch_size=microbatch_size,
        keywords=keywords, seed_hooks=seed_hooks, grad_steps=grad_steps, first_step=first_step,
    )  # fmt: skip
    batches = _ReplicaBatches(example_inputs, global_batch_size, replicas, seed=seed, data_fn=data_fn,
                              keywords=keywords, source=source)  # fmt: skip
    for step in range(steps):
        trainer.step(step, batches.at(step), loss)
    for h in trainer.handles:
        h.remove()
    return trainer.records.result(model)


class _ReplicaBatches:
    """Each step's rows of every replica, read as the ranks read them: from ``source`` (one
    reading of the global batches, or one per replica for per-replica data), else from
    :func:`global_batch` (``data_fn`` when given, else synthetic with ``seed``)."""

    def __init__(
        self, example_inputs: Sequence[Tensor], global_batch_size: int, replicas: int, *, seed: int,
        data_fn: Callable[[int, int], Any] | None, keywords: Sequence[str], source: Any,
    ) -> None:  # fmt: skip
        self.example_inputs, self.keywords = example_inputs, keywords
        self.global_batch_size, self.replicas = global_batch_size, replicas
        self.seed, self.data_fn, self.source = seed, data_fn, source
        self.readers: list[Any] = []
        if source is not None:
            per = source.kind == "per-replica"
            self.readers = [source.open(d, replicas) for d in range(replicas)] if per else [source.open(0, 1)]

    def at(self, step: int) -> list[Any]:
        """Replica ``d``'s rows of ``step`` at index ``d``."""
        from profiler.loading import Batch

        if self.source is not None and self.source.kind == "per-replica":
            return [r.next(step)[0] for r in self.readers]
        if self.source is not None:
            whole = self.readers[0].next(step)[0]
        else:
            whole = Batch(global_batch(self.example_inputs, self.global_batch_size, seed=self.seed, step=step,
                                       data_fn=self.data_fn, keywords=self.keywords))  # fmt: skip
        n = self.global_batch_size // self.replicas
        return [whole.rows(d * n, (d + 1) * n) for d in range(self.replicas)]
