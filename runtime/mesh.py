"""The device mesh of a plan and what each axis does to a stage module (needs torch).

Axes, ordered like torchtitan's: ``("pp", "dp_replicate", "dp_shard", "tp")``; row-major, so
the tensor-parallel ranks of one stage replica are consecutive (one host) and the pipeline
axis is outermost::

    rank = ((k * D_replicate + d_replicate) * D_shard + d_shard) * T + t

ZeRO 0 and 1 put the plan's D on ``dp_replicate`` (``dp_shard`` = 1); ZeRO 2 and 3 on
``dp_shard`` (``dp_replicate`` = 1).  :class:`MeshSpec` computes the coordinates without
torch; :func:`build_mesh` makes the ``DeviceMesh``.

:func:`apply_mesh` turns one stage module (:meth:`profiler.split.SplitModel.stage_module`)
into what the pipeline stage runs, one function per axis in a fixed order:

1. :func:`apply_tensor_parallel` (T > 1): each unit the runtime has a sharding rule for
   (:data:`RULES`: the zoo GPT block, Hugging Face Llama/Qwen2-style decoder layers and
   BERT/ViT-style encoder layers) gets its
   linear weights distributed as DTensors over the "tp" axis,
   Megatron style (column-parallel: ``Shard(0)`` of weight and bias; row-parallel:
   ``Shard(1)`` of the weight, bias replicated), every other tensor of the unit replicated.
   The units are the splitter's flattened graphs (aten operators, not module calls), so the
   styles of ``parallelize_module`` (forward hooks on ``nn.Linear``) would never fire: the
   unit runs on DTensors instead, and DTensor's sharding propagation places the
   collectives (``_TensorParallelUnit``: the unit's inputs enter as replicated DTensors,
   its outputs leave as plain tensors, replicated).  Units without a rule run whole on every
   tensor-parallel rank (their inputs and gradients are replicated, so they stay in step).
   A sharded unit's dropout draws the whole tensor's mask and keeps its shard
   (:func:`whole_dropout`), so it drops what the unsharded model drops.
   With sequence parallelism (the plan's ``sequence_parallel``), Megatron style, for rules
   with a ``sequence_dim`` (every block rule): the unit's graph gets an all-gather along the
   sequence before each column-parallel linear and a reduce-scatter after each row-parallel one
   (:func:`_make_sequence_parallel`; around a ``Conv1D``, which flattens batch and sequence,
   before the view that flattens its input and after the view that restores its output), so its
   norms, dropout and residual adds run on 1/T of the sequence; only the hidden states are split
   on entry (not an attention mask or position bias beside them; T5's decoder blocks also split
   the encoder's output, gathered for the cross-attention's keys and values); consecutive
   sharded units of a stage hand each other sequence shards, and the activations are gathered
   whole where the stage ends or a unit without a rule follows.
2. recompute: the first ``checkpointed_layers`` units of the stage (``StagePlan.checkpointed_layers``)
   each under its own ``torch.utils.checkpoint`` (:func:`runtime.modules.checkpoint_layers`):
   a checkpointed unit keeps only its input and re-runs its forward in the backward, one unit at
   a time, as Megatron-LM, torchtitan and DeepSpeed checkpoint layer by layer.
3. :func:`apply_data_sharding` (ZeRO 2 and 3): FSDP2 ``fully_shard`` over "dp_shard" of each
   layer (unit), then of the stage;
   ``reshard_after_forward`` is ``zero_stage == 3``, forced to False under the split-backward
   schedules (:data:`SPLIT_BACKWARD_SCHEDULES`), which otherwise give wrong gradients.  With
   T > 1 the tensor-parallel DTensors are sharded again over "dp_shard" (2-D, FSDP2 over the
   "tp"-sharded parameters, as torchtitan does).

ZeRO 1 is the optimizer: :func:`make_sharded_optimizer` (``ZeroRedundancyOptimizer`` over
"dp_replicate"; with T > 1, :class:`DTensorZeroOptimizer`, the same scheme for DTensor
parameters).  ZeRO 0 and 1 average the gradients as :func:`gradient_reduction` says: torch's
``DistributedDataParallel`` per stage (:mod:`runtime._ddp`: buckets all-reduced during each
stage's last micro-batch's backward) with T = 1 and a schedule without split backward, else the
runtime's flat all-reduce after the schedule (the reasons are in that function).

:func:`refuse_unexecutable` refuses, before training, a plan with an axis the runtime cannot
execute, naming the layer.  ``torch.distributed.tensor.experimental.implicit_replication``
(an experimental API) is used here only; ``tests/runtime/test_mesh.py`` fails clearly when it
moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.errors import InputError
from runtime.tp_heads import heads_problem

#: mesh dimension names, outermost first (torchtitan's order)
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
#: schedules that split the backward into input- and weight-gradient parts: FSDP2 must not
#: reshard after the forward under them (the weight-gradient step needs the parameters)
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb-h1", "zb-h2", "zbv", "dualpipev", "interleaved-zb", "planned"})


@dataclass(frozen=True)
class MeshSpec:
    """The mesh axes of a plan (``planner.schema.Plan`` or any object with its fields)."""

    pipeline_degree: int = 1
    data_parallel_degree: int = 1
    tensor_parallel_degree: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"

    @staticmethod
    def of(plan: Any) -> MeshSpec:
        """The plan's mesh; context parallelism (C > 1, :mod:`runtime.context_parallel`) is
        folded into the data axis: ``D x C`` ranks, ``d * C + c``, whose gradients are averaged
        together as Megatron-LM averages over its data- and context-parallel ranks."""
        return MeshSpec(
            pipeline_degree=plan.pipeline_degree,
            data_parallel_degree=plan.data_parallel_degree * getattr(plan, "context_parallel_degree", 1),
            tensor_parallel_degree=getattr(plan, "tensor_parallel_degree", 1),
            zero_stage=getattr(plan, "zero_stage", 0),
            sequence_parallel=getattr(plan, "sequence_parallel", False),
            schedule=plan.schedule,
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Sizes of :data:`MESH_AXES`."""
        d = self.data_parallel_degree
        sharded = self.zero_stage >= 2
        return (self.pipeline_degree, 1 if sharded else d, d if sharded else 1, self.tensor_parallel_degree)

    @property
    def world_size(self) -> int:
        return self.pipeline_degree * self.data_parallel_degree * self.tensor_parallel_degree

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pipeline rank, data-parallel replica, tensor-parallel rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise InputError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        t_deg, d_deg = self.tensor_parallel_degree, self.data_parallel_degree
        return rank // (d_deg * t_deg), (rank // t_deg) % d_deg, rank % t_deg

    def rank_of(self, pp: int, replica: int, tp: int = 0) -> int:
        return (pp * self.data_parallel_degree + replica) * self.tensor_parallel_degree + tp

    def reshard_after_forward(self) -> bool:
        """FSDP2's policy: ZeRO 3 reshards after the forward, ZeRO 2 keeps the gathered
        parameters until the backward; never under a split-backward schedule."""
        return self.zero_stage == 3 and self.schedule not in SPLIT_BACKWARD_SCHEDULES


