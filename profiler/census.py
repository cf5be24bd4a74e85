"""The operation census of a layer: the GEMMs, attention and memory-bound kernels one forward runs.

``LayerProfile.operations`` lists, per micro-batch size, the operations of one forward of the
layer (:class:`planner.schema.Operation`); the device model (:mod:`planner.cost.compute`) prices
them on devices, micro-batch sizes and tensor-parallel degrees that were not measured.  This
module records them: one forward of the unit runs under a dispatch mode that sees every ATen
operator below autograd (:mod:`profiler._torch_dispatch`, the private API), as the profiler runs
it in training (train mode, autograd on: kernel choices that depend on it match), and maps each
operator call to an operation:

* **GEMM** ``C[m, n] = A[m, k] B[k, n]``, ``batch`` of them: ``mm``, ``addmm`` (and
  ``_addmm_activation``), ``bmm``, ``baddbmm``, ``addbmm``; ``mv`` / ``addmv`` as ``n = 1``.
  ``m`` is the rows of the output: for a linear layer torch flattens the leading dimensions of
  a ``[b, s, h]`` input into ``b·s`` rows before the product (``view``, ``t``, ``addmm``), so
  ``m`` is the token dimension, as the census's convention wants; ``k`` the inner dimension,
  ``n`` the columns (a linear layer's output features: ``B`` is the weight).  A linear layer's
  bias rides in ``addmm`` (``beta·bias + A B``, added in the product's epilogue): it is no
  operation of its own.  ``bmm`` is a batch of products with ``batch`` its leading dimension
  (materialised attention: ``q k^T`` is ``batch = b·heads``, ``m = query length``, ``n = key
  length``, ``k = head_dim``; there ``m`` stays the sequence, the micro-batch grows ``batch``).
  ``dtype``: the operands' (``float32``, ``bfloat16``, ``float16``).
* **convolution** (``aten.convolution``) as the implicit GEMM cuDNN and oneDNN run: per group
  (``batch = groups``), ``m = N·H_out·W_out`` (one row per output pixel: the token dimension,
  it grows with the micro-batch), ``n = C_out / groups``, ``k = C_in / groups · kh·kw`` (any
  number of spatial dimensions).  Per group, not ``n = C_out``: the FLOPs ``2·m·n·k·batch`` are
  then exactly torch's own count (``torch.utils.flop_counter``).  A transposed convolution is
  the input gradient of one: ``m = N·H_in·W_in``, ``n = C_out / groups · kh·kw``,
  ``k = C_in / groups``.  A depthwise convolution is ``groups`` products of ``n = 1``.
* **attention**, a fused kernel: ``_scaled_dot_product_flash_attention_for_cpu`` (what
  ``F.scaled_dot_product_attention`` runs on CPU), the CUDA flash, memory-efficient and cuDNN
  kernels (query ``[batch, heads, query_len, head_dim]``, key ``[batch, kv_heads, key_len,
  head_dim]``: ``heads`` are the query's, grouped-query attention shares keys but does the
  work of every query head), and ``_flash_attention_forward`` / ``_efficient_attention_forward``
  called directly (``[batch, len, heads, head_dim]``; variable-length batches one operation per
  sequence).  ``causal`` is the kernel's ``is_causal`` (``custom_mask_type`` for the
  memory-efficient one); a kernel given an explicit mask, causal or not, is ``causal = False``
  (it does not skip the masked blocks).  ``fused = True``.  A model that materialises attention
  (``q @ k^T``, softmax, ``@ v``: the zoo GPT, Hugging Face's ``eager`` attention) is recorded as
  what it runs: its two ``bmm`` GEMMs and the memory-bound scale, mask and softmax.
* **memory** for every other operator that produces tensors (elementwise, norms, softmax,
  dropout, embedding, casts, copies, residual adds, the loss): ``bytes`` = its tensor inputs read
  plus its outputs written.  An input counts its distinct elements (a broadcast, stride-0
  dimension once); a gather (``embedding``, ``index_select``, ``index``, ``gather``, ``take``)
  reads the rows it returns, not its whole table; an operator that overwrites its first argument
  without reading it (``copy_``, ``fill_``, ``zero_``, the random fills) does not count it as
  read; an in-place operator counts what it reads and writes once each.
* **nothing** for views and metadata (``view``, ``_unsafe_view``, ``t``, ``transpose``,
  ``expand``, ``permute``, ``slice``, ``select``, ``detach``, ``alias``, ...: every operator whose
  result aliases an input without writing it), for allocation without writing (``empty*``,
  ``resize_``), for operators that return no tensor (``item``, sizes), and for operators that
  move no bytes (tensors without elements).

Identical operations are merged into one entry with ``count`` (a transformer block is 10 to 20
entries, not the hundred-odd operator calls it makes), in the order they first ran.  An
operator whose arguments the census cannot read (a subclass tensor without strides, symbolic
sizes) is recorded as a memory operation when its bytes can be read, else counted in
:attr:`Census.unread`; the forward itself is never changed.

**Tensor-parallel roles** (``tp_shard``) are marked in the census of the units the profiler
shards (:func:`profiler.sharding.sharded_weights`: a transformer block, a column-parallel LM
head), by following the data through the forward, as Megatron-LM splits a block (and the
runtime, :mod:`runtime.mesh`, shards it): a GEMM whose B operand is one of the block's
projection weights (an ``nn.Linear``'s, seen transposed, ``n`` = out features; a ``Conv1D``'s
``[in, nf]`` as it is) is *column-parallel* (``n``) when its input A is whole -- attention's
Q, K and V or fused ``c_attn``, the MLP's up, gate, ``fc1`` -- and its output is sharded;
it is *row-parallel* (``k``) when its input is sharded -- attention's output projection, the
MLP's down or ``fc2`` -- and its output is whole again (partial sums, all-reduced).  Between the
two, every operator that reads a sharded tensor (by storage: views included) writes a sharded
one and is marked: fused attention ``heads``, materialised attention's two batched products
(``q k^T`` and ``@ v``, ``batch`` = b·heads) ``heads`` on a GEMM (the group divides the batch,
:func:`planner.cost.compute.shard_operation`), memory-bound kernels (rotary embedding, the
scale, mask, softmax and dropout on the scores, the head reshapes, the activation function, the
gated product) ``bytes``.  Norms, residual adds and the dropout on the residual stream read
whole tensors and stay unset (replicated: sequence parallelism divides them,
``shard_operation(..., sequence_parallel=True)``).  A norm (a reduction along the last
dimension) that reads a column-parallel projection's whole features -- a tensor with as many
rows as the projection's output, where a per-head norm such as Qwen3's ``q_norm`` reads heads
times as many -- needs them whole: that projection stays replicated and the census records the
unit again without it, so DeepSeek's low-rank ``q_a_proj``/``kv_a_proj_with_mqa`` stay whole
and the up-projections after their norms are column-parallel, as Megatron-LM splits latent
attention.  A block holding routed experts (a
transformers experts module) gets no roles: its census stays as it was, the flat efficiency
scales it (:func:`planner.mesh.census_prices`).  A head marks its logits GEMM ``n`` only: the runtime gathers the
logits, the loss runs whole.  The roles are dropped (the unit's census records none) when they
do not hold: the unit's output still depends on a sharded tensor, a block without both column-
and row-parallel products, or a non-batched GEMM that is no projection reading a sharded tensor.
A vocabulary-parallel embedding's lookup writes the whole output on every device and any other
unit is replicated: neither carries roles.  Only the forward is recorded; the backward is priced
from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import torch
from torch import Tensor, nn

from planner.schema import Operation
from profiler import _torch_dispatch
from profiler._torch_fake import storage_key

#: the product's operands A and B, by operator name (``mv``'s B is a vector: n = 1)
_GEMM_OPERANDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "mm": ("self", "mat2"),
    "addmm": ("mat1", "mat2"),
    "_addmm_activation": ("mat1", "mat2"),
    "bmm": ("self", "mat2"),
    "baddbmm": ("batch1", "batch2"),
    "addbmm": ("batch1", "batch2"),
    "mv": ("self", "vec"),
    "addmv": ("mat", "vec"),
})
_GEMMS = _torch_dispatch.aten_overloads(_torch_dispatch.GEMM_OPS)
_CONVS = _torch_dispatch.aten_overloads(_torch_dispatch.CONV_OPS)
_ATTENTION = _torch_dispatch.aten_overloads(_torch_dispatch.ATTENTION_OPS)
_ATTENTION_BSHD = _torch_dispatch.aten_overloads(_torch_dispatch.ATTENTION_BSHD_OPS)
#: operators that read only the rows they return of their first argument
_GATHERS = frozenset({"embedding", "index_select", "index", "gather", "take"})
#: in-place operators that overwrite their first argument without reading it
_OVERWRITES = frozenset(
    {"copy_", "fill_", "zero_", "uniform_", "normal_", "bernoulli_", "random_", "exponential_"}
)
#: operators that allocate or alias without moving data (views are found from the schema)
_NO_DATA = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "_unsafe_view"}
)

#: an operation while counting: its fields as a hashable tuple of (name, value)
_Key = tuple[tuple[str, Any], ...]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the census's dtype names)."""
    return str(dtype).removeprefix("torch.")


