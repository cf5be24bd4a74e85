"""The baselines' splits (:mod:`planner.baselines`) as candidates, so a plan never loses to them,
and the configuration a Megatron-LM user writes by hand (:func:`seed_with_stack_rule`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from planner.baselines import baseline_splits
from planner.cost.memory import usable_bytes
from planner.schedules import ScheduleError, check_schedule_shape
from planner.schema import Schedule
from planner.search.space import SIM_ACTION_LIMIT, Config, fixed_ranges, make_groups
from planner.search.state import SearchState, consider
from planner.splits.recompute import with_prefix_recompute, with_recompute


def seed_with_baselines(search: SearchState, configs: Sequence[Config]) -> None:
    """The baselines' splits (where the options allow them) as candidates: simulated only
    when their bound beats the best plan found, so the plan is never worse than them."""
    if fixed_ranges(search.options) is not None:
        return
    g = search.training.global_batch_size
    for cfg, ranges in baseline_splits(search.profile, search.cluster, search.training, search.options):
        # the baselines follow the options; they may use micro-batches larger than the
        # search tries (MAX_EXTRAPOLATION), which is why they are candidates of their own
        if cfg.data_parallel * cfg.pipeline_degree > search.cluster.num_devices or g % (
            cfg.data_parallel * cfg.num_microbatches
        ):
            continue
        try:
            check_schedule_shape(*cfg.shape)
        except ScheduleError:
            continue
        groups = make_groups(
            search.cluster, search.training, cfg.data_parallel, cfg.pipeline_degree, default_layout=True
        )
        sm = search.stage_model(cfg)
        split = with_recompute(search, sm, groups, tuple(ranges), tuple(sm.owner))
        if split is not None:
            consider(search, sm, groups, split)


#: pipeline degrees the hand rule tries: the fewest that may hold the model, and the next ones
STACK_RULE_DEGREES = 4


def stack_rule_ranges(num_layers: int, parts: int, *, count_ends: bool = False) -> list[tuple[int, int]] | None:
    """Megatron's even split: the inner layers (a decoder stack's blocks) evenly over ``parts``
    stages, the first layer (the embedding) joining the first stage and the last (the head)
    the last stage; ``None`` when the blocks do not divide evenly.

    ``count_ends``: the embedding and the head count as one layer each (Megatron-LM's
    ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``, the
    split Llama 3 405B's 126 blocks took on 16 ranks: every layer evenly over ``parts``), so the
    first and the last stage hold one block fewer; ``None`` when the layers do not divide evenly."""
    if count_ends:
        if parts < 1 or num_layers < parts or num_layers % parts:
            return None
        per = num_layers // parts
        return [(i * per, (i + 1) * per) for i in range(parts)]
    inner = num_layers - 2
    if parts < 1 or inner < parts or inner % parts:
        return None
    per = inner // parts
    bounds = [0, *(1 + i * per for i in range(1, parts)), num_layers]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


#: most chunks per rank the hand rule takes with one layer per chunk (Llama 3 405B: 8 on 16 ranks)
MAX_RULE_CHUNKS = 8


def rule_splits(
    num_layers: int, k: int, chunks: Sequence[int], *, one_layer_chunks: bool = False
) -> list[tuple[int, list[tuple[int, int]]]]:
    """The hand rule's (chunks per rank v, ranges) on ``k`` pipeline ranks, for each v in
    ``chunks`` (v = 1: one stage per rank): the blocks evenly over k·v chunks.  Where they
    divide for no v, the layers with the embedding and the head counted instead
    (:func:`stack_rule_ranges`: what Megatron's accounting flags are for), and with
    ``one_layer_chunks`` also v = layers / k, one layer per chunk (at most
    :data:`MAX_RULE_CHUNKS`): Llama 3 405B's split of 126 blocks on 16 ranks."""
    vs = [v for v in dict.fromkeys(chunks) if k > 1 or v == 1]
    out = [(v, r) for v in vs if (r := stack_rule_ranges(num_layers, k * v)) is not None]
    if out:
        return out
    if one_layer_chunks and k > 1 and num_layers % k == 0 and 1 < num_layers // k <= MAX_RULE_CHUNKS:
        vs = list(dict.fromkeys([*vs, num_layers // k]))
    return [(v, r) for v in vs if (r := stack_rule_ranges(num_layers, k * v, count_ends=True)) is not None]


def seed_with_stack_rule(search: SearchState, *, degrees: int = STACK_RULE_DEGREES) -> None:
    """The configuration a Megatron-LM user picks by hand, as candidates: micro-batch 1, the
    blocks split evenly, interleaved with v = 2 or 3 chunks (v = 1 too), recompute where memory needs
    it, at the fewest pipeline ranks whose share of the parameter state fits (and that split the
    blocks evenly) and the next ``degrees`` - 1 (the rest of the devices data-parallel).  A plan
    then never loses to that rule (Narayanan et al. SC'21, Table 1's configurations)."""
    opts = search.options
    if fixed_ranges(opts) is not None or isinstance(opts.stages, int):
        return
    cl, tr, n = search.cluster, search.training, search.profile.num_layers
    g = tr.global_batch_size
    static = sum(x.param_bytes for x in search.profile.layers) * (
        1 + tr.gradient_bytes_per_param_byte + tr.optimizer_state_factor
    )
    usable = min(usable_bytes(d, tr) for d in cl.devices)
    allowed = opts.schedules or (["interleaved-1f1b", "1f1b"] if opts.schedule is None else [opts.schedule])
    tried = 0
    for k in range(1, cl.num_devices + 1):
        # (the fewest degrees that fit are tried whatever the clock says: a few estimates)
        if tried >= degrees or (tried and time.perf_counter() > search.wall_stop):
            break
        if cl.num_devices % k or static / k > usable:
            continue
        d = opts.data_parallel or cl.num_devices // k
        if d * k > cl.num_devices or g % d:
            continue
        m = g // d if opts.num_microbatches is None else opts.num_microbatches
        if g % (d * m):
            continue
        evenly = False  # (a degree that splits the layers evenly no way does not count)
        chunks = [opts.virtual_stages] if opts.virtual_stages else [2, 3]
        for v, ranges in rule_splits(n, k, [*chunks, 1], one_layer_chunks=opts.virtual_stages is None):
            sched: Schedule = "interleaved-1f1b" if v > 1 else "1f1b"
            if sched not in allowed or (opts.virtual_stages not in (None, v)):
                continue
            cfg = Config(d, k, m, sched, v)
            evenly = True
            if 2 * m * k * v > SIM_ACTION_LIMIT:
                continue  # (a step too long to simulate: the driver leaves such shapes out too)
            try:
                check_schedule_shape(*cfg.shape)
            except ScheduleError:
                continue
            groups = make_groups(cl, tr, d, k, default_layout=True)
            sm = search.stage_model(cfg)
            split = with_recompute(search, sm, groups, tuple(ranges), tuple(sm.owner))
            if split is not None:
                consider(search, sm, groups, split)
                if v > 1 and any(split.recompute):  # (Llama 3's: each rank its fewest first chunks)
                    prefix = with_prefix_recompute(search, sm, groups, tuple(ranges), tuple(sm.owner))
                    if prefix is not None and prefix != split:
                        consider(search, sm, groups, prefix)
        tried += evenly
