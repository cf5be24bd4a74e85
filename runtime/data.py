"""The data a run trains on: FUNC's data source, read step by step and checked.

FUNC's fourth element (see :mod:`profiler.loading`) is one of four *kinds*:

* ``function``: ``data_fn(step, batch_size)`` returns the global batch of a step;
* ``iterable``: an iterable of global batches (a ``DataLoader`` whose batch size is the
  plan's global batch size), or ``Loader(make)`` with ``make(batch_size)`` returning one;
* ``per-replica``: ``Loader(make, per_replica=True)``, ``make(batch_size, replica, replicas)``
  returning the batches of one data-parallel replica;
* ``synthetic``: no data; batches shaped like the example inputs, drawn from ``--seed``.

With ``function`` and ``iterable`` every rank that needs data computes the same global batch
and keeps its replica's rows (the ranks compare a fingerprint of the global batch at every
step); with ``per-replica`` each replica reads its own share (the ranks of one replica compare
fingerprints of it).  Only the ranks that use the data read it: the one holding the first
stage (the inputs) and, when the loss takes targets, the one holding the last stage (the
targets).  A middle stage reads nothing.  A source that ends early or yields a batch of the
wrong shape is an :class:`~planner.errors.InputError` at that step on every rank.

``Loader`` is defined in :mod:`profiler.loading` (the entry-point contract) and re-exported
here for entry points: ``from runtime.data import Loader``.

Where each part lives (every name stays importable from here): this module, the source
(:class:`DataSource`, its kind, which ranks read it: :func:`loads_data`);
:mod:`runtime.data_stream`, one reading of it, step by step (:class:`Stream`);
:mod:`runtime.data_check`, the ranks' agreement at each step (:class:`DataReport`,
:func:`judge`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from profiler.loading import Batch, Entrypoint, Loader
from runtime.data_check import DataReport, judge
from runtime.data_stream import Stream

Kind = Literal["synthetic", "function", "iterable", "per-replica"]


def loads_data(kind: Kind, *, has_first: bool, has_last: bool, takes_target: bool) -> bool:
    """Whether a rank reads the data: it holds the first stage (inputs), or the last stage of
    a loss that takes targets.  Synthetic batches are only drawn where the inputs enter."""
    if kind == "synthetic":
        return has_first
    return has_first or (has_last and takes_target)


@dataclass(frozen=True)
class DataSource:
    """FUNC's data, for a plan's global batch size; :meth:`open` reads it."""

    example_inputs: tuple[Tensor, ...]
    global_batch_size: int
    steps: int
    seed: int = 0
    spec: str = "the entry point"
    keywords: tuple[str, ...] = ()
    takes_target: bool = False
    data_fn: Any = None
    data: Any = None

    @staticmethod
    def of(entry: Entrypoint, *, global_batch_size: int, steps: int, seed: int = 0) -> DataSource:
        return DataSource(
            example_inputs=entry.example_inputs,
            global_batch_size=global_batch_size,
            steps=steps,
            seed=seed,
            spec=entry.spec,
            keywords=entry.keywords,
            takes_target=entry.takes_target,
            data_fn=entry.data_fn,
            data=entry.data,
        )

    @property
    def kind(self) -> Kind:
        if self.data_fn is not None:
            return "function"
        if self.data is None:
            return "synthetic"
        if isinstance(self.data, Loader) and self.data.per_replica:
            return "per-replica"
        return "iterable"

    def describe(self, replicas: int) -> str:
        """One line for the report: what the ranks read and what they compare."""
        g = self.global_batch_size
        what = "(inputs, targets)" if self.takes_target else "inputs"
        if self.kind == "synthetic":
            return f"data: synthetic batches shaped like the example inputs (global batch {g}, seed {self.seed})"
        if self.kind == "per-replica":
            return (
                f"data: each of the {replicas} replica(s) reads its own {g // replicas} rows of {what} per step "
                f"from the per-replica Loader of {self.spec}; the ranks of a replica check they read the same"
            )
        source = "data function" if self.kind == "function" else "iterable of global batches"
        return (
            f"data: the {source} of {self.spec} ({what}, global batch {g} per step); every rank that reads it "
            "computes the same global batch (checked) and keeps its replica's rows"
        )

    def open(self, replica: int = 0, replicas: int = 1) -> Stream:
        """The batches data-parallel replica ``replica`` of ``replicas`` trains on, step by step."""
        return Stream(self, replica, replicas)


__all__ = ["Batch", "DataReport", "DataSource", "Loader", "Stream", "judge", "loads_data"]
