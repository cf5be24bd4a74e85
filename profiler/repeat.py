"""Repeated blocks: trace one block of each kind, then copy its layer to the others.

A 70B decoder is 80 blocks that differ only in their weights' values, yet tracing it on fake
tensors (:mod:`profiler.fake`) costs the export and the reference passes of all 80.  Here the
model's stack of blocks (its largest ``nn.ModuleList`` of one class) is cut down, before the
trace, to the blocks that differ, and the traced profile is expanded back to every block:

* **what makes blocks differ** (:func:`block_signature`): the classes of a block's modules, their
  plain attributes (a sliding window, a head count, ``is_sliding``: everything but the layer's
  own index), the shapes and dtypes of its parameters and buffers, and every per-layer entry of
  the model's config (``layer_types[i]``, membership of ``i`` in ``mlp_only_layers``, ...);
* **which blocks are traced** (:func:`traced_blocks`): the first and the last block (whose
  inputs and cuts differ: the embedding before, the head after) and, of each kind found among
  the others with the same kinds after it, its first block.  Every block keeps its own ``layer_idx``, so code that reads the
  config by layer index still sees its own entry;
* **expanding** (:func:`expand`): block ``i`` gets the layer of the traced block of its kind and
  position (first, last, or between), renamed; the layers before and after the stack are kept.

Everything a fake profile records per layer depends on nothing but the layer's own computation
and the tensors crossing its cuts, which are the same for blocks of one kind between the first
and the last; the tests check the expanded profile equal to a full trace's, field for field, on
Llama, Gemma 2 (alternating sliding windows), Mixtral and a DeepSeek-style stack of dense then
MoE blocks.  Where the model's code does not allow it (a forward that indexes the full stack,
units that are not one block each), :class:`Truncation` is undone and the whole model is traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from planner.schema import Profile

#: a module's attributes that name its place in the stack, not what it computes
POSITION_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "idx", "training"})
#: stacks shorter than this are traced whole
MIN_BLOCKS = 4


class NotRepeatable(Exception):
    """The traced profile does not have one unit per traced block: trace the whole model."""


@dataclass
class Truncation:
    """A model whose stack of blocks was cut down to the traced ones (:func:`truncate`)."""

    parent: nn.Module
    attribute: str
    #: the stack's path in the model (``model.layers``)
    path: str
    full: nn.ModuleList
    #: the full stack's indices of the traced blocks, in order
    traced: list[int]
    #: per block of the full stack, the position in ``traced`` of the block whose layer it takes
    source: list[int]

    def restore(self) -> None:
        """Put the full stack back."""
        setattr(self.parent, self.attribute, self.full)


def _plain(value: Any) -> Any:
    """``value`` if it is a plain constant (numbers, strings, None, tuples of them), else a marker."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(x, (bool, int, float, str, type(None))) for x in value):
        return tuple(value)
    return _NOT_PLAIN


_NOT_PLAIN = object()


def block_signature(block: nn.Module, index: int, *, config: Any = None, blocks: int = 0) -> tuple[Any, ...]:
    """What block ``index`` computes, as far as its modules and the config can tell (module doc)."""
    items: list[Any] = []
    for name, module in block.named_modules():
        attrs = []
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or key in POSITION_ATTRIBUTES:
                continue
            plain = _plain(value)
            if plain is not _NOT_PLAIN:
                attrs.append((key, plain))
        items.append((name, type(module).__module__, type(module).__qualname__, tuple(attrs)))
    for name, t in [*block.named_parameters(), *block.named_buffers()]:
        items.append((name, tuple(t.shape), str(t.dtype), bool(t.requires_grad)))
    if config is not None:
        for key, value in sorted(vars(config).items()):
            if not isinstance(value, (list, tuple)) or not value:
                continue
            if len(value) == blocks:
                items.append(("config", key, repr(value[index])))
            elif all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                items.append(("config-member", key, index in value))
    return tuple(items)


def find_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's stack of blocks: its only largest ``nn.ModuleList`` whose children are all of
    one class, with at least :data:`MIN_BLOCKS` of them (None: none, or two of that size, as an
    encoder-decoder's)."""
    found = [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) >= MIN_BLOCKS and len({type(c) for c in m}) == 1
    ]
    if not found:
        return None
    size = max(len(m) for _, m in found)
    largest = [(n, m) for n, m in found if len(m) == size]
    if len(largest) != 1 or not largest[0][0]:
        return None
    return largest[0]


