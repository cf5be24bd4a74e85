"""Read a plan's layer names as the units training frameworks place on pipeline stages.

pipeplan names each layer after the first module it runs (``profiler/split.py``): ``embed``,
``blocks.7``, ``head`` for the zoo GPT and ``pipeplan synth``; ``tok_embeddings``,
``layers.7``, ``norm``, ``lm_head`` for a torchtitan model; ``transformer.wte``,
``transformer.h.7`` ... for Hugging Face GPT-2; ``model.embed_tokens``, ``model.rotary_emb``,
``model.layers.7``, ``model.norm``, ``lm_head`` for Hugging Face decoders (Llama, Mistral,
Mixtral, Qwen2/3, Qwen3-MoE, DeepSeek-V3, Gemma 2).  A profile cut with ``--split-points`` inside a
block has several layers per block (``blocks.3.ln1`` ... ``blocks.3.mlp``); a module called
twice gets ``name#1``.

Megatron-LM and torchtitan place *decoder stacks*: an embedding, N decoder layers, a head (final
norm, output layer, loss).  :func:`decoder_stack` reads the names as such a stack, or says which
name it cannot place.  A layer without parameters that these frameworks keep outside their
units (Hugging Face's ``rotary_emb``, which computes the rotary cosines and sines once for every
decoder layer; :data:`PARAMETERLESS_NAMES`) is a unit of its own that places nothing: it travels
with whichever stage holds it, and a stage may start or stop on either side of it.  DeepSpeed places list positions and ``torch.distributed.pipelining``
module names, so they need no stack (see :func:`split_point_ok`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from planner.errors import PipeplanError

#: last name components read as (part of) the embedding, before the first decoder layer
EMBEDDING_NAMES = frozenset({
    "embed", "embeds", "embedding", "embeddings", "tok_embeddings", "embed_tokens", "tok_emb",
    "token_embedding", "word_embeddings", "wte", "wpe", "pos_emb", "position_embeddings",
    "embed_positions", "emb", "drop", "emb_drop", "embed_dropout",
})  # fmt: skip
#: last name components read as (part of) the head, after the last decoder layer
HEAD_NAMES = frozenset({
    "head", "lm_head", "output", "output_layer", "norm", "ln_f", "final_norm", "final_layernorm",
    "final_layer_norm", "norm_f", "loss", "logits",
})  # fmt: skip

#: last name components of layers without parameters that a decoder stack's frameworks compute
#: outside their units (rotary embeddings: torchtitan keeps ``freqs_cis`` as a buffer, Megatron
#: its ``RotaryEmbedding`` inside the model): they place nothing and may sit anywhere
PARAMETERLESS_NAMES = frozenset({"rotary_emb", "rotary_pos_emb", "rotary_embedding", "rotary_embeddings", "rope"})

# a decoder layer: a container path, an index, and optionally the part of the block
_BLOCK = re.compile(r"^(?P<container>(?:[A-Za-z_]\w*\.)+)(?P<index>\d+)(?:\.(?P<part>.+))?$")

UnitKind = Literal["embedding", "decoder", "head", "parameterless"]


class NotAStack(PipeplanError):
    """The layer names do not read as embedding, decoder layers, head."""


@dataclass(frozen=True)
class Unit:
    """What a framework places: the embedding, decoder layer ``index``, or the head; or a
    parameterless layer (the ``index``-th), which places nothing."""

    kind: UnitKind
    index: int = 0

    def __str__(self) -> str:
        if self.kind == "decoder":
            return f"decoder layer {self.index}"
        return "a parameterless layer" if self.kind == "parameterless" else self.kind


@dataclass(frozen=True)
class DecoderStack:
    """A plan's layers read as embedding | decoder layers | head: ``units[i]`` holds layer ``i``."""

    units: tuple[Unit, ...]
    container: str  # e.g. "blocks." (the decoder layers' module path)
    num_decoder_layers: int

    def starts_unit(self, layer: int) -> bool:
        """Whether a stage may start at ``layer`` (it does not cut a unit in two)."""
        return layer == 0 or layer >= len(self.units) or self.units[layer] != self.units[layer - 1]

    def stage_units(self, start: int, stop: int) -> list[Unit]:
        """The units of layers ``start:stop`` that place something, each once, in order
        (empty for a stage of parameterless layers only)."""
        out: list[Unit] = []
        for unit in self.units[start:stop]:
            if unit.kind == "parameterless":
                continue
            if not out or out[-1] != unit:
                out.append(unit)
        return out

    def decoder_layers(self, start: int, stop: int) -> int:
        return sum(1 for u in self.stage_units(start, stop) if u.kind == "decoder")


