"""The ranks' agreement on the data, step by step: what each rank read (:class:`DataReport`)
and the verdict over every rank's report (:func:`judge`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
