"""The zoo GPT trained as a character-level language model on a toy corpus built in code.

The model is :func:`examples.gpt.tiny` (same layers and weights, so the same profile and
plans); the data is :data:`TEXT`, a few paragraphs in this file, as byte ids.  Each sample
is a window of ``seq + 1`` characters: the first ``seq`` are the inputs, the last ``seq``
(shifted by one) the targets of a next-character cross-entropy, so this is the whole
entry-point contract of ``pipeplan run`` at work: a model, example inputs, a loss that takes
targets, and a data source yielding ``(inputs, targets)``.

* ``examples.charlm:gpt`` -- every rank reads the same global batches from
  ``Loader(make)``: a ``DataLoader`` over the windows, shuffled with a seeded generator,
  epoch after epoch;
* ``examples.charlm:gpt_sharded`` -- each data-parallel replica reads its own rows from
  ``Loader(make, per_replica=True)``: a ``DistributedSampler`` for that replica.

Everything is deterministic: the same call gives the same batches in the same order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from examples.gpt import GPT, GPTConfig, build
from runtime.data import Loader

#: the corpus (plain ASCII, so a byte is a token of the model's 256-entry vocabulary)
TEXT = """\
A pipeline cuts a network into stages and hands each stage to its own device. The first
stage reads the batch, the last stage computes the loss, and the ones in between only pass
activations forward and gradients back. A batch is split into micro-batches so that every
stage has work to do while the others are busy; the time they wait for each other is the
bubble. More micro-batches make the bubble smaller, but each of them costs a message and
some memory, and the planner weighs one against the other.

The planner reads a profile of the model: how long each layer takes forward and backward,
how many bytes it keeps for the backward pass, and how many bytes cross a cut placed after
it. From these it predicts the step time and the peak memory of every stage for every split,
every schedule and every number of micro-batches, and it keeps the fastest plan that fits.
A plan is only a promise until it runs, so the runtime trains it and compares what it
measured with what was predicted.

Training a real model needs more than a plan. The loss needs its labels, the data comes
from a loader, the arithmetic runs in sixteen bits with thirty-two bit master weights, the
gradient is clipped to a norm, and the learning rate warms up and then decays. A small
language model that reads this very text one character at a time is enough to show all of
it: the loss starts near the logarithm of the vocabulary and falls as the model learns
which letters follow which.
"""

CONFIG = GPTConfig()  # examples.gpt:tiny: 4 blocks, hidden 64, sequence 32, vocabulary 256
#: a window starts every STRIDE characters
STRIDE = 8


def token_ids(text: str = TEXT) -> Tensor:
    """The corpus as byte ids (int64)."""
    return torch.tensor(list(text.encode("ascii")), dtype=torch.long)


class CharWindows(Dataset[tuple[Tensor, Tensor]]):
    """Sample ``i``: characters ``i * stride ..`` as ``(inputs, targets)``, targets shifted by one."""

    def __init__(self, seq: int = CONFIG.seq, stride: int = STRIDE, text: str = TEXT) -> None:
        self.ids = token_ids(text)
        self.seq = seq
        self.stride = stride

    def __len__(self) -> int:
        return (len(self.ids) - self.seq - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.stride
        window = self.ids[start : start + self.seq + 1]
        return window[:-1], window[1:]


def next_char_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of every position toward the next character."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _global_batches(batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Epoch after epoch of shuffled windows (a seeded shuffle: the same order on every rank)."""
    data = CharWindows()
    order = torch.Generator().manual_seed(0)
    for _ in itertools.count():
        yield from DataLoader(data, batch_size=batch_size, shuffle=True, generator=order, drop_last=True)


def _replica_batches(batch_size: int, replica: int, replicas: int) -> Iterator[tuple[Tensor, Tensor]]:
    """This replica's windows, epoch after epoch (``DistributedSampler``, seeded)."""
    data = CharWindows()
    sampler = DistributedSampler(data, num_replicas=replicas, rank=replica, shuffle=True, seed=0, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)


def _model() -> tuple[GPT, Tensor]:
    model, _ = build(CONFIG)
    inputs, _ = next(iter(DataLoader(CharWindows(), batch_size=CONFIG.batch)))
    return model, inputs


def gpt() -> tuple[GPT, Tensor, object, Loader]:
    """``examples.gpt:tiny`` on the corpus; every rank reads the same global batches."""
    model, inputs = _model()
    return model, inputs, next_char_loss, Loader(_global_batches)


def gpt_sharded() -> tuple[GPT, Tensor, object, Loader]:
    """``examples.gpt:tiny`` on the corpus; each data-parallel replica reads its own rows."""
    model, inputs = _model()
    return model, inputs, next_char_loss, Loader(_replica_batches, per_replica=True)