def traced_blocks(signatures: Sequence[Any]) -> tuple[list[int], list[int]]:
    """The indices to trace and, per block, the position (in that list) of the block whose
    layer it takes.

    A block's layer depends on its kind and on the kinds after it (the tensors its cuts carry
    on: Gemma 2's sliding-window mask stops crossing cuts after the last sliding block), so each
    block between the first and the last takes the layer of the first block with the same kind
    and the same kinds after it.  The traced blocks are the first, the last and those; where a
    traced block would then see fewer kinds after it than in the whole stack, the last block of
    each missing kind is traced too."""
    n = len(signatures)
    ids = {s: k for k, s in enumerate(dict.fromkeys(signatures))}
    kind = [ids[s] for s in signatures]
    key = [(kind[i], frozenset(kind[i + 1:])) for i in range(n)]
    first: dict[Any, int] = {}
    for i in range(1, n - 1):
        first.setdefault(key[i], i)
    traced = {0, n - 1, *first.values()}
    while True:
        order = sorted(traced)
        missing = {
            max(j for j in range(i + 1, n) if kind[j] == k)
            for p, i in enumerate(order)
            for k in key[i][1] - {kind[j] for j in order[p + 1:]}
        }
        if not missing:
            break
        traced |= missing
    position = {i: p for p, i in enumerate(order)}
    return order, [position[i] if i in traced else position[first[key[i]]] for i in range(n)]


def truncate(model: nn.Module) -> Truncation | None:
    """Cut the model's stack down to the blocks to trace, in place (None: nothing to gain)."""
    stack = find_stack(model)
    if stack is None:
        return None
    path, full = stack
    config = getattr(model, "config", None)
    signatures = [block_signature(b, i, config=config, blocks=len(full)) for i, b in enumerate(full)]
    traced, source = traced_blocks(signatures)
    if len(traced) >= len(full):
        return None
    parent_path, _, attribute = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attribute, nn.ModuleList([full[i] for i in traced]))
    return Truncation(parent, attribute, path, full, traced, source)


def _rename(name: str, path: str, position: int, index: int) -> str:
    """``name`` of traced block ``position`` (or a module in it) as block ``index``'s."""
    old = f"{path}.{position}"
    if name == old:
        return f"{path}.{index}"
    if name.startswith(old + "."):
        return f"{path}.{index}" + name[len(old):]
    return name


def expand(profile: Profile, cut: Truncation) -> Profile:
    """The profile of the full stack from the traced one (module doc); raises
    :class:`NotRepeatable` unless the traced blocks are one unit each, in order."""
    names = [x.name for x in profile.layers]
    blocks = [f"{cut.path}.{p}" for p in range(len(cut.traced))]
    try:
        start = names.index(blocks[0])
    except ValueError:
        raise NotRepeatable(f"no layer named {blocks[0]!r}") from None
    if names[start:start + len(blocks)] != blocks:
        raise NotRepeatable(f"the traced blocks are not one layer each: {names[start:start + len(blocks)]}")
    meta = dict(profile.metadata.get("profiler", {}))
    anchors = meta.get("anchors")
    if anchors is not None and [list(a) for a in anchors[start:start + len(blocks)]] != [[b] for b in blocks]:
        raise NotRepeatable("a traced block's layer holds other modules")
    shared = meta.get("shared_parameters", [])
    if any(start <= unit < start + len(blocks) for group in shared for unit, _ in group):
        raise NotRepeatable("a block shares parameters")
    if any(b in p for p in profile.split_points for b in blocks):
        raise NotRepeatable("split points name blocks")
    before, after = profile.layers[:start], profile.layers[start + len(blocks):]
    layers = [
        profile.layers[start + p].model_copy(update={"name": f"{cut.path}.{i}"})
        for i, p in enumerate(cut.source)
    ]
    if anchors is not None:
        meta["anchors"] = [
            *anchors[:start],
            *[[_rename(a, cut.path, p, i) for a in anchors[start + p]] for i, p in enumerate(cut.source)],
            *anchors[start + len(blocks):],
        ]
    grown = len(cut.source) - len(blocks)  # the layers after the stack move this far
    meta["shared_parameters"] = [[[unit + grown if unit >= start else unit, name] for unit, name in g] for g in shared]
    meta["repeated_blocks"] = {
        "stack": cut.path,
        "blocks": len(cut.source),
        "traced": list(cut.traced),
        "note": "blocks of one kind share the layer of the first traced (profiler/repeat.py)",
    }
    return profile.model_copy(update={
        "layers": [*before, *layers, *after],
        "metadata": {**profile.metadata, "profiler": meta},
    })


__all__ = ["NotRepeatable", "Truncation", "block_signature", "expand", "find_stack", "traced_blocks", "truncate"]
