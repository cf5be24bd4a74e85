"""The baselines' splits (:mod:`planner.baselines`) as candidates, so a plan never loses to them."""

from __future__ import annotations

from collections.abc import Sequence

from planner.baselines import baseline_splits
from planner.schedules import ScheduleError, check_schedule_shape
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