def build_mesh(spec: MeshSpec, *, device_type: str = "cpu") -> Any:
    """The ``DeviceMesh`` of ``spec`` over the default process group (its world size must be
    ``spec.world_size``), dimensions :data:`MESH_AXES`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world != spec.world_size:
        raise InputError(
            f"the plan's mesh needs {spec.world_size} ranks (K={spec.pipeline_degree} x "
            f"D={spec.data_parallel_degree} x T={spec.tensor_parallel_degree}) but the job has {world}"
        )
    return init_device_mesh(device_type, spec.shape, mesh_dim_names=MESH_AXES)


def data_mesh(mesh: Any, spec: MeshSpec) -> Any:
    """The 1-D mesh of the data-parallel axis (``dp_shard`` for ZeRO 2/3, else ``dp_replicate``)."""
    return mesh["dp_shard" if spec.zero_stage >= 2 else "dp_replicate"]


# ---------------------------------------------------------------- tensor-parallel rules


@dataclass(frozen=True)
class Rule:
    """How one kind of block shards: parameter-name suffixes of its column- and row-parallel
    linears (the module path inside the block, e.g. ``attn.qkv``), and how to recognise it."""

    name: str
    column: tuple[str, ...]
    row: tuple[str, ...]
    #: the sequence dimension of the block's activations, for sequence parallelism (None: the
    #: runtime does not run this block sequence-parallel)
    sequence_dim: int | None = None
    #: the projections are transposed linears (weight ``[in, out]``, Hugging Face's ``Conv1D``)
    transposed: bool = False
    #: fused projections (suffix, parts): the output is ``parts`` projections side by side
    #: (GPT-2's ``c_attn``: Q, K, V), each sharded by heads (:func:`split_fused`)
    fused: tuple[tuple[str, int], ...] = ()
    #: the block routes tokens to experts run as grouped products (:mod:`runtime.tp_experts`
    #: shards them); a rule without it never matches such a block
    experts: bool = False


#: the name of the rule for blocks with routed experts (:data:`RULES`)
RULES_WITH_EXPERTS = "decoder layer with mixture of experts (Mixtral/Qwen2-MoE style)"
#: the blocks the runtime can shard, in the order they are tried
RULES: tuple[Rule, ...] = (
    Rule("zoo GPT block", column=("attn.qkv", "mlp.fc"), row=("attn.proj", "mlp.out"), sequence_dim=1),
    Rule(
        "decoder layer (Llama/Qwen2 style)",
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        row=("self_attn.o_proj", "mlp.down_proj"),
        sequence_dim=1,
    ),
    Rule(
        RULES_WITH_EXPERTS,
        column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        row=("self_attn.o_proj",),
        sequence_dim=1,
        experts=True,
    ),
    Rule(
        "encoder layer (BERT style)",
        column=("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
        row=("attention.output.dense", "output.dense"),
        sequence_dim=1,
    ),
    Rule(
        "GPT-2 block (Hugging Face Conv1D)",
        column=("attn.c_attn", "mlp.c_fc"),
        row=("attn.c_proj", "mlp.c_proj"),
        sequence_dim=1,
        transposed=True,
        fused=(("attn.c_attn", 3),),
    ),
    Rule(
        "T5 encoder block",
        column=("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
                "layer.1.DenseReluDense.wi"),
        row=("layer.0.SelfAttention.o", "layer.1.DenseReluDense.wo"),
        sequence_dim=1,
    ),
    Rule(
        "T5 decoder block",
        column=("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v",
                "layer.1.EncDecAttention.q", "layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v",
                "layer.2.DenseReluDense.wi"),
        row=("layer.0.SelfAttention.o", "layer.1.EncDecAttention.o", "layer.2.DenseReluDense.wo"),
        sequence_dim=1,
    ),
    Rule(
        "encoder layer (ViT style)",
        column=("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
        row=("attention.o_proj", "mlp.fc2"),
        sequence_dim=1,
    ),
)


@dataclass(frozen=True)
class UnitSharding:
    """What a rule makes of one unit: the qualified module names of its column- and
    row-parallel linears (inside the unit)."""

    rule: str
    column: tuple[str, ...]
    row: tuple[str, ...]
    sequence_dim: int | None = None
    #: embedding tables sharded along the vocabulary (``Shard(0)``; a vocabulary-parallel embedding)
    vocab: tuple[str, ...] = ()
    #: the linears (of column and row) whose weight is ``[in, out]`` (``Conv1D``): sharded on the
    #: other dimension (column: weight ``Shard(1)``, bias ``Shard(0)``; row: weight ``Shard(0)``)
    transposed: tuple[str, ...] = ()
    #: fused column-parallel linears -> how many projections side by side, each sharded by heads
    fused: tuple[tuple[str, int], ...] = ()
    #: the mixture-of-experts modules (``model.layers.0.mlp``) whose experts :mod:`runtime.tp_experts` shards
    experts: tuple[str, ...] = ()

    def features(self, linears: Mapping[str, tuple[int, int]], name: str) -> tuple[int, int]:
        """``(out, in)`` features of linear ``name`` (``linears``: :func:`_linear_modules`)."""
        a, b = linears[name]
        return (b, a) if name in self.transposed else (a, b)


def _linear_modules(unit: Any) -> dict[str, tuple[int, int]]:
    """Qualified names of the modules holding a 2-D ``weight`` -> its ``(out, in)`` shape."""
    out = {}
    for name, mod in unit.named_modules():
        w = mod._parameters.get("weight") if hasattr(mod, "_parameters") else None
        if w is not None and w.dim() == 2:
            out[name] = (int(w.shape[0]), int(w.shape[1]))
    return out


def match_rule(unit: Any) -> UnitSharding | None:
    """The sharding of a unit (one layer of the split) when exactly one block of a known kind
    is in it: every linear a rule names found under one common prefix."""
    from runtime.tp_experts import moe_blocks

    linears = _linear_modules(unit)
    moe = _has_grouped_experts(unit)
    for rule in RULES:
        if rule.experts != moe:
            continue
        prefixes = {name[: -len(suffix)] for name in linears for suffix in rule.column[:1] if name.endswith(suffix)}
        for prefix in sorted(prefixes):
            col = tuple(prefix + s for s in rule.column)
            row = tuple(prefix + s for s in rule.row)
            if all(n in linears for n in col + row):
                return UnitSharding(
                    rule.name,
                    col,
                    row,
                    rule.sequence_dim,
                    transposed=col + row if rule.transposed else (),
                    fused=tuple((prefix + f, parts) for f, parts in rule.fused),
                    experts=moe_blocks(unit) if moe else (),
                )
    return None


def _weights_used_by(unit: Any, op: Any, position: int) -> list[str]:
    """Qualified names (inside the unit) of the modules whose ``weight`` is argument
    ``position`` of an ``op`` call in the unit's graph."""
    graph = getattr(unit, "graph", None)
    if graph is None:
        return []
    out = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is op and len(node.args) > position:
            w = node.args[position]
            if getattr(w, "op", None) == "get_attr" and str(w.target).endswith(".weight"):
                out.append(str(w.target)[: -len(".weight")])
    return out


#: the units the profiler prices as sharded that are not blocks: kind -> the runtime's name for it
KIND_RULES = {"vocab-embedding": "vocabulary-parallel embedding", "column-head": "column-parallel head"}


def kind_sharding(unit: Any, kind: str) -> UnitSharding | None:
    """The sharding of a unit the profiler priced as a ``vocab-embedding`` (its largest table,
    the one ``aten.embedding`` reads, sharded along the vocabulary: each rank looks up its rows,
    the partial embeddings are summed on the way out) or a ``column-head`` (its widest linear
    column-parallel: each rank computes its share of the vocabulary's logits, gathered on the
    way out; the input gradient's partial sums are summed on the way back); None when the
    unit's graph has no such call."""
    import torch

    linears = _linear_modules(unit)
    if kind == "vocab-embedding":
        tables = [n for n in _weights_used_by(unit, torch.ops.aten.embedding.default, 0) if n in linears]
        if not tables:
            return None
        widest = max(tables, key=lambda n: linears[n][0] * linears[n][1])
        return UnitSharding(KIND_RULES[kind], column=(), row=(), vocab=(widest,))
    if kind == "column-head":
        heads = [n for n in _weights_used_by(unit, torch.ops.aten.linear.default, 1) if n in linears]
        if not heads:
            return None
        return UnitSharding(KIND_RULES[kind], column=(max(heads, key=lambda n: linears[n][0]),), row=())
    return None


