"""The state of one search: the problem, the best plan so far, what is left open, and caches.

:class:`SearchState` is what every bound (:mod:`planner.bounds`) and every split search
(:mod:`planner.splits`) reads and updates; :func:`consider` is how a split search offers a
candidate (simulated only when its lower bound can beat the best plan).  Work is counted in
units of about one simulated action (``work``), not seconds, so that the same input gives the
same plan on any machine and load; :mod:`planner.search.driver` sets the budgets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from planner.bounds.split import TransferBounds, split_lower_bound
from planner.cost import LayerCosts, ScheduleTemplates, layer_costs
from planner.schedules import (
    SPLIT_BACKWARD,
    walk_microbatches,
)
from planner.schema import Cluster, PlanOptions, Profile, Schedule, TrainingSetup
from planner.search.model import (
    RankCounts,
    RankPoints,
    Split,
    StageModel,
    closed_counts,
    conservative,
    quick_step,
    search_points,
    walk_counts,
)
from planner.search.space import Config, Group
from planner.simulator import CompiledSchedule

#: work units per simulated action (the compiled program runs about 5 actions per unit)
SIM_WORK = 0.2
#: the memory bounds walk a schedule's actions (rather than use its closed forms) up to this many
WALK_LIMIT = 2_000

T = TypeVar("T")


@dataclass
class SearchState:
    """One search: inputs, incumbent, open bounds, counters, work done and caches."""

    profile: Profile
    cluster: Cluster
    training: TrainingSetup
    options: PlanOptions
    deadline: float
    costs: dict[int, LayerCosts] = field(default_factory=dict)
    best_step: float = math.inf
    best: tuple[Config, Split, list[Group]] | None = None
    open_bounds: list[float] = field(default_factory=list)
    #: configurations whose bound is below the best step, with that bound: CP-SAT's work
    open_configs: dict[Config, tuple[float, list[Group]]] = field(default_factory=dict)
    #: best split found per configuration (CP-SAT hints)
    best_split_of: dict[Config, Split] = field(default_factory=dict)
    best_step_of: dict[Config, float] = field(default_factory=dict)
    compiled: dict[tuple[Schedule, int, int, int], CompiledSchedule] = field(default_factory=dict)
    #: memory points of each schedule shape's ranks (:func:`planner.schedules.memory_points`)
    points: dict[tuple[Schedule, int, int, int], RankPoints] = field(default_factory=dict)
    visited: int = 0
    pruned: int = 0
    infeasible: int = 0
    timed_out: bool = False
    too_big: int = 0
    #: configurations of the newer schedules the search left out of a large space
    restricted: int = 0
    pruned_after_visit: int = 0
    infeasible_after_visit: int = 0
    #: work done so far, in units of about one simulated action (deterministic, unlike time)
    work: float = 0.0
    work_budget: float = math.inf
    wall_stop: float = math.inf
    _param_bytes: int = -1
    #: (micro-batch size, devices of each position): :class:`planner.bounds.split.TransferBounds`
    transfer_bounds: dict[tuple[int, tuple[tuple[int, ...], ...]], TransferBounds] = field(default_factory=dict)
    #: the tables the bounds build once per search (:meth:`table`), by kind and key
    tables: dict[tuple[type, Hashable], object] = field(default_factory=dict)
    #: configurations whose bound the boundary table has settled (CP-SAT cannot raise it)
    chain_done: set[Config] = field(default_factory=set)
    #: schedule templates shared with the caller's other searches and estimates (the work of
    #: making one is counted as if this search made it: the same input, the same plan)
    templates: ScheduleTemplates = field(default_factory=ScheduleTemplates)

    @property
    def profile_param_bytes(self) -> int:
        if self._param_bytes < 0:
            self._param_bytes = sum(layer.param_bytes for layer in self.profile.layers)
        return self._param_bytes

    def points_of(self, cfg: Config) -> RankPoints:
        """The memory points of ``cfg``'s schedule, walked once per shape (about the cost of
        compiling it, counted as work; both come from one listing of its actions).  GPipe and
        1F1B have them in closed form; a long interleaved 1F1B schedule uses its closed-form
        upper bound (the search then keeps to it; the plan's own memory is walked by
        ``estimate`` and can only be lower)."""
        if cfg.shape not in self.points:
            if cfg.schedule in ("gpipe", "1f1b") or conservative(cfg, self.profile.num_layers):
                self.points[cfg.shape] = search_points(cfg, self.profile.num_layers)
            else:
                self._template(cfg)
        return self.points[cfg.shape]

    def compiled_of(self, cfg: Config) -> CompiledSchedule:
        """The compiled program of ``cfg``'s schedule, once per shape (counted as work)."""
        if cfg.shape not in self.compiled:
            if cfg.shape in self.points or (self.points_of(cfg) is not None and cfg.shape not in self.compiled):
                self.work += (3 if cfg.schedule in SPLIT_BACKWARD else 2) * cfg.num_microbatches * cfg.num_stages
                self.compiled[cfg.shape] = self.templates.program(*cfg.shape)
        return self.compiled[cfg.shape]

    def _template(self, cfg: Config) -> None:
        """List ``cfg``'s template once and keep what the search needs of it: its compiled
        program and its memory points (about two units of work an action)."""
        actions = (3 if cfg.schedule in SPLIT_BACKWARD else 2) * cfg.num_microbatches * cfg.num_stages
        self.work += 2 * actions
        if cfg.shape not in self.compiled:
            self.compiled[cfg.shape] = self.templates.program(*cfg.shape)
        if cfg.shape not in self.points:
            self.points[cfg.shape] = self.templates.memory(*cfg.shape)

    def exact_points_of(self, cfg: Config) -> RankPoints:
        """The memory walk of ``cfg``'s schedule itself, also where the search keeps to the
        closed form (:func:`planner.search.model.conservative`): listed once per shape at the
        fewest micro-batches with the same points (:func:`planner.schedules.walk_microbatches`),
        two units of work an action of that listing."""
        m = walk_microbatches(cfg.schedule, cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages)
        shape = (cfg.schedule, cfg.pipeline_degree, m, cfg.virtual_stages)

        def walk() -> _ExactWalk:
            self.work += 2 * (3 if cfg.schedule in SPLIT_BACKWARD else 2) * m * cfg.num_stages
            return _ExactWalk(self.templates.memory(*shape))

        return self.table(_ExactWalk, shape, walk).points

    def memory_counts(self, cfg: Config) -> list[RankCounts]:
        """What the memory bounds may assume of each rank's in-flight micro-batches: its
        schedule's walk when small enough, else the closed forms (``planned``: always)."""
        layers = self.profile.num_layers
        if cfg.schedule == "planned" or conservative(cfg, layers) or 2 * cfg.num_microbatches * cfg.num_stages > WALK_LIMIT:
            return closed_counts(cfg, layers)
        return self.table(_WalkCounts, cfg.shape, lambda: _WalkCounts(walk_counts(self.points_of(cfg)))).counts

    def stage_model(self, cfg: Config) -> StageModel:
        """:class:`StageModel` of ``cfg`` at its micro-batch size, sharing this search's caches."""
        b = cfg.microbatch_size(self.training.global_batch_size)
        return StageModel(self.costs_at(b), cfg, self.training, points=lambda: self.points_of(cfg))

    def costs_at(self, b: int) -> LayerCosts:
        if b not in self.costs:
            self.costs[b] = layer_costs(self.profile, b)
        return self.costs[b]

    def transfers_at(self, b: int, groups: Sequence[Group]) -> TransferBounds:
        """:class:`planner.bounds.split.TransferBounds` of these pipeline positions, cached."""
        key = (b, tuple(g.devices for g in groups))
        if key not in self.transfer_bounds:
            self.transfer_bounds[key] = TransferBounds.of(self.cluster, self.costs_at(b), groups)
        return self.transfer_bounds[key]

    def table(self, kind: type[T], key: Hashable, build: Callable[[], T]) -> T:
        """The ``kind`` table for ``key`` (say a micro-batch size), built on first use.

        The bounds keep their tables here (a knapsack, layer runs, pinned ranks), so that
        each is built once per search and this module need not know them.
        """
        full = (kind, key)
        if full not in self.tables:
            self.tables[full] = build()
        value = self.tables[full]
        assert isinstance(value, kind)
        return value

    def offer(self, cfg: Config, split: Split, groups: list[Group], step: float) -> None:
        if step < self.best_step_of.get(cfg, math.inf):
            self.best_step_of[cfg] = step
            self.best_split_of[cfg] = split
        key = (step, cfg, split.ranges, split.recompute, split.groups)
        if self.best is None or key < (self.best_step, self.best[0], self.best[1].ranges, self.best[1].recompute, self.best[1].groups):
            self.best_step = step
            self.best = (cfg, split, groups)


@dataclass(frozen=True)
class _ExactWalk:
    points: RankPoints


@dataclass(frozen=True)
class _WalkCounts:
    counts: list[RankCounts]


def consider(search: SearchState, sm: StageModel, groups: list[Group], split: Split) -> float:
    """Simulate ``split`` unless its lower bound already loses; offer it; its step (or inf)."""
    if split_lower_bound(sm, search.cluster, groups, split) >= search.best_step:
        return math.inf
    cfg = sm.cfg
    actions = (3 if sm.split_backward else 2) * cfg.num_microbatches * cfg.num_stages
    if cfg.schedule == "planned":
        search.work += 4 * actions  # list-scheduled and compiled for each split
    else:
        search.compiled_of(cfg)  # listed and compiled once per shape (counted there)
    step = quick_step(sm, search.cluster, groups, split, search.compiled)
    search.work += SIM_WORK * actions + 50
    search.offer(sm.cfg, split, groups, step)
    return step
