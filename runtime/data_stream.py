"""One reading of the run's data (:class:`Stream`): a rank's, or the ``--check`` reference's,
batches of a :class:`runtime.data.DataSource`, step by step, each checked against the example
inputs and fingerprinted for the ranks' agreement check (:mod:`runtime.data_check`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import Tensor

from planner.errors import InputError
from profiler.loading import Batch, Loader, call_data, check_batch
from runtime.batches import batch_fingerprint, synthetic_batch

if TYPE_CHECKING:
    from runtime.data import DataSource


class Stream:
    """One rank's (or the reference's) reading of a :class:`DataSource`."""

    def __init__(self, source: DataSource, replica: int, replicas: int) -> None:
        g = source.global_batch_size
        if g % replicas:
            raise InputError(f"global batch {g} does not split into {replicas} replicas")
        self.source = source
        self.replica = replica
        self.replicas = replicas
        self.shard_rows = g // replicas
        self.read = 0  # batches taken from an iterable
        self._targets_like: Tensor | None = None
        self._it: Iterator[Any] | None = None
        self._length: int | None = None
        kind = source.kind
        if kind in ("iterable", "per-replica"):
            data = source.data
            what = self._what()
            try:
                if isinstance(data, Loader):
                    data = data.open(self.shard_rows, replica, replicas) if data.per_replica else data.open(g)
                self._length = len(data) if hasattr(data, "__len__") else None
                self._it = iter(data)
            except InputError:
                raise
            except Exception as err:
                raise InputError(f"opening {what} raised {type(err).__name__}: {err}") from err

    def _what(self) -> str:
        src = self.source
        if src.kind == "per-replica":
            return f"the data of {src.spec!r} for replica {self.replica} of {self.replicas}"
        return f"the data of {src.spec!r}"

    def next(self, step: int) -> tuple[Batch, int]:
        """This replica's rows of ``step`` and a fingerprint of what the ranks must agree on
        (the global batch; with ``per-replica`` data, this replica's rows)."""
        src = self.source
        g = src.global_batch_size
        kind = src.kind
        if kind == "synthetic":
            batch = Batch(synthetic_batch(src.example_inputs, g, seed=src.seed, step=step))
            return self._shard(batch), 0
        if kind == "function":
            batch = call_data(src.data_fn, src.example_inputs, step=step, batch_size=g, spec=src.spec,
                              keywords=src.keywords, takes_target=src.takes_target)  # fmt: skip
            return self._shard(batch), batch_fingerprint(batch.tensors())
        rows = self.shard_rows if kind == "per-replica" else g
        if step == 0 and self._length is not None and self._length < src.steps:
            raise InputError(
                f"{self._what()} has {self._length} batches but --steps {src.steps} needs {src.steps}: "
                "give more data (e.g. loop over epochs in a generator) or fewer --steps"
            )
        assert self._it is not None
        try:
            raw = next(self._it)
        except StopIteration:
            raise InputError(
                f"{self._what()} ended after {self.read} batches, at step {step} of --steps {src.steps}: give "
                "more data (e.g. loop over epochs in a generator) or fewer --steps; FUNC must build its data "
                "afresh on every call (the --check reference calls it again)"
            ) from None
        except InputError:
            raise
        except Exception as err:
            raise InputError(f"reading batch {self.read} of {self._what()} raised {type(err).__name__}: {err}") from err
        self.read += 1
        size_hint = (
            f"this replica's {rows} rows (global batch {g} / {self.replicas} replicas)"
            if kind == "per-replica"
            else f"the plan's global batch {g}"
        )
        try:
            batch = check_batch(
                raw, src.example_inputs, batch_size=rows, where=f"batch {self.read - 1} (step {step}) of {self._what()}:",
                keywords=src.keywords, takes_target=src.takes_target, target_like=self._targets_like,
            )  # fmt: skip
        except InputError as err:
            raise InputError(
                f"{err}; every batch must have {size_hint} rows (a DataLoader: batch_size={rows}, "
                "drop_last=True, or Loader(make) which is told the batch size)"
            ) from None
        if batch.targets is not None and self._targets_like is None:
            self._targets_like = batch.targets
        fingerprint = batch_fingerprint(batch.tensors())
        return (batch if kind == "per-replica" else self._shard(batch)), fingerprint

    def _shard(self, batch: Batch) -> Batch:
        n = self.shard_rows
        return batch if self.replicas == 1 else batch.rows(self.replica * n, (self.replica + 1) * n)