def unit_sharding(unit: Any, kind: str | None) -> UnitSharding | None:
    """How the runtime shards one unit the profile calls ``kind`` (None: unknown, a block rule
    is tried): a block by its rule (:func:`match_rule`), an embedding or head by its kind
    (:func:`kind_sharding`), a replicated unit not at all."""
    if kind == "replicated":
        return None
    if kind in KIND_RULES:
        return kind_sharding(unit, kind)
    return match_rule(unit)


def profiled_kinds(split: Any) -> list[str]:
    """How the profiler classified each unit of ``split`` for tensor parallelism (the
    ``LayerProfile.tensor_parallel`` kind the planner priced, :mod:`profiler.sharding`), by the
    same test as the profiler (:func:`profiler.sharding.own_modules`)."""
    from profiler.sharding import own_modules, tensor_parallel_fields

    out = []
    for module in own_modules(split):
        kind = "replicated"
        if module is not None:
            kind = tensor_parallel_fields(module, {"output_bytes": [0], "activation_bytes": [0]}, [0]).get(
                "tensor_parallel", "replicated"
            )
        out.append(kind)
    return out


def plan_sharding(
    units: Sequence[Any],
    layer_names: Sequence[str],
    spec: MeshSpec,
    *,
    layer_kinds: Mapping[str, str] | None = None,
) -> dict[int, UnitSharding]:
    """Unit index -> its sharding for ``spec``; raises :class:`InputError` when the plan has an
    axis the runtime cannot execute (see :func:`refuse_unexecutable`)."""
    refuse_unexecutable(units, layer_names, spec, layer_kinds=layer_kinds)
    if spec.tensor_parallel_degree == 1:
        return {}
    out = {}
    for i, unit in enumerate(units):
        sharding = unit_sharding(unit, (layer_kinds or {}).get(layer_names[i]))
        if sharding is not None:
            out[i] = sharding
    return out


def split_sharding(split: Any, spec: MeshSpec) -> dict[int, UnitSharding]:
    """:func:`plan_sharding` of a split model with the kinds the profiler priced
    (:func:`profiled_kinds`): the runtime shards exactly what the plan was priced with, and
    refuses (before training) a priced layer it has no rule for."""
    kinds = dict(zip(split.names, profiled_kinds(split), strict=True)) if spec.tensor_parallel_degree > 1 else None
    return plan_sharding(split.units, split.names, spec, layer_kinds=kinds)