def _tensors(value: Any) -> list[Tensor]:
    """The tensors of an operator's arguments or results (tensors, lists and tuples of them)."""
    out: list[Tensor] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, list | tuple):
            stack.extend(reversed(v))
    return out


def _read_bytes(t: Tensor) -> int:
    """Bytes of the distinct elements of ``t`` (a broadcast, stride-0 dimension counts once)."""
    if t.numel() == 0:
        return 0
    try:
        elements = math.prod(int(size) for size, stride in zip(t.shape, t.stride(), strict=True) if stride != 0)
    except (RuntimeError, NotImplementedError):  # no strides (sparse, nested): every element
        elements = t.numel()
    return int(elements) * t.element_size()


def _written_bytes(t: Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _key(kind: str, **fields: Any) -> _Key:
    return (("kind", kind), *sorted(fields.items()))


def _positive(*dims: int) -> bool:
    return all(d > 0 for d in dims)


# --------------------------------------------------------------------------- GEMM


def _gemm(func: Any, bound: dict[str, Any]) -> list[_Key]:
    a_name, b_name = _GEMM_OPERANDS[_torch_dispatch.operator_name(func)]
    a, b = bound[a_name], bound[b_name]
    if a.dim() == 3:  # batched: [batch, m, k] @ [batch, k, n]
        batch, m, k = (int(x) for x in a.shape)
        n = int(b.shape[2])
    else:  # [m, k] @ [k, n] (a vector B: n = 1)
        batch = 1
        m, k = (int(x) for x in a.shape)
        n = int(b.shape[1]) if b.dim() == 2 else 1
    if not _positive(m, n, k, batch):
        return []
    return [_key("gemm", m=m, n=n, k=k, batch=batch, dtype=dtype_name(a.dtype))]


def _convolution(bound: dict[str, Any], out: Tensor) -> list[_Key]:
    x, w = bound["input"], bound["weight"]
    groups = int(bound.get("groups", 1))
    window = math.prod(int(s) for s in w.shape[2:])
    if bound.get("transposed", False):  # weight [C_in, C_out / groups, *kernel]
        m = int(x.shape[0]) * math.prod(int(s) for s in x.shape[2:])
        n = int(w.shape[1]) * window
        k = int(w.shape[0]) // groups
    else:  # weight [C_out, C_in / groups, *kernel]
        m = int(out.shape[0]) * math.prod(int(s) for s in out.shape[2:])
        n = int(w.shape[0]) // groups
        k = int(w.shape[1]) * window
    if not _positive(m, n, k, groups):
        return []
    return [_key("gemm", m=m, n=n, k=k, batch=groups, dtype=dtype_name(x.dtype))]


# --------------------------------------------------------------------------- attention


def _attention_key(batch: int, heads: int, q: int, kv: int, d: int, causal: bool, dtype: torch.dtype) -> list[_Key]:
    if not _positive(batch, heads, q, kv, d):
        return []
    return [
        _key("attention", batch=batch, heads=heads, query_len=q, key_len=kv, head_dim=d,
             causal=bool(causal), fused=True, dtype=dtype_name(dtype))
    ]  # fmt: skip


def _attention(bound: dict[str, Any]) -> list[_Key]:
    """A fused kernel on ``[batch, heads, length, head_dim]`` (the ``_scaled_dot_product_*`` ones)."""
    q, k = bound["query"], bound["key"]
    b, h, lq, d = (int(x) for x in q.shape)
    return _attention_key(b, h, lq, int(k.shape[2]), d, bool(bound.get("is_causal", False)), q.dtype)


def _lengths(offsets: Any, longest: Any, count: int) -> list[int]:
    """Per-sequence lengths of a packed batch from its cumulative offsets (the longest, for
    each sequence, where the offsets cannot be read: fake or meta tensors)."""
    try:
        return [int(x) for x in offsets.diff().tolist()]
    except (RuntimeError, NotImplementedError):
        return [int(longest)] * count


def _attention_bshd(func: Any, bound: dict[str, Any]) -> list[_Key]:
    """``_flash_attention_forward`` / ``_efficient_attention_forward``: ``[batch, len, heads,
    head_dim]``, or ``[tokens, heads, head_dim]`` packed with cumulative sequence offsets."""
    q, k = bound["query"], bound["key"]
    if "is_causal" in bound:
        causal = bool(bound["is_causal"])
        offsets = (bound.get("cum_seq_q"), bound.get("cum_seq_k"))
        longest = (bound.get("max_q"), bound.get("max_k"))
    else:
        causal = int(bound.get("custom_mask_type", 0)) != 0
        offsets = (bound.get("cu_seqlens_q"), bound.get("cu_seqlens_k"))
        longest = (bound.get("max_seqlen_q"), bound.get("max_seqlen_k"))
    if offsets[0] is None or offsets[1] is None:
        b, lq, h, d = (int(x) for x in q.shape[-4:]) if q.dim() == 4 else (1, *(int(x) for x in q.shape))
        return _attention_key(b, h, lq, int(k.shape[-3]), d, causal, q.dtype)
    count = int(offsets[0].numel()) - 1
    h, d = int(q.shape[-2]), int(q.shape[-1])
    lens_q = _lengths(offsets[0], longest[0], count)
    lens_k = _lengths(offsets[1], longest[1], count)
    out: list[_Key] = []
    for lq, lk in zip(lens_q, lens_k, strict=True):
        out += _attention_key(1, h, lq, lk, d, causal, q.dtype)
    return out


# --------------------------------------------------------------------------- memory-bound


def _memory(func: Any, bound: dict[str, Any], out: Any) -> list[_Key]:
    name = _torch_dispatch.operator_name(func)
    inputs = _tensors(list(bound.values()))
    outputs = _tensors(out)
    if not outputs:
        return []
    first = next(iter(bound.values()), None)
    written = sum(_written_bytes(t) for t in outputs)
    read = 0
    for i, t in enumerate(inputs):
        if i == 0 and t is first and name in _OVERWRITES:
            continue
        if i == 0 and t is first and name in _GATHERS:
            read += written  # the rows gathered, not the table
            continue
        read += _read_bytes(t)
    if read + written == 0:
        return []
    floating = next((t for t in [*outputs, *inputs] if t.is_floating_point()), outputs[0])
    return [_key("memory", bytes=read + written, dtype=dtype_name(floating.dtype))]


# --------------------------------------------------------------------------- the census


def operations_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[_Key]:
    """The operations (as counting keys) of one ATen operator call (see the module docstring)."""
    if not _torch_dispatch.is_operator(func):
        return []
    name = _torch_dispatch.operator_name(func)
    if name in _NO_DATA or _torch_dispatch.returns_view(func):
        return []
    bound = _torch_dispatch.bind_arguments(func, args, kwargs)
    try:
        if func in _GEMMS:
            return _gemm(func, bound)
        if func in _CONVS:
            return _convolution(bound, _tensors(out)[0])
        if func in _ATTENTION:
            return _attention(bound)
        if func in _ATTENTION_BSHD:
            return _attention_bshd(func, bound)
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError, AttributeError):
        pass  # arguments this census cannot read: the bytes it moves, below
    return _memory(func, bound, out)


