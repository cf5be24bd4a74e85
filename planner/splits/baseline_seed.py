"""The baselines' splits (:mod:`planner.baselines`) as candidates, so a plan never loses to them."""

from __future__ import annotations

from collections.abc import Sequence

from planner.baselines import baseline_splits
from planner.search.model import StageModel
from planner.search.space import Config, fixed_ranges, make_groups
from planner.search.state import SearchState, consider
from planner.splits.recompute import with_recompute


def seed_with_baselines(search: SearchState, configs: Sequence[Config]) -> None:
    """The baselines' splits (where the options allow them) as candidates: simulated only
    when their bound beats the best plan found, so the plan is never worse than them."""
    if fixed_ranges(search.options) is not None:
        return
    g = search.training.global_batch_size
    for cfg, ranges in baseline_splits(search.profile, search.cluster, search.training, search.options):
        # the baselines follow the options; they may use micro-batches larger than the
        # search tries (MAX_EXTRAPOLATION), which is why they are candidates of their own
        if (
            cfg.data_parallel * cfg.pipeline_degree > search.cluster.num_devices
            or g % (cfg.data_parallel * cfg.num_microbatches)
            or (cfg.schedule == "interleaved-1f1b" and cfg.num_microbatches % cfg.pipeline_degree)
            or (cfg.schedule == "1f1b" and cfg.num_microbatches < cfg.pipeline_degree)
        ):
            continue
        groups = make_groups(
            search.cluster, search.training, cfg.data_parallel, cfg.pipeline_degree, default_layout=True
        )
        sm = StageModel(search.costs_at(cfg.microbatch_size(search.training.global_batch_size)), cfg, search.training)
        k = cfg.pipeline_degree
        split = with_recompute(search, sm, groups, tuple(ranges), tuple(s % k for s in range(len(ranges))))
        if split is not None:
            consider(search, sm, groups, split)