def refuse_unexecutable(
    units: Sequence[Any],
    layer_names: Sequence[str],
    spec: MeshSpec,
    *,
    layer_kinds: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`InputError` before training when the runtime cannot execute an axis of
    the plan: sequence parallelism on a sharded layer without a sequence rule; T > 1 on a layer the plan (its
    profile's ``tensor_parallel`` kind per layer, ``layer_kinds``) shards but the runtime has
    no rule for, or on a model with no shardable layer at all; a sharded width T does not
    divide.  Every problem is listed, each naming its layer."""
    t_deg = spec.tensor_parallel_degree
    problems: list[str] = []
    if spec.zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_stage {spec.zero_stage}: choose 0, 1, 2 or 3")
    if t_deg > 1:
        shardable = 0
        for i, unit in enumerate(units):
            name = layer_names[i]
            kind = (layer_kinds or {}).get(name)
            sharding = unit_sharding(unit, kind)
            if kind is not None and kind != "replicated" and sharding is None:
                moe = _has_grouped_experts(unit)
                problems.append(
                    f"layer {i} '{name}' is tensor-parallel ({kind}) in the plan but the runtime has no "
                    + (
                        "sharding rule for it: a mixture-of-experts layer without the attention of the rule "
                        f"'{RULES_WITH_EXPERTS}' (q_proj, k_proj, v_proj, o_proj under self_attn)"
                        if moe
                        else f"sharding rule for it (rules: {', '.join(r.name for r in RULES)}; "
                        f"{', '.join(KIND_RULES.values())})"
                    )
                )
                continue
            if sharding is None:
                continue
            shardable += 1
            linears = _linear_modules(unit)
            if sharding.experts:
                from runtime.tp_experts import layout

                found = layout(unit, sharding.experts, t_deg)
                if isinstance(found, str):
                    problems.append(f"layer {i} '{name}' ({sharding.rule}): no sharding rule for its experts: {found}")
            for mod in sharding.vocab:
                if linears[mod][0] % t_deg:
                    problems.append(
                        f"layer {i} '{name}': {mod} has {linears[mod][0]} rows (vocabulary), not divisible by T={t_deg}"
                    )
            if spec.sequence_parallel and sharding.row:
                why = _sequence_parallel_problem(unit, sharding)
                if why:
                    problems.append(f"layer {i} '{name}' ({sharding.rule}): sequence parallelism: {why}")
            fused = dict(sharding.fused)
            for mod in sharding.column:
                width = sharding.features(linears, mod)[0]
                parts = fused.get(mod, 1)
                if width % (parts * t_deg):
                    what = f"{parts} projections of {width // parts}" if parts > 1 else f"{width}"
                    problems.append(
                        f"layer {i} '{name}': {mod} has {what} output features, not divisible by T={t_deg}"
                    )
                elif parts > 1:
                    site = _fused_split_site(unit, mod, parts)
                    if isinstance(site, str):
                        problems.append(f"layer {i} '{name}' ({sharding.rule}): {site}")
                elif heads := heads_problem(unit, mod, t_deg):  # e.g. Llama's 2 key/value heads at T=4
                    problems.append(f"layer {i} '{name}': {heads}")
            for mod in sharding.row:
                width = sharding.features(linears, mod)[1]
                if width % t_deg:
                    problems.append(
                        f"layer {i} '{name}': {mod} has {width} input features, not divisible by T={t_deg}"
                    )
        if shardable == 0 and units and not problems:
            problems.append(
                f"tensor_parallel_degree {t_deg}: no layer of this model has a sharding rule (rules: "
                f"{', '.join(r.name for r in RULES)}; layers {layer_names[0]!r}..{layer_names[-1]!r})"
            )
    if problems:
        fixes = []
        if any("not divisible by T=" in p for p in problems):
            fixes.append("a tensor-parallel degree that divides every width listed (pipeplan plan ... --tensor-parallel T)")
        if any("no sharding rule" in p or "no layer of this model" in p for p in problems):
            fixes.append("--tensor-parallel 1 (the runtime has no tensor-parallel rule for the layers listed)")
        if any("sequence parallelism" in p for p in problems):
            fixes.append("--no-sequence-parallel")
        raise InputError(
            "the runtime cannot execute this plan's mesh:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\n  fix: replan with "
            + ("; or ".join(fixes) if fixes else "axes the runtime executes")
        )


def _has_grouped_experts(unit: Any) -> bool:
    """True when a unit's graph runs experts as grouped products (:mod:`runtime.experts`)."""
    graph = getattr(unit, "graph", None)
    return graph is not None and any(n.op == "call_function" and "grouped_mm" in str(n.target) for n in graph.nodes)


def _linear_sites(unit: Any, weights: Iterable[str], *, transposed: Iterable[str] = ()) -> list[Any] | str:
    """The ``aten.linear`` node of each weight (qualified names inside the unit) in a unit's
    graph, in order, or why they cannot be found (one linear call per weight expected); for the
    modules in ``transposed`` (``Conv1D``: ``x @ weight + bias``), the ``aten.addmm`` node."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return "the layer is not a traced graph"
    attrs = {n.target: n for n in graph.nodes if n.op == "get_attr"}
    flipped = {f"{m}.weight" for m in transposed}
    out = []
    for weight in weights:
        op, at = (torch.ops.aten.addmm.default, 2) if weight in flipped else (torch.ops.aten.linear.default, 1)
        node = attrs.get(weight)
        users = [u for u in node.users if u.op == "call_function"] if node is not None else []
        if len(users) != 1 or users[0].target is not op or users[0].args[at] is not node:
            return f"{weight} is not used by exactly one aten.{op.__name__.split('.')[0]} call in the layer's graph"
        out.append(users[0])
    return out


#: operators that only reshape, between a fused projection and the split of its output
_RESHAPES = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")


def _fused_split_site(unit: Any, module: str, parts: int) -> Any:
    """The ``aten.split`` node that cuts fused projection ``module``'s output (its ``addmm`` or
    ``linear``, then only reshapes) into ``parts`` equal projections along the last dimension,
    or why there is none."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return "the layer is not a traced graph"
    weight = f"{module}.weight"
    node = next((n for n in graph.nodes if n.op == "get_attr" and n.target == weight), None)
    users = list(node.users) if node is not None else []
    why = f"{module}'s output is not split into {parts} projections by one aten.split in the layer's graph"
    if len(users) != 1 or users[0].op != "call_function":
        return why
    node = users[0]
    width = None
    while True:
        nxt = list(node.users)
        if len(nxt) != 1 or nxt[0].op != "call_function":
            return why
        node = nxt[0]
        if str(node.target) in _RESHAPES:
            sizes = node.args[1]
            width = sizes[-1] if isinstance(sizes, (list, tuple)) and isinstance(sizes[-1], int) else None
            continue
        break
    if node.target is not torch.ops.aten.split.Tensor or width is None:
        return why
    size, dim = node.args[1], node.args[2] if len(node.args) > 2 else 0
    if not isinstance(size, int) or size * parts != width or dim not in (-1, len(node.args[0].args[1]) - 1):
        return why
    return node


def split_fused(y: Any, split_size: int, dim: int, parts: int) -> Any:
    """``aten.split`` of a fused projection's output into its ``parts`` projections (GPT-2's
    Q, K, V).  Sharded by heads (:func:`runtime._strided_shard.strided_shard`: this rank holds
    its heads of each projection side by side), each rank cuts its own piece into ``parts``,
    each a ``Shard(dim)`` DTensor of the projection: no communication (DTensor's own split would
    gather the whole output).  Anything else: ``aten.split`` as traced."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from runtime._strided_shard import is_strided

    if isinstance(y, DTensor) and y.device_mesh.ndim == 1:
        d = dim % y.dim()
        if is_strided(y.placements[0], d, parts):
            local = y.to_local()
            pieces = torch.split(local, local.shape[d] // parts, d)
            return [DTensor.from_local(p, y.device_mesh, [Shard(d)], run_check=False) for p in pieces]
    return torch.ops.aten.split.Tensor(y, split_size, dim)


def _split_fused_by_heads(unit: Any, fused: Mapping[str, int]) -> None:
    """Route each fused projection's split through :func:`split_fused` in a unit's graph
    (:func:`refuse_unexecutable` refused units where the split is not found)."""
    graph = getattr(unit, "graph", None)
    changed = False
    for module, parts in fused.items():
        node = _fused_split_site(unit, module, parts)
        if isinstance(node, str):
            raise InputError(f"tensor parallelism: {node}")
        node.target = split_fused
        node.args = (node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else 0, parts)
        changed = True
    if changed and graph is not None:
        graph.lint()
        unit.recompile()


def _sequence_parallel_problem(unit: Any, sharding: UnitSharding) -> str:
    """Why ``unit`` cannot run sequence-parallel (empty: it can)."""
    sites = _sequence_sites(unit, sharding)
    return sites if isinstance(sites, str) else ""


def _sequence_sites(unit: Any, sharding: UnitSharding) -> tuple[list[Any], list[Any]] | str:
    """Where sequence parallelism rewrites a unit's graph, or why it cannot: the nodes whose
    first argument (the activation entering a column-parallel linear) is gathered along the
    sequence, and the nodes whose output (a row-parallel linear's) is reduce-scattered along it.
    A linear's ``aten.linear`` node for both; a transposed one's (``Conv1D``) flattens batch and
    sequence around its ``aten.addmm`` (:func:`_flattening_views`): the gather goes before the
    view that flattens its input, the reduce-scatter after the view that restores its output."""
    if sharding.sequence_dim is None:
        return "the runtime has no sequence-parallel rule for this kind of layer"
    transposed = set(sharding.transposed)
    out: list[list[Any]] = []
    for names, end in ((sharding.column, 0), (sharding.row, 1)):
        sites = _linear_sites(unit, [f"{n}.weight" for n in names], transposed=transposed)
        if isinstance(sites, str):
            return sites
        nodes = []
        for name, node in zip(names, sites, strict=True):
            views = _flattening_views(node, name, sharding.sequence_dim) if name in transposed else (node, node)
            if isinstance(views, str):
                return views
            nodes.append(views[end])
        out.append(nodes)
    return out[0], out[1]


def _flattening_views(addmm: Any, name: str, sequence_dim: int) -> tuple[Any, Any] | str:
    """The views around a transposed linear's ``aten.addmm`` (Hugging Face ``Conv1D.forward``:
    ``x.view(-1, x.size(-1))``, then ``.view(size_out)``): ``(the view flattening its input, the
    one view of its output)``, or why they are not there."""
    before, users = addmm.args[1], list(addmm.users)
    after = users[0] if len(users) == 1 else None
    if (
        getattr(before, "op", None) != "call_function"
        or str(before.target) not in _RESHAPES
        or after is None
        or after.op != "call_function"
        or str(after.target) not in _RESHAPES
        or not isinstance(after.args[1], (list, tuple))
        or len(after.args[1]) <= sequence_dim
    ):
        return (
            f"{name}'s aten.addmm is not between a view flattening its input and one view restoring the "
            f"sequence dimension {sequence_dim} of its output (Conv1D's x.view(-1, x.size(-1)) ... .view(size_out))"
        )
    return before, after


def gather_sequence(x: Any) -> Any:
    """Megatron's sequence-parallel ``g``: the whole sequence of a sequence-sharded DTensor
    (all-gather; its gradient is reduce-scattered back).  Called from a unit's graph before each
    column-parallel linear."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor) or all(p.is_replicate() for p in x.placements):
        return x
    return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)


def scatter_sequence(y: Any, dim: int) -> Any:
    """Megatron's sequence-parallel ``g-bar``: a row-parallel linear's partial sums, summed
    and left sharded along the sequence dimension ``dim`` (reduce-scatter; its gradient is
    all-gathered).  Called from a unit's graph after each row-parallel linear."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(y, DTensor):
        return y
    return y.redistribute(y.device_mesh, [Shard(dim)] * y.device_mesh.ndim)


def summed_gradient(w: Any) -> Any:
    """``w`` (a replicated DTensor parameter) as it is, whose gradient is summed over its mesh on
    the way back: used on sequence shards (a norm's weight), each rank's gradient is a partial
    sum, and the parameter's must be replicated like the parameter (Megatron all-reduces these
    gradients over the tensor-parallel group).  ``from_local``'s backward sums a partial
    gradient into the forward's placements; ``to_local``'s hands it on as the parameter's."""
    from torch.distributed.tensor import DTensor

    if not isinstance(w, DTensor):
        return w
    return DTensor.from_local(w.to_local(), w.device_mesh, w.placements, run_check=False)