@dataclass(frozen=True)
class ShardedWeights:
    """The weights of a unit tensor parallelism shards, for the census's roles (module docstring):
    ``kind`` ``"block"`` (its projections, column- or row-parallel by where their input comes
    from) or ``"column-head"`` (the head's logits projection, gathered on its way out)
    (:func:`profiler.sharding.sharded_weights` finds them)."""

    kind: Literal["block", "column-head"]
    weights: tuple[Tensor, ...]


#: what a call is to the roles' data flow: a column- or row-parallel projection, an operator
#: reading a sharded tensor (inside the tensor-parallel region), or neither
_Place = Literal["column", "row", "sharded"] | None

#: operators that reduce along a dimension (the ``dim`` argument; all of them when it is None or
#: absent) or, for the norms, along the last ones: a norm of a column-parallel projection's
#: features needs them whole
_REDUCTIONS = frozenset({
    "mean", "sum", "var", "var_mean", "std", "std_mean", "amax", "amin", "logsumexp", "norm",
    "linalg_vector_norm", "_softmax", "_log_softmax",
})
_NORMS = frozenset({"native_layer_norm", "rms_norm", "_fused_rms_norm"})


def _reduces_last_dim(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], t: Tensor) -> bool:
    """Whether the call ``func(args)`` reduces its first argument ``t`` along its last dimension."""
    name = _torch_dispatch.operator_name(func)
    if name in _NORMS:
        return True
    if name not in _REDUCTIONS or t.dim() == 0:
        return False
    dims = _torch_dispatch.bind_arguments(func, args, kwargs).get("dim")
    if dims is None or (isinstance(dims, list | tuple) and len(dims) == 0):
        return True
    dims = list(dims) if isinstance(dims, list | tuple) else [dims]
    return any(isinstance(d, int) and d % t.dim() == t.dim() - 1 for d in dims)


