"""What the stages of this rank share and how their data-parallel gradients are reduced, found
before :func:`runtime.stages.build_stages` makes the first stage.

- :func:`tied_parameters`: tied weights whose copies sit on several pipeline ranks (one group
  each) and which copies the gradient norm leaves out;
- :func:`data_reduction`: torch DDP or the flat all-reduce, and DDP's bucket size;
- :func:`layer_owners`: the layer that names each weight, and how many of the rank's stages
  hold it.
"""

from __future__ import annotations

import argparse
from typing import Any

from planner.errors import InputError
from runtime.rank_state import RankState, StageSet


def tied_parameters(state: RankState) -> tuple[list[tuple[Any, Any]], set[int]]:
    """Tied parameters whose copies land on different pipeline ranks: one group per replica
    (and tensor-parallel rank), and this rank's copy in it.  The lowest pipeline rank holding a
    copy counts it in the gradient norm: the ids of the others' are the second value."""
    import torch.distributed as dist

    from planner.schedules import stage_ranks

    plan, split, spec, c = state.plan, state.job.split, state.spec, state.job.coords
    rank_of_stage = stage_ranks(plan.placement, plan.pipeline_degree, plan.virtual_stages)
    stage_of_unit = {u: st.index for st in plan.stages for u in range(st.start, st.stop)}
    tied: list[tuple[Any, Any]] = []
    not_mine_in_norm: set[int] = set()
    for group in split.shared_parameters():
        ranks_k = sorted({rank_of_stage[stage_of_unit[u]] for u, _ in group})
        if len(ranks_k) < 2:
            continue  # all copies on one rank: one tensor, gradients already summed
        for d, t in [(d, t) for d in range(spec.data_parallel_degree) for t in range(spec.tensor_parallel_degree)]:
            pg = dist.new_group([spec.rank_of(kk, d, t) for kk in ranks_k])  # every rank creates every group
            if d == c.replica and t == c.tp_rank and c.pp_rank in ranks_k:
                u, name = next(
                    (u, n) for u, n in group if rank_of_stage[stage_of_unit[u]] == c.pp_rank
                )
                param = split.units[u].get_parameter(name)
                tied.append((pg, param))
                if c.pp_rank != ranks_k[0]:
                    not_mine_in_norm.add(id(param))
    return tied, not_mine_in_norm


def data_reduction(args: argparse.Namespace, spec: Any) -> tuple[Any, float]:
    """The data-parallel gradients' path and DDP's bucket size (MiB): torch DDP (bucketed,
    during each stage's last backward) where :func:`runtime.mesh.gradient_reduction` allows it,
    else the flat all-reduce after the schedule."""
    from runtime.mesh import DEFAULT_BUCKET_MB, GradientReduction, gradient_reduction

    reduction = gradient_reduction(spec)
    if args.dp_reduction == "flat" and reduction.path == "ddp":
        reduction = GradientReduction("all-reduce", "asked for with --dp-reduction flat")
    bucket_mb = args.dp_bucket_mb if args.dp_bucket_mb is not None else DEFAULT_BUCKET_MB
    if bucket_mb <= 0:
        raise InputError(f"--dp-bucket-mb {bucket_mb:g}: give a bucket size above 0 MiB (DDP's default is 25)")
    return reduction, bucket_mb


def layer_owners(state: RankState, built: StageSet) -> dict[int, int]:
    """Fill ``built.layer_of`` (a weight by the first layer holding it); return how many of this
    rank's stages hold each weight (two: a tied embedding and head under a V schedule; two DDP
    reducers would each average it, the flat all-reduce does it once)."""
    plan, split = state.plan, state.job.split
    for s in state.job.my_stages:
        for u in range(plan.stages[s].start, plan.stages[s].stop):
            for p in split.units[u].parameters():
                built.layer_of.setdefault(id(p), split.names[u])
    holders: dict[int, int] = {}
    for s in state.job.my_stages:
        for i in {id(p) for u in range(plan.stages[s].start, plan.stages[s].stop) for p in split.units[u].parameters()}:
            holders[i] = holders.get(i, 0) + 1
    return holders