def _make_sequence_parallel(unit: Any, sharding: UnitSharding) -> tuple[int, ...]:
    """Rewrite a unit's graph for sequence parallelism: the activation entering each
    column-parallel linear is gathered along the sequence (:func:`gather_sequence`, once per
    activation however many linears read it), the output of each row-parallel linear
    reduce-scattered along it (:func:`scatter_sequence`); everything between (norms, dropout,
    residual adds) then runs on sequence shards, and the replicated parameters used there get
    summed gradients (:func:`summed_gradient`).  Returns the positions of the unit's inputs the
    gathered activations are computed from (:func:`_sequence_inputs`): the ones to split."""
    sites = _sequence_sites(unit, sharding)
    if isinstance(sites, str):
        raise InputError(f"sequence parallelism: {sites}; fix: --no-sequence-parallel")
    column, row = sites
    graph = unit.graph
    _sum_replicated_gradients(unit)
    gathered: dict[Any, Any] = {}
    for node in column:
        source = node.args[0]
        if source in gathered.values():  # a view two transposed linears flatten their input with
            continue
        if source not in gathered:
            with graph.inserting_before(node):
                gathered[source] = graph.call_function(gather_sequence, (source,))
        node.args = (gathered[source], *node.args[1:])
    for node in row:
        with graph.inserting_after(node):
            scattered = graph.call_function(scatter_sequence, (node, sharding.sequence_dim))
        node.replace_all_uses_with(scattered, delete_user_cb=lambda user, s=scattered: user is not s)
    graph.lint()
    unit.recompile()
    return _sequence_inputs(graph, list(gathered))


def _sum_replicated_gradients(unit: Any) -> None:
    """Route each replicated DTensor parameter of a unit's graph through :func:`summed_gradient`."""
    graph = unit.graph
    params = dict(unit.named_parameters())
    for node in [n for n in graph.nodes if n.op == "get_attr" and n.target in params]:
        p = params[node.target]
        if all(pl.is_replicate() for pl in getattr(p, "placements", ())) and hasattr(p, "placements"):
            with graph.inserting_after(node):
                summed = graph.call_function(summed_gradient, (node,))
            node.replace_all_uses_with(summed, delete_user_cb=lambda user, s=summed: user is not s)


def _sequence_inputs(graph: Any, activations: Sequence[Any]) -> tuple[int, ...]:
    """Positions (among the graph's placeholders) of the inputs ``activations`` are computed
    from along the sequence-sharded stream: the walk back stops at each reduce-scatter, so what
    only reaches them through attention or an MLP (masks, rotary tables, position biases) is not
    counted.  The hidden states, wherever they sit (GPT-2's blocks take the mask first)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    seen, todo = set(), list(activations)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            if node.target not in (scatter_sequence, gather_sequence):
                todo.extend(node.all_input_nodes)
    return tuple(i for i, n in enumerate(placeholders) if n in seen)


def _tp_unit_class() -> Any:
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class _TensorParallelUnit(nn.Module):
        """Runs a unit whose tensors are DTensors over the "tp" mesh: plain inputs enter as
        replicated DTensors (their gradients are summed over the group on the way back),
        integer inputs too; outputs leave replicated, as plain tensors.

        Sequence-parallel (``sequence_dim`` set): the inputs at ``split_inputs`` (the hidden
        states; the others, such as attention masks and rotary tables, stay replicated) are split
        along the sequence on entry (each rank keeps its slice, no communication); DTensor inputs
        (from the previous sequence-parallel unit of the stage) enter as they are.  With
        ``keep_sharded`` (the next unit of the stage is sequence-parallel too) the outputs stay
        DTensors, sharded along the sequence; else they are gathered and leave whole."""

        def __init__(
            self,
            inner: nn.Module,
            mesh: Any,
            *,
            sequence_dim: int | None = None,
            split_inputs: tuple[int, ...] = (0,),
            keep_sharded: bool = False,
        ) -> None:
            super().__init__()
            self.inner = inner
            self.tp_mesh = mesh
            self.sequence_dim = sequence_dim
            self.split_inputs = split_inputs
            self.keep_sharded = keep_sharded

        def _enter(self, a: Any, *, split: bool) -> Any:
            if not isinstance(a, torch.Tensor) or isinstance(a, DTensor):
                return a
            d = DTensor.from_local(a, self.tp_mesh, [Replicate()], run_check=False)
            seq = self.sequence_dim
            if split and seq is not None and a.is_floating_point() and a.dim() > seq:
                d = d.redistribute(self.tp_mesh, [Shard(seq)])  # a local slice: no communication
            return d

        def forward(self, *args: Any) -> Any:
            xs = tuple(self._enter(a, split=i in self.split_inputs) for i, a in enumerate(args))
            # constants the graph makes (masks, positions) are replicated; fused attention runs
            # as its math composition, which DTensor shards by heads (it has no sharding rule for
            # the CPU flash kernel, and deriving one by decomposition takes minutes)
            with implicit_replication(), sdpa_kernel(SDPBackend.MATH):
                out = self.inner(*xs)
            if self.keep_sharded:
                return tuple(out)
            return tuple(
                o.redistribute(self.tp_mesh, [Replicate()]).to_local() if isinstance(o, DTensor) else o for o in out
            )

    return _TensorParallelUnit


def _drop_metadata_asserts(unit: Any) -> None:
    """Remove ``aten._assert_tensor_metadata`` checks from a unit's graph: torch.export adds them
    (dtype/device asserts, no output) and DTensor has no sharding rule for them."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return
    target = torch.ops.aten._assert_tensor_metadata.default
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is target and not n.users]
    for n in nodes:
        graph.erase_node(n)
    if nodes:
        unit.recompile()


def replicated_like(x: Any, like: Any) -> Any:
    """``x`` as a replicated DTensor on ``like``'s mesh when ``like`` is a DTensor and ``x`` a plain
    tensor (:func:`_replicated_lookups`); otherwise ``x``."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(like, DTensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return x


def _replicated_lookups(unit: Any) -> None:
    """The indices of each ``aten.embedding`` in a sharded unit's graph enter as replicated
    DTensors (:func:`replicated_like`): indices the graph computes itself (T5's relative-position
    buckets, from ``arange``) are plain tensors, which ``implicit_replication`` lets through in
    the forward but not in the backward, where ``embedding_dense_backward`` refused the mix."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.embedding.default]
    for node in nodes:
        with graph.inserting_before(node):
            idx = graph.call_function(replicated_like, (node.args[1], node.args[0]))
        node.args = (node.args[0], idx, *node.args[2:])
    if nodes:
        graph.lint()
        unit.recompile()


