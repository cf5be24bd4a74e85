"""The plan's tensor-parallel shardings, and the refusal of what the runtime cannot
execute (part of :mod:`runtime.mesh`).

:func:`split_sharding` gives each unit the sharding the profiler priced it with
(:func:`plan_sharding`, :func:`runtime.tp_rules.unit_sharding`); :func:`refuse_unexecutable`
raises, before training, on every axis the runtime cannot execute, each problem naming its layer,
with the fix; :func:`stage_shardings` re-indexes them for one stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from planner.errors import InputError
from runtime.mesh_spec import MeshSpec
from runtime.tp_graph import _fused_split_site
from runtime.tp_heads import heads_problem
from runtime.tp_rules import (
    KIND_RULES,
    RULES,
    RULES_WITH_EXPERTS,
    UnitSharding,
    _has_grouped_experts,
    _linear_modules,
    profiled_kinds,
    unit_sharding,
)
from runtime.tp_sequence import _sequence_parallel_problem


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


def stage_shardings(all_shardings: Mapping[int, UnitSharding], start: int, stop: int) -> dict[int, UnitSharding]:
    """The shardings of units ``start..stop`` re-indexed from 0 (a stage's own units)."""
    return {u - start: s for u, s in all_shardings.items() if start <= u < stop}
