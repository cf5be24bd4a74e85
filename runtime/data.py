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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from planner.errors import InputError
from profiler.loading import Batch, Entrypoint, Loader, call_data, check_batch
from runtime.training import batch_fingerprint, synthetic_batch

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


@dataclass(frozen=True)
class DataReport:
    """One rank's part of a step's data check: what it read (or why it could not)."""

    rank: int
    replica: int
    fingerprint: int | None  # None: this rank reads no data
    error: str | None = None


def judge(reports: Sequence[DataReport], *, step: int, per_replica: bool) -> tuple[str | None, str | None]:
    """``(error, warning)`` for one step's reports of every rank.

    An error: a rank could not read its batch, or two ranks that must read the same batch
    (any two, or with ``per_replica`` two of one replica) read different ones.  A warning:
    with ``per_replica``, two replicas read the same rows (the loader does not shard).
    """
    failed = [r for r in reports if r.error is not None]
    if failed:
        first = failed[0]
        others = f" and {len(failed) - 1} other rank(s)" if len(failed) > 1 else ""
        return f"{first.error} (on rank {first.rank}{others})", None
    readers = [r for r in reports if r.fingerprint is not None]
    groups: dict[int, list[DataReport]] = {}
    for r in readers:
        groups.setdefault(r.replica if per_replica else 0, []).append(r)
    for members in groups.values():
        differ = [r for r in members if r.fingerprint != members[0].fingerprint]
        if differ:
            scope = f"replica {members[0].replica}'s rows" if per_replica else "global batch"
            fix = (
                "make(batch_size, replica, replicas) must give the same batches on every call for one replica"
                if per_replica
                else "the data must be the same on every rank: data_fn(step, batch_size) deterministic in its "
                "arguments (seed a torch.Generator from step, do not use the global RNG or the rank), an "
                "iterable shuffled with a seeded generator"
            )
            return (
                f"the data gave rank {differ[0].rank} a different {scope} than rank {members[0].rank} at step "
                f"{step} ({len(differ)} of {len(members)} ranks reading it differ): {fix}"
            ), None
    warning = None
    if per_replica and len(groups) > 1:
        seen: dict[int, int] = {}
        for replica, members in sorted(groups.items()):
            fp = members[0].fingerprint
            assert fp is not None
            if fp in seen:
                warning = (
                    f"replicas {seen[fp]} and {replica} read the same rows at step {step}: does "
                    "make(batch_size, replica, replicas) shard by replica?"
                )
                break
            seen[fp] = replica
    return None, warning


__all__ = ["Batch", "DataReport", "DataSource", "Loader", "Stream", "judge", "loads_data"]