def whole_dropout(x: Any, p: float, train: bool) -> Any:
    """``aten.dropout`` of a DTensor with the mask the unsharded tensor gets: the whole tensor's
    noise is drawn with the generator calls torch's CPU dropout makes (``empty``, ``bernoulli_(1 -
    p)``, ``div_(1 - p)``: same shape, same dtype, so the same numbers, and the generator ends
    where the unsharded model's does), and each rank keeps its shard of it.  Called from a
    sharded unit's graph in place of ``aten.dropout`` (:func:`_whole_randomness`): left to
    itself, each rank drew a mask of its own shard's size, so the attention dropout of the heads
    and every later draw of the unit differed from the unsharded model's (``--check`` 9e-4 off
    on ``examples.hf:bert`` at T = 2)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if not isinstance(x, DTensor) or not train or p == 0:
        return torch.ops.aten.dropout.default(x, p, train)
    if any(pl.is_partial() for pl in x.placements):
        x = x.redistribute(x.device_mesh, [Replicate() if pl.is_partial() else pl for pl in x.placements])
    local = x.to_local()
    if p == 1:
        return x * 0.0
    noise = torch.empty(tuple(x.shape), dtype=local.dtype, device=local.device).bernoulli_(1 - p).div_(1 - p)
    return x * distribute_tensor(noise, x.device_mesh, x.placements, src_data_rank=None)


def attention_whole_dropout(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """``aten.scaled_dot_product_attention`` with dropout, as torch's math composition (the kernel
    torch picks on CPU when there is dropout) with :func:`whole_dropout` on the probabilities:
    each rank keeps its heads' share of the mask of all heads."""
    import math

    import torch

    if dropout_p == 0 or enable_gqa:
        return torch.ops.aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    attn = torch.matmul(q * factor, k.transpose(-2, -1) * factor)
    if is_causal:
        n, m = attn.shape[-2], attn.shape[-1]
        attn_mask = torch.ones(n, m, dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(attn.dtype)
        attn = attn + attn_mask
    attn = torch.softmax(attn, -1)
    return torch.matmul(whole_dropout(attn, dropout_p, True), v)


def _whole_randomness(unit: Any) -> None:
    """Give a sharded unit's random draws the unsharded model's numbers: its ``aten.dropout``
    calls become :func:`whole_dropout`, its attention with dropout
    :func:`attention_whole_dropout`."""
    import torch

    graph = getattr(unit, "graph", None)
    if graph is None:
        return
    # operator -> (its replacement, the position of its dropout probability)
    swap = {
        torch.ops.aten.dropout.default: (whole_dropout, 1),
        torch.ops.aten.scaled_dot_product_attention.default: (attention_whole_dropout, 4),
    }
    changed = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in swap:
            continue
        fn, at = swap[node.target]
        p = node.args[at] if len(node.args) > at else node.kwargs.get("dropout_p", 0.0)
        if p != 0:  # a traced constant; without dropout the operator stays as it is
            node.target = fn
            changed = True
    if changed:
        graph.lint()
        unit.recompile()


def apply_tensor_parallel(
    stage_module: Any,
    shardings: Mapping[int, UnitSharding],
    tp_mesh: Any,
    *,
    sequence_parallel: bool = False,
    sharded_logits: bool = False,
) -> Any:
    """Shard the units of ``stage_module`` (a ``StageModule``) listed in ``shardings`` (by unit
    index *within the stage*) over ``tp_mesh``; returns ``stage_module``.

    ``sequence_parallel``: Megatron's sequence parallelism on top (:func:`_make_sequence_parallel`):
    each sharded unit runs its norms, dropout and residual adds on sequence shards; between two
    consecutive sharded units of the stage the activations stay sequence-sharded DTensors, and
    they are gathered whole where the stage ends or a unit without a rule follows.

    ``sharded_logits`` (the stage ends the model): a column-parallel head that is the stage's last
    unit hands its logits on sharded along the vocabulary (a ``Shard(-1)`` DTensor), for the
    vocabulary-parallel loss (:func:`vocab_parallel_loss`), as Megatron does; else it gathers them."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    from runtime._strided_shard import strided_shard

    cls = _tp_unit_class()
    for i, sharding in shardings.items():
        unit = stage_module.units[i]
        column, row = set(sharding.column) | set(sharding.vocab), set(sharding.row)
        transposed, fused = set(sharding.transposed), dict(sharding.fused)
        experts: dict[str, tuple[int, int]] = {}
        if sharding.experts:
            from runtime.tp_experts import layout, localize

            found = layout(unit, sharding.experts, tp_mesh.size())
            experts = found["shards"] if isinstance(found, dict) else {}

        def partition(
            name: str,
            mod: Any,
            mesh: Any,
            column: set[str] = column,
            row: set[str] = row,
            transposed: set[str] = transposed,
            fused: dict[str, int] = fused,
            experts: dict[str, tuple[int, int]] = experts,
        ) -> None:
            for pname, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if f"{name}.{pname}" in experts:  # an expert's (or shared expert's) hidden width
                    dim, parts = experts[f"{name}.{pname}"]
                    placement: Any = strided_shard(dim, parts) if parts > 1 else Shard(dim)
                elif name in fused:  # [Q | K | V] side by side: each rank its heads of each
                    placement = strided_shard(1 if pname == "weight" and name in transposed else 0, fused[name])
                elif name in column:  # column-parallel linear, or a table sharded along the vocabulary
                    placement = Shard(1 if pname == "weight" and name in transposed else 0)
                elif name in row and pname == "weight":
                    placement = Shard(0 if name in transposed else 1)
                else:
                    placement = Replicate()
                dt = distribute_tensor(p.detach(), mesh, [placement])
                mod.register_parameter(pname, torch.nn.Parameter(dt, requires_grad=p.requires_grad))
            for bname, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[bname] = distribute_tensor(b, mesh, [Replicate()])

        _drop_metadata_asserts(unit)
        _whole_randomness(unit)
        _split_fused_by_heads(unit, fused)
        _replicated_lookups(unit)
        distribute_module(unit, tp_mesh, partition)
        if sharding.experts:
            seq = sharding.sequence_dim if sequence_parallel else None
            localize(unit, sharding.experts, tp_mesh, sequence_dim=seq)
        if sequence_parallel and sharding.sequence_dim is not None:
            split = _make_sequence_parallel(unit, sharding)
            nxt = shardings.get(i + 1)
            keep = nxt is not None and nxt.sequence_dim is not None and i + 1 < len(stage_module.units)
            stage_module.units[i] = cls(
                unit, tp_mesh, sequence_dim=sharding.sequence_dim, split_inputs=split, keep_sharded=keep
            )
        else:
            _reduce_row_outputs(unit, sharding)
            last_head = sharded_logits and sharding.rule == KIND_RULES["column-head"] and i == len(stage_module.units) - 1
            stage_module.units[i] = cls(unit, tp_mesh, keep_sharded=last_head)
    return stage_module


def vocab_parallel_loss(loss_of: Callable[[Any], Any], output: Any) -> tuple[Any, bool]:
    """``loss_of(output)`` of the last stage's ``output``, and whether it ran vocabulary-parallel.

    Where the logits in ``output`` are sharded along the vocabulary (:func:`apply_tensor_parallel`'s
    ``sharded_logits``), torch's ``loss_parallel`` computes the cross-entropy on them (each rank's
    log-softmax over its share of the vocabulary, the maximum and the sum of exponentials
    all-reduced, as Megatron's vocabulary-parallel cross-entropy: the full logits are never
    gathered), and the loss is returned as a plain tensor.  A loss DTensor cannot run on sharded
    logits (an operator without a sharding rule) gets them gathered instead, on every
    tensor-parallel rank alike.  It must run inside :func:`loss_parallel_context`, which the
    backward needs too (``loss_parallel`` is not reentrant: an inner one would switch it off on
    exit)."""
    from torch.distributed.tensor import DTensor, Replicate

    leaves = output if isinstance(output, tuple) else (output,)
    if not any(isinstance(t, DTensor) for t in leaves):
        return loss_of(output), False
    try:
        value = loss_of(output)
    except (RuntimeError, NotImplementedError):
        whole = tuple(
            t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local() if isinstance(t, DTensor) else t
            for t in leaves
        )
        return loss_of(whole if isinstance(output, tuple) else whole[0]), False
    return (value.full_tensor() if isinstance(value, DTensor) else value), True


def loss_parallel_context(spec: MeshSpec) -> Any:
    """The context a pipeline step runs in: torch's ``loss_parallel`` under tensor parallelism
    (the vocabulary-parallel loss's backward needs it), else nothing."""
    import contextlib

    if spec.tensor_parallel_degree == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def reduce_row_output(y: Any) -> Any:
    """Megatron's row-parallel ``g``: a row-parallel linear's partial sums, summed (all-reduce;
    its gradient passes through).  Called from a unit's graph after each row-parallel linear."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(y, DTensor) or all(p.is_replicate() for p in y.placements):
        return y
    return y.redistribute(y.device_mesh, [Replicate()] * y.device_mesh.ndim)


def _reduce_row_outputs(unit: Any, sharding: UnitSharding) -> None:
    """Sum each row-parallel linear's output right after it (:func:`reduce_row_output`), as
    Megatron does.  Left to itself, DTensor carries the partial sums on through the residual
    add and the next norm (measured on ``examples.hf:llama``), and the next column-parallel
    linear then all-gathers its weight instead of sharding its output: the MLP ran unsharded,
    with 12 redistributions per layer and micro-batch.  A unit whose row-parallel weights are not
    each used by exactly one ``aten.linear`` is left to DTensor."""
    row = _linear_sites(unit, [f"{n}.weight" for n in sharding.row], transposed=set(sharding.transposed))
    if isinstance(row, str):
        return
    graph = unit.graph
    for node in row:
        with graph.inserting_after(node):
            summed = graph.call_function(reduce_row_output, (node,))
        node.replace_all_uses_with(summed, delete_user_cb=lambda user, s=summed: user is not s)
    graph.lint()
    unit.recompile()


def apply_data_sharding(
    module: Any, spec: MeshSpec, dp_mesh: Any, *, units: Iterable[Any] = (), keep_whole: Iterable[Any] = ()
) -> Any:
    """FSDP2 ``fully_shard`` over ``dp_mesh`` (ZeRO 2 and 3) of each of the stage's ``units``
    (its layers) that holds a parameter, then of the whole stage ``module`` (what is left), as
    torchtitan shards each transformer block: a layer's parameters are gathered just before it
    runs and, under ZeRO 3, freed after it, so a device holds about two layers' gathered
    parameters (the running one and the prefetched next), as the cost model prices it, and each
    layer's collectives are its own.  Parameters in ``keep_whole`` stay plain tensors, averaged
    by the runtime's all-reduce: the tied weights whose copies sit on several pipeline ranks
    (under FSDP2 their gradients came out wrong in 1F1B with K = 2, measured: 1e-2 off after
    one step).  A layer sharing a weight with another layer of the stage stays in the stage's
    group."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(keep_whole)
    reshard = spec.reshard_after_forward()
    units = list(units)
    holders: dict[int, int] = {}
    for unit in units:
        for p in unit.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    for unit in units:
        own = [p for p in unit.parameters() if p not in ignored]
        # a layer sharing a weight with another layer of the stage (a tied embedding and head
        # on one rank) is left to the stage's group, which holds the weight once
        if own and all(holders[id(p)] == 1 for p in own):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    return fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, ignored_params=ignored or None)


