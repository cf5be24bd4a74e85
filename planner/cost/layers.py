"""Per-layer costs at one micro-batch size, read from a profile.

Every per-layer quantity of a profile is measured at a few micro-batch sizes;
:mod:`planner.scaling` fits each series to what physics allows (non-negative, non-decreasing,
cost per sample non-increasing) and reads it at the size a plan needs.  :class:`LayerCosts`
holds the result with prefix sums, so a stage's sums cost O(1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from planner import scaling
from planner.cost.compute import DTYPE_BYTES, SizeRatios, census_ratios, scale_measured
from planner.schema import LayerProfile, Profile

#: profile metadata key of the original structure fingerprint (a profile rescaled by
#: :func:`profile_in_dtype` or transformed for a mesh keeps its model's fingerprint)
SHA_KEY = "rescaled_from_structure_sha256"


def interpolate(sizes: Sequence[int], values: Sequence[float], b: float, *, clamp: bool = True) -> float:
    """Value at micro-batch size ``b`` of one series measured at ``sizes``: the physical fit
    (:func:`planner.scaling.at_size`), or with ``clamp=False`` a signed correction read
    linearly (:func:`planner.scaling.linear`)."""
    return scaling.at_size(sizes, values, b) if clamp else scaling.linear(sizes, values, b)


@dataclass(frozen=True)
class LayerCosts:
    """Every layer's costs at one micro-batch size, with prefix sums for O(1) stage sums.

    ``prefix_x[i]`` is the sum of ``x`` over layers ``0..i-1``, so a stage ``[a, b)`` costs
    ``prefix_x[b] - prefix_x[a]``.
    """

    microbatch_size: int
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    #: input- and weight-gradient parts of the backward (split-backward schedules)
    input_ms: tuple[float, ...]
    weight_ms: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    #: bytes held between the input and the weight gradient
    weight_grad_bytes: tuple[float, ...]
    param_bytes: tuple[int, ...]
    #: bytes crossing a cut right after each layer
    cut_bytes: tuple[float, ...]
    #: bytes of the model input
    input_bytes: float
    prefix_forward: tuple[float, ...]
    prefix_backward: tuple[float, ...]
    prefix_activation: tuple[float, ...]
    prefix_param: tuple[int, ...]
    #: per layer: (offset, bytes) a stage starting there keeps of its own inputs once it
    #: reaches layer + offset (``LayerProfile.kept_inputs``); empty tuples when not profiled
    kept_inputs: tuple[tuple[tuple[int, float], ...], ...] = ()
    #: how far below the plain prefix sums a stage's activations can fall (the most negative
    #: ``kept_inputs`` of any start, as a positive number; 0 for almost every profile): the
    #: solver's prefix-sum memory bounds subtract it, or step aside, to stay valid
    activation_slack: float = 0.0
    prefix_input: tuple[float, ...] = ()
    prefix_weight: tuple[float, ...] = ()
    prefix_weight_grad: tuple[float, ...] = ()
    #: prefix sums of each layer's cheaper of backward and input gradient (what can carry a
    #: gradient through it), and the least forward share f / (f + b) of any layer
    prefix_grad: tuple[float, ...] = ()
    #: prefix sums of ``cut_bytes`` (the inputs of checkpointed layers after a chunk's first)
    prefix_cut: tuple[float, ...] = ()
    min_forward_share: float = 0.0
    #: every layer has parameters (then every pipeline rank all-reduces some gradient bytes)
    params_in_every_layer: bool = False
    #: the forward a recompute re-runs in the backward, per layer (its forward less
    #: ``forward_not_recomputed_ms``: ZeRO-3's gather), and its prefix sums (:func:`layer_costs`)
    recompute_ms: tuple[float, ...] = ()
    prefix_recompute: tuple[float, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.forward_ms)

    def stage_activation_bytes(self, start: int, stop: int) -> float:
        """Bytes a stage ``[start, stop)`` keeps for backward per micro-batch, run as one module.

        The layers' ``activation_bytes`` count each saved tensor once, on the first layer that
        saves it; a stage that starts after a cut also keeps the inputs it receives when its
        layers save them (``kept_inputs``).
        """
        acts = self.prefix_activation[stop] - self.prefix_activation[start]
        if self.kept_inputs and start > 0:
            acts += sum(nbytes for offset, nbytes in self.kept_inputs[start] if start + offset < stop)
        return max(0.0, acts)

    def stage_input_bytes(self, start: int) -> float:
        """Bytes a stage starting at layer ``start`` receives per micro-batch (what its first
        checkpointed layer keeps)."""
        return self.input_bytes if start == 0 else self.cut_bytes[start - 1]

    def checkpoint_bytes(self, start: int, stop: int, layers: int | None = None) -> float:
        """Bytes a chunk ``[start, stop)`` keeps per micro-batch when its first ``layers`` layers
        (default: all; :meth:`checkpointed`) are checkpointed one by one, as Megatron, torchtitan
        and DeepSpeed do.

        A checkpointed layer keeps only its input: the stage's input for the first, for each
        later one what crosses a cut right before it (``cut_bytes``: its input with any skip
        connections).  The layers after the checkpointed ones keep their activations.  A tensor
        two checkpoints share (a skip connection) is counted at each: an upper bound there.

        The model's last layer keeps its activations even when checkpointed: its loss holds the
        float32 log-probabilities for the backward whatever the layer re-runs (measured with
        saved-tensor hooks on the runtime's last stage; the profile counts them in the layer).
        """
        n = stop - start if layers is None else max(0, min(layers, stop - start))
        if n == 0:
            return self.stage_activation_bytes(start, stop)
        inputs = self.stage_input_bytes(start) + self.prefix_cut[start + n - 1] - self.prefix_cut[start]
        rest = self.prefix_activation[stop] - self.prefix_activation[start + n] if start + n < stop else 0.0
        loss = self.activation_bytes[-1] if start + n == self.num_layers else 0.0
        return inputs + max(0.0, rest) + loss

    def rematerialised_bytes(self, start: int, stop: int, layers: int | None = None) -> float:
        """Bytes a chunk's backward adds to what :meth:`checkpoint_bytes` keeps: one checkpointed
        layer re-materialised at a time, its largest, less the activations of the layers after
        the checkpointed ones, which their backward frees before any checkpointed layer re-runs."""
        n = stop - start if layers is None else max(0, min(layers, stop - start))
        if n == 0:
            return 0.0
        rest = self.prefix_activation[stop] - self.prefix_activation[start + n]
        return max(0.0, self.max_activation(start, start + n) - max(0.0, rest))

    def max_activation(self, start: int, stop: int) -> float:
        """The largest one layer's activation bytes in ``[start, stop)`` (0 when empty): what a
        checkpointed chunk re-materialises at once in its backward.  O(1) from a sparse table."""
        if stop <= start:
            return 0.0
        table = self._max_table
        level = (stop - start).bit_length() - 1
        return max(table[level][start], table[level][stop - (1 << level)])

    @cached_property
    def _max_table(self) -> list[list[float]]:
        """``table[j][i]``: the largest activation of layers ``i .. i + 2**j - 1``."""
        table = [list(self.activation_bytes)]
        width = 1
        while 2 * width <= len(self.activation_bytes):
            prev = table[-1]
            table.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
            width *= 2
        return table


def _census_ratios(profile: Profile, b: int) -> list[SizeRatios | None]:
    """:func:`planner.cost.compute.census_ratios`, one None per layer where it has none."""
    return census_ratios(profile, b) or [None] * profile.num_layers


def _times_at(
    profile: Profile, b: int, ratios: Sequence[SizeRatios | None] | None = None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Every layer's forward and backward time at micro-batch size ``b``: the fitted measured
    series, read between the measured sizes; outside them scaled from the nearest measured size
    by the device model's prices of the layer's census (``ratios``, default
    :func:`planner.cost.compute.census_ratios`), or linearly for a layer without one."""
    sizes = profile.microbatch_sizes
    rs = _census_ratios(profile, b) if ratios is None else ratios
    fwd, bwd = [], []
    # a stack's identical blocks (synth's, a repeated fake-tensor block) are read once
    seen: dict[tuple[object, ...], tuple[float, float]] = {}
    for x, r in zip(profile.layers, rs, strict=True):
        key = (tuple(x.forward_ms), None if x.forward_ms_spread is None else tuple(x.forward_ms_spread),
               tuple(x.backward_ms), None if x.backward_ms_spread is None else tuple(x.backward_ms_spread), r)
        got = seen.get(key)
        if got is None:
            if r is None:
                got = (scaling.at_size(sizes, x.forward_ms, b, spread=x.forward_ms_spread),
                       scaling.at_size(sizes, x.backward_ms, b, spread=x.backward_ms_spread))
            else:
                f0 = scaling.at_size(sizes, x.forward_ms, r.b0, spread=x.forward_ms_spread)
                b0 = scaling.at_size(sizes, x.backward_ms, r.b0, spread=x.backward_ms_spread)
                got = (scale_measured(f0, r.forward, b, r.b0), scale_measured(b0, r.backward, b, r.b0))
            seen[key] = got
        fwd.append(got[0])
        bwd.append(got[1])
    return tuple(fwd), tuple(bwd)


def extrapolation_note(profile: Profile, b: int) -> str | None:
    """A sentence for plans whose micro-batch size ``b`` lies outside the measured sizes, else
    None: beyond them :func:`planner.scaling.extrapolation_note` (how to measure it instead), which
    also says when the layer times were read through the device model's census prices (read
    linearly otherwise: no census, or no device model); below them only when the device model
    read them (linearly, along the first measured segment, as ever, otherwise)."""
    sizes = profile.microbatch_sizes
    if min(sizes) <= b <= max(sizes):
        return None
    ratios = _census_ratios(profile, b)
    priced = sum(r is not None for r in ratios)
    how = "by the device model's prices of each layer's operation census" + (
        "" if priced == len(ratios) else f" ({priced} of {len(ratios)} layers; the others linearly)")
    if b < min(sizes):
        return f"micro-batch {b} is scaled down from size {min(sizes)} {how}" if priced else None
    note = scaling.extrapolation_note(sizes, b)
    if note is None or not priced:
        return note
    head, _, tail = note.partition("; ")
    return f"{head} {how}; {tail}"


def layer_costs(profile: Profile, microbatch_size: int) -> LayerCosts:
    """Interpolate every layer of ``profile`` at ``microbatch_size``."""
    sizes = profile.microbatch_sizes
    b = microbatch_size
    ratios = _census_ratios(profile, b)
    fwd, bwd = _times_at(profile, b, ratios)
    act = tuple(interpolate(sizes, layer.activation_bytes, b) for layer in profile.layers)
    cut = tuple(interpolate(sizes, layer.transfer_bytes(), b) for layer in profile.layers)
    params = tuple(layer.param_bytes for layer in profile.layers)
    inp = interpolate(sizes, profile.input_bytes, b) if profile.input_bytes else 0.0
    kept: tuple[tuple[tuple[int, float], ...], ...] = ()
    if any(layer.kept_inputs for layer in profile.layers):
        kept = tuple(
            tuple((k.offset, interpolate(sizes, k.bytes, b, clamp=False)) for k in layer.kept_inputs or ())
            for layer in profile.layers
        )
    split = [split_backward(sizes, layer, b, total, ratio=r)
             for layer, total, r in zip(profile.layers, bwd, ratios, strict=True)]
    bin_ = tuple(x for x, _ in split)
    bwt = tuple(y for _, y in split)
    wgrad = tuple(
        interpolate(sizes, layer.weight_grad_bytes, b) if layer.weight_grad_bytes is not None else a
        for layer, a in zip(profile.layers, act, strict=True)
    )
    redo = tuple(
        f if layer.forward_not_recomputed_ms is None
        else min(f, max(0.0, f - interpolate(sizes, layer.forward_not_recomputed_ms, b)))
        for layer, f in zip(profile.layers, fwd, strict=True)
    )
    return LayerCosts(
        microbatch_size=b,
        forward_ms=fwd,
        backward_ms=bwd,
        input_ms=bin_,
        weight_ms=bwt,
        activation_bytes=act,
        weight_grad_bytes=wgrad,
        param_bytes=params,
        cut_bytes=cut,
        input_bytes=inp,
        prefix_forward=_prefix(fwd),
        prefix_backward=_prefix(bwd),
        prefix_activation=_prefix(act),
        prefix_param=tuple(int(x) for x in _prefix(params)),
        kept_inputs=kept,
        activation_slack=max((-sum(min(0.0, n) for _, n in entries) for entries in kept), default=0.0),
        prefix_input=_prefix(bin_),
        prefix_weight=_prefix(bwt),
        prefix_weight_grad=_prefix(wgrad),
        prefix_grad=_prefix([min(x, y) for x, y in zip(bwd, bin_, strict=True)]),
        prefix_cut=_prefix(cut),
        min_forward_share=min((f / (f + b_) for f, b_ in zip(fwd, bwd, strict=True) if f + b_ > 0), default=0.0),
        params_in_every_layer=all(p > 0 for p in params),
        recompute_ms=redo,
        prefix_recompute=_prefix(redo),
    )


def split_backward(
    sizes: Sequence[int], layer: LayerProfile, b: int, backward: float, *, ratio: SizeRatios | None = None
) -> tuple[float, float]:
    """A layer's (input-gradient, weight-gradient) ms at micro-batch size ``b``.

    With ``ratio`` (``b`` outside the measured sizes, the layer priced by the device model) each
    measured part is read at the measured size ``ratio.b0`` and scaled by its own ratio.

    Profiles that measured the split give it (each part fitted like every series); a profile
    that gives one part gets the other as the rest of ``backward``; older profiles without
    either split the backward in half (a matrix product's two gradients cost the same).
    The two parts never sum to less than the backward: when measured parts do, both are
    scaled up to it (so a split backward is never cheaper than the whole one, and every
    bound that counts a backward as work holds for split schedules too).
    """
    if layer.backward_input_ms is None and layer.backward_weight_ms is None:
        return backward / 2, backward / 2
    def part(series: Sequence[float], scale: float) -> float:
        if ratio is None:
            return scaling.at_size(sizes, series, b)
        return scale_measured(scaling.at_size(sizes, series, ratio.b0), scale, b, ratio.b0)

    if layer.backward_input_ms is not None and layer.backward_weight_ms is not None:
        i = part(layer.backward_input_ms, ratio.backward_input if ratio else 1.0)
        w = part(layer.backward_weight_ms, ratio.backward_weight if ratio else 1.0)
    elif layer.backward_input_ms is not None:
        i = min(backward, part(layer.backward_input_ms, ratio.backward_input if ratio else 1.0))
        w = backward - i
    else:
        assert layer.backward_weight_ms is not None
        w = min(backward, part(layer.backward_weight_ms, ratio.backward_weight if ratio else 1.0))
        i = backward - w
    if i + w < backward:
        if i + w <= 0:
            return backward / 2, backward / 2
        scale = backward / (i + w)
        i, w = i * scale, w * scale
    return i, w



def profile_in_dtype(profile: Profile, dtype: str | None) -> Profile:
    """``profile`` with its memory in the bytes of a run in ``dtype`` (the memory-by-dtype hook).

    A run in ``dtype`` computes under autocast with float32 master weights, gradients and
    optimizer state.  So each layer's ``activation_bytes`` and ``kept_inputs`` are scaled by
    ``bytes(dtype) / bytes(profile dtype)`` and its ``param_bytes`` by ``4 / bytes(profile
    dtype)``.  What crosses a cut (``output_bytes``, ``cut_bytes``, ``input_bytes``) and the
    times keep the profile's values.  ``dtype`` ``None``, a float32 profile for a float32 run,
    or a profile this function made already: ``profile`` itself.  The element-size ratio is a simplification: autocast keeps
    normalisation, softmax and residual streams in float32 and saves 16-bit copies of the
    weights, so a float32 GPT profile run in bfloat16 keeps about 0.67 of its bytes, not 0.5
    (see the README).  The result keeps the original's structure fingerprint (:func:`structure_sha`).
    """
    src = profile.measured_on.dtype
    if dtype is None or src not in DTYPE_BYTES or SHA_KEY in profile.metadata:
        return profile  # nothing asked, an unknown dtype, or rescaled already
    act = DTYPE_BYTES[dtype] / DTYPE_BYTES[src]
    par = DTYPE_BYTES["float32"] / DTYPE_BYTES[src]
    if act == 1 and par == 1:
        return profile
    layers = [
        layer.model_copy(
            update={
                "param_bytes": round(layer.param_bytes * par),
                "activation_bytes": [round(x * act) for x in layer.activation_bytes],
                "weight_grad_bytes": None
                if layer.weight_grad_bytes is None
                else [round(x * act) for x in layer.weight_grad_bytes],
                "kept_inputs": None
                if layer.kept_inputs is None
                else [k.model_copy(update={"bytes": [round(x * act) for x in k.bytes]}) for k in layer.kept_inputs],
                # the tensor-parallel split of those bytes scales with them, and so do the experts'
                # share of the parameters and the tokens their all-to-alls move
                "tp_param_bytes": None if layer.tp_param_bytes is None else round(layer.tp_param_bytes * par),
                "moe": None if layer.moe is None else layer.moe.model_copy(update={
                    "expert_param_bytes": round(layer.moe.expert_param_bytes * par),
                    "dispatch_bytes": [round(x * act) for x in layer.moe.dispatch_bytes],
                }),
                **{
                    key: None if getattr(layer, key) is None else [round(x * act) for x in getattr(layer, key)]
                    for key in ("tp_replicated_activation_bytes", "sp_replicated_activation_bytes",
                                "selective_recompute_bytes")
                },
            }
        )
        for layer in profile.layers
    ]
    return profile.model_copy(
        update={
            "layers": layers,
            "measured_on": profile.measured_on.model_copy(update={"dtype": dtype}),
            "metadata": {**profile.metadata, SHA_KEY: structure_sha(profile)},
        }
    )


def structure_sha(profile: Profile) -> str:
    """The structure fingerprint of the model ``profile`` measured (that of the original
    profile when it was rescaled by :func:`profile_in_dtype`)."""
    sha = profile.metadata.get(SHA_KEY)
    return sha if isinstance(sha, str) else profile.sha256()


def _prefix(values: Sequence[float]) -> tuple[float, ...]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)
