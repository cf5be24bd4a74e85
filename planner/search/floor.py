"""The configuration floor of a D x K problem: the least cheap bound over its configurations.

:func:`configuration_floor` runs level 0 of :mod:`planner.search.driver` alone, with no search:
every configuration the options allow gets :func:`planner.bounds.work.cheap_bound` (valid for
every split of it), and one whose parameters, gradients and optimizer state cannot fit its
ranks (:func:`planner.search.driver.static_fits`) has no plan.  So no plan of the problem is
faster than the floor.  The mesh search uses it where a D x K solve per (ZeRO stage, D) would
cost too much (:mod:`planner.search.axes`), at about :func:`floor_units` work units a
configuration.
"""

from __future__ import annotations

import math

from planner.bounds.work import cheap_bound
from planner.cost import profile_in_dtype
from planner.schema import Cluster, PlanOptions, Profile, TrainingSetup
from planner.search.driver import groups_of, static_fits
from planner.search.space import Group, enumerate_configs
from planner.search.state import SearchState

#: work units (as the driver's budget counts them) of one configuration's cheap bound: a fixed
#: part plus one unit per this many layers (measured: 0.11 ms at 48 layers, 0.31 ms at 1,022)
FLOOR_UNITS_FIXED = 40
FLOOR_LAYERS_PER_UNIT = 12


def floor_units(num_layers: int) -> float:
    """Work units of one configuration's cheap bound on a model of ``num_layers`` layers."""
    return FLOOR_UNITS_FIXED + num_layers / FLOOR_LAYERS_PER_UNIT


def configuration_floor(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions
) -> tuple[float, int]:
    """(floor in ms with the profile's step overhead, configurations bounded): no plan of the
    problem under ``options`` is faster than the floor (``math.inf`` when no configuration's
    static memory fits).  Raises :class:`planner.errors.InputError` as the driver's solve would."""
    profile = profile_in_dtype(profile, training.dtype)
    configs = enumerate_configs(profile, cluster, training, options)
    search = SearchState(profile, cluster, training, options, deadline=math.inf)
    cache: dict[tuple[int, int], list[Group]] = {}
    best = math.inf
    for cfg in configs:
        groups = groups_of(search, cfg, cache)
        if static_fits(search, cfg, groups):
            best = min(best, cheap_bound(search, cfg, groups))
    return best + profile.step_overhead_ms, len(configs)