def apply_mesh(
    stage_module: Any,
    spec: MeshSpec,
    mesh: Any,
    *,
    checkpointed_layers: int = 0,
    selective_inputs: Sequence[Sequence[Any]] | None = None,
    shardings: Mapping[int, UnitSharding] | None = None,
    wrap: Callable[[Any], Any] | None = None,
    keep_whole: Iterable[Any] = (),
    sharded_logits: bool = False,
) -> Any:
    """The module a ``PipelineStage`` runs for one stage (``sharded_logits``: it ends the model,
    see :func:`apply_tensor_parallel`): Megatron's selective recompute
    (``selective_inputs``: each unit's example inputs; the units past the checkpointed ones that
    make attention scores get their attention core checkpointed, :mod:`runtime.selective`),
    tensor parallelism (``shardings``,
    unit index within the stage -> sharding, from :func:`plan_sharding`), then recompute (the
    first ``checkpointed_layers`` units each under its own checkpoint), then ``wrap`` (e.g. the
    runtime's autocast), then FSDP2 over the data axis for ZeRO 2 and 3 (of each unit, a
    checkpointed one with its checkpoint inside, as torchtitan shards its checkpointed blocks).
    The stage's parameters keep their qualified names inside the units.  ``keep_whole``: the
    parameters FSDP2 must leave alone (tied across pipeline ranks, see
    :func:`apply_data_sharding`)."""
    from runtime.modules import checkpoint_layers

    mod: Any = stage_module
    if selective_inputs is not None:
        from runtime.selective import recompute_selectively

        recompute_selectively(stage_module, selective_inputs, skip=checkpointed_layers)
    if spec.tensor_parallel_degree > 1 and shardings:
        apply_tensor_parallel(
            stage_module, shardings, mesh["tp"], sequence_parallel=spec.sequence_parallel, sharded_logits=sharded_logits
        )
    if checkpointed_layers:
        checkpoint_layers(stage_module, checkpointed_layers)
    if wrap is not None:
        mod = wrap(mod)
    if spec.zero_stage >= 2 and spec.data_parallel_degree > 1:
        mod = apply_data_sharding(mod, spec, mesh["dp_shard"], units=stage_module.units, keep_whole=keep_whole)
    return mod


def sequence_parallel_note(spec: MeshSpec, layers: int) -> str:
    """What sequence parallelism shards at run time, for the report's mesh note."""
    t = spec.tensor_parallel_degree
    return (
        f"sequence parallelism on the {layers} tensor-parallel layer(s): their norms, dropout and residual adds "
        f"run on 1/{t} of the sequence (all-gather along it before each column-parallel linear, reduce-scatter "
        "after each row-parallel one); consecutive such layers of a stage pass sequence shards, gathered whole "
        "at the stage's end and before a layer without a rule"
    )


def stage_shardings(all_shardings: Mapping[int, UnitSharding], start: int, stop: int) -> dict[int, UnitSharding]:
    """The shardings of units ``start..stop`` re-indexed from 0 (a stage's own units)."""
    return {u - start: s for u, s in all_shardings.items() if start <= u < stop}


def make_sharded_optimizer(
    name: str, params: Iterable[Any], *, lr: float, spec: MeshSpec, mesh: Any, fused: bool = False
) -> Any:
    """The optimizer for ``spec``: ZeRO 1 (D > 1): each replica keeps the state of its share of
    the parameters and broadcasts its updated share over "dp_replicate" --
    ``ZeroRedundancyOptimizer`` for plain parameters, :class:`DTensorZeroOptimizer` when some
    are tensor-parallel DTensors (T > 1); otherwise :func:`runtime.training.make_optimizer`.
    ``fused``: the kernels (:func:`runtime.training.optimizer_class`)."""
    from runtime.training import make_optimizer, optimizer_class

    plist = list(params)
    if spec.zero_stage != 1 or spec.data_parallel_degree == 1:
        return make_optimizer(name, plist, lr=lr, fused=fused)
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in plist):
        return DTensorZeroOptimizer(name, plist, lr=lr, group=mesh["dp_replicate"].get_group(), fused=fused)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, extra = optimizer_class(name, fused=fused)
    return ZeroRedundancyOptimizer(
        plist, optimizer_class=cls, process_group=mesh["dp_replicate"].get_group(), lr=lr, **extra
    )