def _last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def decoder_stack(layer_names: Sequence[str]) -> DecoderStack:
    """Read ``layer_names`` as an embedding, decoder layers and a head; :class:`NotAStack` if not.

    Decoder layers are the names ``<container>.<index>`` (or ``<container>.<index>.<part>``
    for a block cut into parts) of the container that holds most of them; decoder layer *i* is
    the *i*-th of them in order.  Before them every name must be an embedding
    (:data:`EMBEDDING_NAMES`), after them a head (:data:`HEAD_NAMES`); a parameterless layer
    (:data:`PARAMETERLESS_NAMES`) may sit anywhere and is a unit of its own.
    """
    names = list(layer_names)
    twice = [n for n in names if "#" in n]
    if twice:
        raise NotAStack(
            f"layer {twice[0]!r} is a second call of module {twice[0].split('#')[0]!r}: a decoder "
            "stack calls each module once"
        )
    free = [_last(n) in PARAMETERLESS_NAMES for n in names]
    matches = [None if f else _BLOCK.match(n) for n, f in zip(names, free, strict=True)]
    distinct: dict[str, set[str]] = {}  # container -> its indices; in order of first appearance
    for m in matches:
        if m:
            distinct.setdefault(m.group("container"), set()).add(m.group("index"))
    if not distinct:
        raise NotAStack(
            f"no layer is named like a decoder layer ('<container>.<index>', e.g. blocks.0 or "
            f"layers.0): the layers are {_listing(names)}"
        )
    container = max(distinct, key=lambda c: len(distinct[c]))  # ties: the first to appear
    decoder_idx = [i for i, m in enumerate(matches) if m and m.group("container") == container]
    first, last = decoder_idx[0], decoder_idx[-1]
    units: list[Unit] = []
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        m = matches[i]
        if free[i]:
            units.append(Unit("parameterless", sum(free[:i])))
        elif first <= i <= last:
            if not (m and m.group("container") == container):
                raise NotAStack(
                    f"layer {name!r} sits between the decoder layers ({container}N) and is not one of "
                    "them: a decoder stack holds only decoder layers between its embedding and head"
                )
            index = m.group("index")
            if index not in seen:
                seen[index] = len(seen)
            elif _placing(units)[-1:] != [Unit("decoder", seen[index])]:
                raise NotAStack(
                    f"layer {name!r} returns to {container}{index} after another block: a block's "
                    "parts must be consecutive"
                )
            units.append(Unit("decoder", seen[index]))
        elif i < first:
            if _last(name) not in EMBEDDING_NAMES:
                raise NotAStack(
                    f"layer {name!r} comes before the decoder layers ({names[first]!r} ...) and is not an "
                    f"embedding (names ending in {', '.join(sorted(EMBEDDING_NAMES))})"
                )
            units.append(Unit("embedding"))
        else:
            if _last(name) not in HEAD_NAMES:
                raise NotAStack(
                    f"layer {name!r} comes after the decoder layers (... {names[last]!r}) and is not part "
                    f"of a head (names ending in {', '.join(sorted(HEAD_NAMES))})"
                )
            units.append(Unit("head"))
    if not any(u.kind == "embedding" for u in units[:first]):
        raise NotAStack(f"no embedding layer before the first decoder layer {names[first]!r}")
    if not any(u.kind == "head" for u in units[last + 1 :]):
        raise NotAStack(f"no head layer (final norm, output layer) after the last decoder layer {names[last]!r}")
    return DecoderStack(tuple(units), container, len(seen))


def _placing(units: Sequence[Unit]) -> list[Unit]:
    return [u for u in units if u.kind != "parameterless"]


def split_point_ok(name: str) -> bool:
    """Whether ``torch.distributed.pipelining`` can cut right before layer ``name``: a module's
    second call (``name#1``) has no name of its own to give as a split point."""
    return "#" not in name


def _listing(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])} ... {', '.join(names[-2:])}"