class _Roles:
    """The tensor-parallel roles of one forward of a unit (see the module docstring): follows
    which tensors are sharded (by storage, views included) from the column-parallel projections
    to the row-parallel ones.  The sharded tensors are held until the census ends, so that a
    freed one's memory, reused by a replicated tensor, is not taken for it."""

    def __init__(self, sharded: ShardedWeights) -> None:
        self.kind = sharded.kind
        self.weights = {storage_key(w) for w in sharded.weights if w.numel() > 0}
        self.sharded: dict[int, Tensor] = {}
        #: per sharded storage: the column-parallel weight it comes from and that projection's rows
        #: (its output's elements / its features: a tensor of as many rows spans the features)
        self.origin: dict[int, tuple[int, int]] = {}
        self.seen: set[str] = set()
        #: why the roles do not hold (the census then records none), or None
        self.broken: str | None = None
        #: a column-parallel weight whose features a norm reads whole: it must stay replicated
        self.replicate: int | None = None

    def _is_sharded(self, t: Tensor) -> bool:
        return t.numel() > 0 and storage_key(t) in self.sharded

    def _norm_of_features(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The column-parallel weight whose whole features the call normalises (a low-rank
        down-projection's output into its norm, DeepSeek's ``q_a_layernorm``), or None: a
        reduction along the last dimension of a sharded tensor with as many rows as the
        projection's output (a per-head norm, Qwen3's ``q_norm``, has heads times as many)."""
        first = args[0] if args and isinstance(args[0], Tensor) else None
        if first is None or not self._is_sharded(first) or first.numel() == 0:
            return None
        weight, rows = self.origin.get(storage_key(first), (None, 0))
        if weight is None or first.numel() // max(1, first.shape[-1]) != rows:
            return None
        return weight if _reduces_last_dim(func, args, kwargs, first) else None

    def place(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> _Place:
        """Where one operator call is, and mark its outputs sharded when they are."""
        if not _torch_dispatch.is_operator(func):
            return None
        inputs = _tensors([list(args), list(kwargs.values())])
        place: _Place = None
        origin: tuple[int, int] | None = None
        if func in _GEMMS:
            bound = _torch_dispatch.bind_arguments(func, args, kwargs)
            a_name, b_name = _GEMM_OPERANDS[_torch_dispatch.operator_name(func)]
            a, b = bound[a_name], bound[b_name]
            if isinstance(b, Tensor) and b.numel() > 0 and storage_key(b) in self.weights:
                place = "row" if self.kind == "block" and self._is_sharded(a) else "column"
                outs = _tensors(out)
                if place == "column" and outs and outs[0].dim() > 0:
                    origin = (storage_key(b), outs[0].numel() // max(1, outs[0].shape[-1]))
        if place is None and any(self._is_sharded(t) for t in inputs):
            place = "sharded"
            weight = self._norm_of_features(func, args, kwargs) if self.kind == "block" else None
            if weight is not None:
                self.replicate = weight
                self.broken = "a norm reads a column-parallel projection's whole features"
            origin = next((self.origin[k] for t in inputs if (k := storage_key(t)) in self.origin), None)
        if place == "sharded" or (place == "column" and self.kind == "block"):
            for t in _tensors(out):
                if t.numel() > 0:
                    self.sharded[storage_key(t)] = t
                    if origin is not None:
                        self.origin.setdefault(storage_key(t), origin)
        return place

    def role(self, key: _Key, place: _Place) -> str | None:
        """The ``tp_shard`` of one operation of a call at ``place`` (None: replicated)."""
        if place is None:
            return None
        fields = dict(key)
        kind = fields["kind"]
        if place in ("column", "row"):
            if kind != "gemm":
                self.broken = f"a projection ran as a {kind} operation"
                return None
            self.seen.add(place)
            return "n" if place == "column" else "k"
        if kind == "attention":
            return "heads"
        if kind == "memory":
            return "bytes"
        if int(fields.get("batch", 1)) > 1:  # materialised attention's q k^T and @ v: b·heads products
            return "heads"
        self.broken = f"a GEMM of m={fields.get('m')} n={fields.get('n')} k={fields.get('k')} on a sharded tensor is no projection"
        return None

    def finish(self, output: Any) -> None:
        """Check the unit's ``output`` is whole (a row-parallel projection ended every sharded
        path) and that the projections were found: else the roles do not hold."""
        if self.broken is not None:
            return
        outputs = list(output.values()) if isinstance(output, Mapping) else output  # (a ModelOutput too)
        if any(self._is_sharded(t) for t in _tensors(outputs)):
            self.broken = "the unit's output depends on a sharded tensor without a row-parallel projection"
        elif self.kind == "block" and self.seen != {"column", "row"}:
            self.broken = f"found only {sorted(self.seen) or 'no'} projections"
        elif self.kind == "column-head" and "column" not in self.seen:
            self.broken = "the head's projection did not run as a GEMM"


def _with_role(key: _Key, role: str) -> _Key:
    return (key[0], *sorted((*key[1:], ("tp_shard", role))))


class Census:
    """The operations one forward runs, merged (see the module docstring).

    ``with census.recording(): unit(*inputs)`` records; :meth:`operations` returns them.  With
    ``sharded`` (the unit's :class:`ShardedWeights`) the operations carry their tensor-parallel
    roles; call :meth:`finish` with the unit's output before :meth:`operations`."""

    def __init__(self, *, sharded: ShardedWeights | None = None) -> None:
        self._counts: dict[_Key, int] = {}
        self._roles = _Roles(sharded) if sharded is not None else None
        #: operator calls whose arguments could not be read at all (nothing recorded for them)
        self.unread = 0

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Count the operations of one operator call (what the dispatch mode calls)."""
        place: _Place = None
        if self._roles is not None and self._roles.broken is None:
            try:
                place = self._roles.place(func, args, kwargs, out)
            except Exception as err:  # never break the forward: no roles for this unit
                self._roles.broken = f"{type(err).__name__} following the sharded tensors"
        try:
            keys = operations_of(func, args, kwargs, out)
        except Exception:  # never break the forward: count what could not be read
            self.unread += 1
            return
        for key in keys:
            role = self._roles.role(key, place) if self._roles is not None else None
            key = _with_role(key, role) if role is not None else key
            self._counts[key] = self._counts.get(key, 0) + 1

    def recording(self) -> Any:
        """A dispatch mode (a context manager) that records every operator call inside it."""
        base = _torch_dispatch.dispatch_mode()
        record = self.record

        class CensusMode(base):  # type: ignore[misc, valid-type]
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                record(func, args, kwargs, out)
                return out

        return CensusMode()

    def finish(self, output: Any) -> None:
        """The unit's forward ``output``: checks the roles hold (else none are recorded) and
        lets go of the sharded tensors."""
        if self._roles is not None:
            self._roles.finish(output)
            self._roles.sharded.clear()
            self._roles.origin.clear()

    @property
    def replicate(self) -> int | None:
        """The storage of a column-parallel weight the roles found must stay replicated (its
        whole features are normalised), or None: :func:`census` records again without it."""
        return None if self._roles is None else self._roles.replicate

    @property
    def roles_dropped(self) -> str | None:
        """Why the census records no tensor-parallel roles although given ``sharded``, or None."""
        return None if self._roles is None else self._roles.broken

    def operations(self) -> list[Operation]:
        """The operations recorded so far, identical ones merged into ``count``, in first-run order
        (without roles when they do not hold, :attr:`roles_dropped`)."""
        counts = self._counts
        if self._roles is not None and self._roles.broken is not None:
            counts = {}
            for key, count in self._counts.items():
                plain = tuple(kv for kv in key if kv[0] != "tp_shard")
                counts[plain] = counts.get(plain, 0) + count
        return [Operation(count=count, **dict(key)) for key, count in counts.items()]


def census(
    unit: nn.Module,
    inputs: Sequence[Any],
    *,
    then: Callable[[Any], Any] | None = None,
    sharded: ShardedWeights | None = None,
) -> list[Operation]:
    """The operations of one forward of ``unit`` on ``inputs`` (as the profiler runs it: the
    unit's current mode, autograd on), and of ``then(output)`` when given (the loss, for the
    last unit, whose measured forward includes it); with ``sharded`` (the weights tensor
    parallelism shards in the unit, :func:`profiler.sharding.sharded_weights`) each operation
    carries its tensor-parallel role (the module docstring)."""
    while True:
        recorder = Census(sharded=sharded)
        with recorder.recording():
            out = unit(*inputs)
            recorder.finish(out)
            if then is not None:
                then(out)
        if sharded is None or recorder.replicate is None:
            return recorder.operations()
        # a low-rank down-projection (its output normalised whole) stays replicated, as Megatron
        # keeps DeepSeek's q_a/kv_a projections: record again with one sharded weight fewer
        kept = tuple(w for w in sharded.weights if w.numel() == 0 or storage_key(w) != recorder.replicate)
        if len(kept) == len(sharded.weights):
            return recorder.operations()
        sharded = ShardedWeights(sharded.kind, kept)


def gemm_flops(ops: Sequence[Operation]) -> float:
    """Forward FLOPs of a census: ``2·m·n·k·batch`` per GEMM and ``4·b·h·q·kv·d`` per attention
    (causal masking not discounted, as ``torch.utils.flop_counter`` counts it), times ``count``;
    memory-bound operations count none."""
    total = 0.0
    for op in ops:
        if op.kind == "gemm":
            assert op.m is not None and op.n is not None and op.k is not None
            total += 2.0 * op.m * op.n * op.k * op.batch * op.count
        elif op.kind == "attention":
            assert op.heads is not None and op.query_len is not None
            assert op.key_len is not None and op.head_dim is not None
            total += 4.0 * op.batch * op.heads * op.query_len * op.key_len * op.head_dim * op.count
    return total


__all__ = ["Census", "ShardedWeights", "census", "dtype_name", "gemm_flops", "operations_of"]