def _local(t: Any) -> Any:
    """The tensor this rank holds of ``t`` (a DTensor's local shard, sharing its storage)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class DTensorZeroOptimizer:
    """ZeRO 1 over the replicas ``group`` for parameters that may be tensor-parallel DTensors
    (``ZeroRedundancyOptimizer`` broadcasts ``param.data``, which a DTensor is not).

    Each parameter has one owner replica (greedy by this rank's element count, largest first;
    every replica of a tensor-parallel rank holds the same shards, so all agree); a replica keeps
    optimizer state (``optim``: the ordinary optimizer over its share, whole DTensors) for its
    share only, steps it, and broadcasts each updated shard from its owner.  Gradients stay
    whole (averaged by the runtime's all-reduce, as ZeRO 1 does).  The optimizers here are
    elementwise, so stepping a shard is stepping that part of the parameter."""

    def __init__(self, name: str, params: Sequence[Any], *, lr: float, group: Any, fused: bool = False) -> None:
        import torch
        import torch.distributed as dist

        from runtime.training import make_optimizer

        self.params = list(params)
        self.group = group
        size, me = dist.get_world_size(group), dist.get_rank(group)
        load = [0] * size
        self.owner = [0] * len(self.params)
        for i in sorted(range(len(self.params)), key=lambda i: -_local(self.params[i]).numel()):
            r = min(range(size), key=lambda r: load[r])
            self.owner[i] = r
            load[r] += _local(self.params[i]).numel()
        self.sources = [dist.get_global_rank(group, r) for r in range(size)]
        self.mine = [p for p, r in zip(self.params, self.owner, strict=True) if r == me]
        # a replica with no share still needs param_groups (the runtime sets the learning rate)
        self.optim = make_optimizer(name, self.mine or [torch.zeros(0, requires_grad=True)], lr=lr, fused=fused)
        self.param_groups = self.optim.param_groups

    def step(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        for p in self.mine:  # a gradient left as partial sums: sum it first (elementwise updates need it whole)
            g = p.grad
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)
        self.optim.step()
        with torch.no_grad():
            works = [
                dist.broadcast(_local(p), src=self.sources[r], group=self.group, async_op=True)
                for p, r in zip(self.params, self.owner, strict=True)
            ]
            for w in works:
                w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


#: ``pipeplan run --dp-bucket-mb``'s default: DDP's own bucket size (MiB)
DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class GradientReduction:
    """Which path averages a plan's data-parallel gradients (:func:`gradient_reduction`):
    ``"ddp"`` (torch's ``DistributedDataParallel``: bucketed, overlapped with each stage's last
    backward), ``"fsdp2"`` (ZeRO 2/3: FSDP2's reduce-scatters), ``"all-reduce"`` (the runtime's
    flat all-reduce after the schedule) or ``"none"`` (D = 1); ``why``: the reason a plan with
    D > 1 does not go through DDP."""

    path: str
    why: str = ""


def gradient_reduction(spec: MeshSpec) -> GradientReduction:
    """The path of ``spec``'s data-parallel gradients (expert-parallel weights, E > 1, are
    reduced over their own groups by the runtime whatever the path).

    DDP for ZeRO 0/1 with T = 1 and a schedule without split backward.  The others keep the
    runtime's flat all-reduce, for structural reasons:

    * T > 1: the tensor-parallel weights are DTensors.  DDP takes them only through its 2-D
      path (``device_mesh=`` a slice of the mesh: torch's ``_pre_dp_module_transform``), which
      swaps them for their local shards between forwards and rebuilds DTensors in a forward
      pre-hook, while the runtime's ZeRO 1 optimizer (:class:`DTensorZeroOptimizer`), its
      checkpoints and ``--check`` read the parameters as DTensors (not wired, not measured).
      FSDP2 over a ``dp_replicate`` x ``dp_shard`` mesh (HSDP) takes them as they are, but under
      torch's pipelining FSDP2 reduces in ``perform_reduce_grad`` after the last backward, not
      during it (torch 2.13: ``PipelineStage.backward_maybe_with_nosync`` turns gradient sync off
      for every micro-batch), so it would hide nothing the flat all-reduce does not;
    * the split-backward schedules (:data:`SPLIT_BACKWARD_SCHEDULES`): the weight gradients of a
      stage after the first are computed by ``torch.autograd.grad`` and written to ``.grad`` by
      hand (``stage_backward_weight``), so DDP's gradient hooks never fire for them.
    """
    d = spec.data_parallel_degree
    if d == 1:
        return GradientReduction("none")
    if spec.zero_stage >= 2:
        return GradientReduction("fsdp2", f"ZeRO {spec.zero_stage}: FSDP2 reduce-scatters what it shards")
    if spec.tensor_parallel_degree > 1:
        return GradientReduction(
            "all-reduce",
            f"T = {spec.tensor_parallel_degree}: DDP takes the tensor-parallel DTensor weights only as local shards "
            "swapped in between forwards, which the runtime's optimizer, checkpoints and --check do not expect, and "
            "FSDP2 (HSDP) under torch's pipelining reduces only after the last backward",
        )
    if spec.schedule in SPLIT_BACKWARD_SCHEDULES:
        return GradientReduction(
            "all-reduce",
            f"schedule {spec.schedule} splits the backward: its weight gradients come from torch.autograd.grad, "
            "which DDP's gradient hooks do not see",
        )
    return GradientReduction("ddp")


def reduces_data_gradients(spec: MeshSpec, p: Any) -> bool:
    """True when FSDP2 averages ``p``'s gradient over the data axis itself (ZeRO 2/3, D > 1,
    ``p`` sharded by it): the runtime's all-reduce must then skip it."""
    from torch.distributed.tensor import DTensor

    return spec.zero_stage >= 2 and spec.data_parallel_degree > 1 and isinstance(p, DTensor)


def local_grad(p: Any) -> Any:
    """The gradient tensor of this rank (a DTensor's local shard), for in-place collectives
    such as the tied-weight all-reduce."""
    from torch.distributed.tensor import DTensor

    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g


def all_reduce_grad(p: Any, group: Any, *, divide: int = 1) -> None:
    """Sum (then divide) ``p.grad`` over ``group`` in place; a DTensor gradient by its local
    shard, written back (the tied-weight sum between pipeline ranks, the flat data-parallel
    average).  Every rank of ``group`` must hold the same sharding of ``p``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    g = p.grad
    if isinstance(g, DTensor):
        local = g.to_local().clone()
        dist.all_reduce(local, group=group)
        if divide != 1:
            local /= divide
        p.grad = DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())
        return
    dist.all_reduce(g, group=group)
    if divide != 1:
        g /= divide


def squared_grad_norm(params: Iterable[Any], *, skip: set[int] | frozenset[int] = frozenset()) -> float:
    """Sum of squared gradient norms of ``params`` (except ids in ``skip``), DTensor gradients
    counted whole (a collective over their mesh: every rank of it must call this, with the same
    parameters).  Add the pipeline ranks' parts with an all-reduce over "pp"."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0.0
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        g = p.grad.detach()
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        total += float(n) ** 2
    return total


def full_parameters(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Name -> the whole parameter on CPU (a DTensor gathered: every rank of its mesh must call
    this, with the same parameters), for ``--check``."""
    from torch.distributed.tensor import DTensor

    from runtime._strided_shard import full_tensor

    out = {}
    for name, p in named:
        t = p.detach()
        out[name] = (full_tensor(t) if isinstance(t, DTensor) else t).cpu().clone()
    return out


def full_gradients(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """Name -> the whole gradient on CPU (``None``: the parameter has none; a DTensor gathered:
    every rank of its mesh must call this, with the same parameters), for ``--check``."""
    from torch.distributed.tensor import DTensor

    from runtime._strided_shard import full_tensor

    out: dict[str, Any] = {}
    for name, p in named:
        g = p.grad
        if g is None:
            out[name] = None
            continue
        g = g.detach()
        out[name] = (full_tensor(g) if isinstance(g, DTensor) else g).cpu().clone()
    return out


def gradient_norms(named: Iterable[tuple[str, Any]]) -> dict[str, float]:
    """Name -> the L2 norm of the whole gradient in float64 (0 without one; a DTensor's is a
    collective over its mesh, as in :func:`full_gradients`), for ``--check``."""
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, float] = {}
    for name, p in named:
        if p.grad is None:
            out[name] = 0.0
            continue
        n = torch.linalg.vector_norm(p.grad.detach().double())
        out[name] = float(n.full_tensor() if isinstance(n, DTensor) else n)
    return out

