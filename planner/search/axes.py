"""The search over the mesh axes beyond D x K: tensor parallelism T, sequence parallelism, ZeRO.

:func:`solve` (re-exported as :func:`planner.solver.solve`) chooses D x T x K (plus v, M,
schedule, recompute, ZeRO stage) jointly.  Each choice of T and sequence parallelism is a
*mesh family*; in it every plan is a D x K plan of one tensor-parallel rank
(:func:`planner.mesh.mesh_problem`), solved by the D x K branch and bound of
:func:`planner.search.driver.solve`, whose bounds stay valid there unchanged.

Families are taken in order of promise (their work bound times the bubble of the pipeline
their parameter state needs); a family whose work bound reaches the best plan is excluded by it.
First every family's ZeRO-0 solve (1), then the ZeRO solves (2, 3):

1. ZeRO 0 with D free: one driver solve; its proven bound covers every ZeRO-0 plan of the family.
   When ZeRO is free and that plan is not memory-bound (no stage recomputes, every device below
   ``MEMORY_BOUND_FILL`` of its memory), ZeRO is not searched in the family: it saves memory and
   mostly pays only where memory binds (mostly: ZeRO-2/3 trade the collective after the step
   for per-micro-batch ones that ``zero_overlap`` may hide, so they can be faster); the message
   says so, and the gap then covers ZeRO 0 there (``--zero N`` searches it).  A small instance
   (:func:`small_instance`) is never cut short this way, and solves every (ZeRO stage,
   D) apart when there are at most ``EXACT_ZERO_SOLVES``: its gap is exact over the whole space.
2. When ZeRO is free (and the family is memory-bound, or nothing fits) or fixed above 0: the *relaxed* problem of the family (no parameter,
   gradient or optimizer-state bytes and no gradient collective: every ZeRO stage at every D
   holds and moves at least that, and ZeRO-2/3's per-micro-batch collectives only add time), one
   driver solve whose bound covers every ZeRO plan of the family.
3. ZeRO 1, 2, 3 (or the fixed stage) at the data-parallel degrees of the best plan and of the
   relaxed one (every other D too while nothing fits), one driver solve each with D fixed:
   plans, not bounds (skipped once the relaxed bound reaches the best plan).
4. The open bounds, least first: a family the clock left unsolved (its work bound) or ZeRO's
   relaxation (which drops the static memory and the gradient collective) is raised to the least
   *configuration floor* (:mod:`planner.search.floor`: the driver's level 0 alone) over the
   family's problems, one per ZeRO stage and D with its own memory and collectives (and ZeRO 0
   with D free for an unsolved family), within ``FLOOR_SHARE`` of the time limit in work units
   and while the clock is within the limit; once the least open bound cannot be raised, the rest
   would change no gap.  The plan is settled by then: only the gap changes.

The solves share the user's time limit: their own limits add up to it (the first solve gets
``FIRST_SHARE`` of it when others may follow, each later one ``SOLVE_SHARE``, none is started
with less than ``MIN_SOLVE_S`` left), counted in limits rather than seconds so that the same
input gives the same plan; a small instance's solves, which end when they prove their optimum,
each get the whole limit.

Selective recompute (:func:`planner.mesh.selective_layer`) doubles the families when it is free
and the profile gives its bytes: a selective family is solved with full recompute forbidden (one
granularity per plan, as in Megatron).  Like ZeRO it only trades time for memory, so when it is
free its families are solved after the others and only if one of their plans is memory-bound (or
one had no plan); otherwise the message says the gap covers plans without it.

Every candidate is re-priced by :func:`planner.cost.estimate` on the real mesh and the
fastest that fits is returned.  The proven bound is the least of the families' bounds (1, 2
and 4; a family not solved contributes its work bound or floor), so the gap is valid over the whole space;
when ZeRO's plans are memory-bound it can be loose (the relaxation drops the static memory),
and the message says which bound is open.  A profile whose layers do not shard gets T = 1
only (a larger T would run the same work on fewer groups).  T stays inside a node unless
``tensor_parallel_across_nodes``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from planner.context import sequence_length
from planner.cost import Layout, ScheduleTemplates, estimate, lower_bound_ms, profile_in_dtype
from planner.cost.memory import usable_bytes
from planner.errors import InfeasibleError, InputError, SearchCutShortError
from planner.experts import expert_counts
from planner.infeasible import any_fits
from planner.mesh import Mesh, check_mesh, mesh_problem, recomputes_selectively
from planner.schema import (
    Cluster,
    Interconnect,
    Plan,
    PlanOptions,
    Profile,
    SolverInfo,
    TrainingSetup,
)
from planner.search.driver import WORK_PER_SECOND, SeedSplit, seed_split
from planner.search.driver import solve as solve_mesh_family
from planner.search.floor import configuration_floor, floor_units
from planner.search.space import enumerate_configs
from planner.splits.exhaustive import SMALL_LAYERS

#: share of the time limit each driver solve gets (at least MIN_SOLVE_S)
SOLVE_SHARE = 0.125
MIN_SOLVE_S = 0.2
#: share the first family's ZeRO-0 solve gets when other solves may follow (the most promising
#: family: its plan prunes the rest)
FIRST_SHARE = 0.5
#: a small instance starts no solve after this multiple of the time limit, a larger one none after
#: the limit (what is left keeps its bound); the solves' own limits add up to the time limit (but
#: a small instance's: each gets all of it)
WALL_SAFETY = 3.0
#: ZeRO stages tried when the stage is free
ZERO_STAGES = (1, 2, 3)
#: share of the time limit (in the driver's work units) the (ZeRO stage, D) floors may use to
#: raise the relaxed ZeRO bounds (phase 4)
FLOOR_SHARE = 0.5


@dataclass(frozen=True)
class _Family:
    tensor_parallel: int
    sequence_parallel: bool
    selective_recompute: bool = False
    context_parallel: int = 1
    context_attention: str = "all-gather"

    @property
    def group(self) -> int:
        """Devices per virtual device: T x C."""
        return self.tensor_parallel * self.context_parallel

    def mesh(self, zero: int = 0, expert: int = 1) -> Mesh:
        return Mesh(self.tensor_parallel, zero, self.sequence_parallel, self.selective_recompute,
                    self.context_parallel, expert, self.context_attention)

    def describe(self) -> str:
        return (f"T={self.tensor_parallel}{'+SP' if self.sequence_parallel else ''}"
                f"{f' C={self.context_parallel}' if self.context_parallel > 1 else ''}"
                f"{' selective' if self.selective_recompute else ''}")


def tensor_parallel_degrees(profile: Profile, cluster: Cluster, options: PlanOptions) -> list[int]:
    """The T values the search tries: the fixed one, else every power of two that fits a node
    (or the cluster, when groups may span nodes); only 1 when no layer shards."""
    if options.tensor_parallel is not None:
        return [options.tensor_parallel]
    if not any(layer.shards for layer in profile.layers):
        return [1]
    cap = cluster.num_devices if options.tensor_parallel_across_nodes else min(cluster.devices_per_node, cluster.num_devices)
    out, t = [], 1
    while t <= cap:
        if options.tensor_parallel_across_nodes or cluster.devices_per_node % t == 0:
            out.append(t)
        t *= 2
    return out


def selective_choices(profile: Profile, options: PlanOptions) -> list[bool]:
    """Whether the search tries Megatron's selective recompute: the fixed choice, else both when
    the profile gives its bytes and no stage's full recompute is asked for."""
    full = options.recompute is True or (isinstance(options.recompute, list) and any(options.recompute))
    if options.selective_recompute is not None:
        if options.selective_recompute and full:
            raise InputError(
                "--selective-recompute and full recompute exclude each other (one recompute granularity "
                "per plan, as in Megatron): drop one of them"
            )
        return [options.selective_recompute]
    if not recomputes_selectively(profile) or full:
        return [False]
    return [False, True]


#: sequences at least this long make the search try context parallelism (C > 1) on its own
CONTEXT_PARALLEL_MIN_SEQ = 16384


def context_parallel_degrees(profile: Profile, cluster: Cluster, options: PlanOptions) -> list[int]:
    """The C values the search tries: the fixed one, else 1 and, for sequences of at least
    ``CONTEXT_PARALLEL_MIN_SEQ`` tokens, every power of two up to 16 that divides the sequence."""
    if options.context_parallel is not None:
        return [options.context_parallel]
    seq = sequence_length(profile)
    if seq is None or seq < CONTEXT_PARALLEL_MIN_SEQ:
        return [1]
    return [c for c in (1, 2, 4, 8, 16) if seq % c == 0 and c <= cluster.num_devices]


def expert_parallel_degrees(profile: Profile, options: PlanOptions) -> list[int]:
    """The E values the search tries: the fixed one, else 1 and (an MoE profile) every power of
    two up to 64 that divides every MoE layer's expert count."""
    if options.expert_parallel is not None:
        return [options.expert_parallel]
    counts = expert_counts(profile)
    if not counts:
        return [1]
    return [e for e in (1, 2, 4, 8, 16, 32, 64) if all(n % e == 0 for n in counts)]


def _families(profile: Profile, cluster: Cluster, options: PlanOptions) -> list[_Family]:
    out: list[_Family] = []
    selective = selective_choices(profile, options)
    for t in tensor_parallel_degrees(profile, cluster, options):
        sps = [options.sequence_parallel] if options.sequence_parallel is not None else [False, True]
        for sp in sps:
            if sp and t == 1:
                continue
            for c in context_parallel_degrees(profile, cluster, options):
                if c > 1 and (t * c > cluster.num_devices or cluster.num_devices % (t * c)):
                    continue
                out.extend(_Family(t, sp, sr, c, options.context_attention) for sr in selective)
    if not out:
        raise InputError("sequence parallelism needs --tensor-parallel T > 1: give T, or drop --sequence-parallel")
    return out


def _bound_of(plan: Plan) -> float:
    """The proven lower bound behind a driver plan: step x (1 - gap)."""
    return plan.predicted.step_time_ms * (1.0 - plan.solver.gap)


def work_floor(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> float:
    """A lower bound of every plan of the options' mesh space, partial recompute included: the
    least family's forward and backward work spread over every device (recompute only adds
    work, memory is not looked at).  A few milliseconds per family."""
    base = profile_in_dtype(profile, training.dtype)
    return min(_family_load(base, cluster, training, fam).work for fam in _families(base, cluster, options))


def _relaxed_training(training: TrainingSetup) -> TrainingSetup:
    return training.model_copy(update={
        "optimizer": "sgd", "optimizer_state_bytes_per_param_byte": 0.0, "gradient_bytes_per_param_byte": 0.0,
    })


def solve(
    profile: Profile,
    cluster: Cluster,
    training: TrainingSetup,
    options: PlanOptions | None = None,
    *,
    templates: ScheduleTemplates | None = None,
) -> Plan:
    """The fastest plan over D x T x K (and v, M, schedule, recompute, ZeRO) that fits.

    ``templates``: the schedule templates to list, compile and walk schedules in (shared with the
    caller's other searches of the same cluster: the relaxed bound of partial recompute).

    Raises :class:`planner.errors.InputError` for contradictory options and
    :class:`planner.errors.InfeasibleError` when nothing fits (naming the mesh axes that would).
    """
    options = options or PlanOptions()
    families = _families(profile, cluster, options)
    zero_fixed = options.zero_stage
    experts = expert_parallel_degrees(profile, options)
    if len(families) == 1 and families[0] == _Family(1, False, False) and experts == [1] and (
        zero_fixed == 0 or options.data_parallel == 1 or cluster.num_devices == 1
    ):
        return _plain(profile, cluster, training, options)
    start = time.perf_counter()
    base = profile_in_dtype(profile, training.dtype)
    for fam in families:
        check_mesh(fam.mesh(), cluster, across_nodes=options.tensor_parallel_across_nodes)
    per_solve = max(MIN_SOLVE_S, options.time_limit_s * SOLVE_SHARE)
    small = small_instance(base, cluster, training)
    if small:
        # a small instance's solves end when they prove their optimum, long before the limit:
        # the whole limit is only their wall-clock net (which a loaded machine may reach)
        per_solve = options.time_limit_s
    sub = options.model_copy(update={
        "time_limit_s": per_solve, "tensor_parallel": None, "zero_stage": None, "sequence_parallel": None,
        "selective_recompute": None, "context_parallel": None, "expert_parallel": None,
    })
    zeros: list[int] = [zero_fixed] if zero_fixed is not None else [0, *ZERO_STAGES]
    if options.data_parallel == 1 or cluster.num_devices == 1:
        zeros = [0]  # one replica: ZeRO shards nothing
    # expert parallelism, like ZeRO, only trades time (the all-to-alls) for memory (the experts'
    # bytes / E): its plans are solved with D fixed beside ZeRO's, bounded by the same relaxation;
    # a fixed E > 1 leaves no plan to the D-free solves of ZeRO 0
    expert_fixed = options.expert_parallel is not None and options.expert_parallel > 1

    best: Plan | None = None
    cut_short = False  # some solve ran out of time before it found a plan or proved there is none
    allotted = 0.0  # time limits given to the solves so far
    skipped_zero: list[_Family] = []
    bounds: list[float] = []
    solves = 0
    notes: list[str] = []
    # the schedule templates this search has made (the same long schedules are priced again and again)
    templates = templates if templates is not None else ScheduleTemplates()

    def offer(plan: Plan) -> None:
        nonlocal best
        if all(s.memory_bytes <= s.memory_limit_bytes for s in plan.stages) and (
            best is None or plan.predicted.step_time_ms < best.predicted.step_time_ms
        ):
            best = plan

    def price(fam: _Family, zero: int, split: SeedSplit, *, solver: SolverInfo, actions: list[str] | None = None,
              expert: int = 1) -> Plan:
        """A D x K split of the family's problem priced on the whole mesh (each T x C group's first
        device standing for the group)."""
        return estimate(
            base, cluster, training,
            Layout(
                split.ranges,
                num_microbatches=split.num_microbatches,
                schedule=split.schedule,
                recompute=split.recompute,
                data_parallel=split.data_parallel,
                pipeline_degree=split.pipeline_degree,
                devices=[[d * fam.group for d in devs] for devs in split.devices],
                actions=actions,
                tensor_parallel=fam.tensor_parallel,
                zero_stage=zero if split.data_parallel > 1 else 0,
                sequence_parallel=fam.sequence_parallel,
                tensor_parallel_across_nodes=options.tensor_parallel_across_nodes,
                selective_recompute=fam.selective_recompute,
                context_parallel=fam.context_parallel,
                expert_parallel=expert,
                context_attention=fam.context_attention,
            ),
            solver=solver,
            templates=templates,
        )

    def reprice(plan: Plan, fam: _Family, zero: int, expert: int = 1) -> Plan:
        # only a planned schedule's actions are its own; the others are their schedule's template,
        # which estimate makes again (cheaper than parsing and checking 10^5 actions of text)
        actions = plan.actions if plan.schedule == "planned" else None
        return price(fam, zero, SeedSplit.of(plan), solver=plan.solver, actions=actions, expert=expert)

    def run(
        fam: _Family, zero: int, data_parallel: int | None, *, relaxed: bool = False, first: bool = False,
        optimistic_link: bool = False, expert: int = 1,
    ) -> Plan | None:
        nonlocal solves, allotted
        solves += 1
        mesh = fam.mesh(0 if relaxed else zero, 1 if relaxed else expert)
        train = _relaxed_training(training) if relaxed else training
        d = data_parallel if data_parallel is not None else 1
        # ZeRO-2/3 collectives priced on the inter-node link here (repriced after), or on the
        # faster link when the solve must bound every K (the intra-node one: pipeline degree 1)
        k_hint = 1 if optimistic_link else cluster.num_devices
        problem = mesh_problem(base, cluster, train, mesh, data_parallel=d, pipeline_degree=k_hint,
                               across_nodes=options.tensor_parallel_across_nodes)
        prof = problem.profile
        if relaxed:  # ZeRO-3 holds parameters / D: the relaxation holds none
            prof = prof.model_copy(update={"layers": [x.model_copy(update={"param_bytes": 0}) for x in prof.layers]})
        opts = sub.model_copy(update={"data_parallel": data_parallel} if data_parallel is not None else {})
        if fam.selective_recompute:  # one granularity per plan: no stage recomputes in full
            opts = opts.model_copy(update={"recompute": False})
        if first and not relaxed:
            share = 1.0 if len(families) == 1 and not any(z > 0 for z in zeros) else FIRST_SHARE
            opts = opts.model_copy(update={"time_limit_s": max(per_solve, options.time_limit_s * share)})
        if not small:
            # the solves share the user's limit: each gets at most what the ones before it left
            # (counted in limits, not seconds, so the same input gives the same plan; late()
            # starts none once less than MIN_SOLVE_S is left)
            opts = opts.model_copy(update={"time_limit_s": max(MIN_SOLVE_S, min(opts.time_limit_s, options.time_limit_s - allotted))})
            allotted += opts.time_limit_s
        try:
            # (no diagnosis: a family or ZeRO stage where nothing fits is one bound of many here)
            return solve_mesh_family(prof, problem.cluster, problem.training, opts, templates=templates, explain=False)
        except SearchCutShortError as cut:
            # out of time before any plan, nothing proven: its part of the space keeps the
            # bound of what the solve left open (never "nothing fits")
            nonlocal cut_short
            cut_short = True
            bounds.append(float(cut.details["bound_ms"]))
            return None
        except InfeasibleError:
            return None
        except InputError:
            if data_parallel != options.data_parallel or mesh.tensor_parallel > 1:
                return None  # a D the search chose, or a family that cannot host the fixed options
            raise

    def seed(fam: _Family, zero: int) -> Plan | None:
        """The family's Megatron hand rule, no search (a few simulations, one estimate)."""
        problem = mesh_problem(base, cluster, training, fam.mesh(zero), data_parallel=options.data_parallel or 1,
                               pipeline_degree=cluster.num_devices // fam.group,
                               across_nodes=options.tensor_parallel_across_nodes)
        opts = sub.model_copy(update={"data_parallel": options.data_parallel})
        try:
            found = seed_split(problem.profile, problem.cluster, problem.training, opts, templates=templates)
            if found is None:
                return None
            return price(fam, zero, found, expert=options.expert_parallel or 1, solver=SolverInfo(
                status="feasible", gap=1.0,
                message="plan: Megatron-LM's hand rule for its T (no faster plan found within the limit)"))
        except (InfeasibleError, InputError):
            return None

    def zero3_layout() -> None:
        """FSDP's and DeepSpeed's hand layout, no search: every device a data-parallel replica of
        the whole model, ZeRO-3, every layer checkpointed, each profiled micro-batch size that
        divides the batch (a few one-stage estimates), offered like the Megatron rule."""
        n, g = cluster.num_devices, training.global_batch_size
        free = (options.stages is None and options.schedule in (None, "1f1b") and options.recompute is not False
                and options.data_parallel in (None, n) and options.tensor_parallel in (None, 1)
                and options.num_microbatches is None and options.virtual_stages in (None, 1)
                and not options.sequence_parallel and not options.selective_recompute)
        if not free or n < 2 or 3 not in zeros or g % n or expert_fixed or options.context_parallel not in (None, 1):
            return
        for b in base.microbatch_sizes:
            if (g // n) % b:
                continue
            try:
                plan = estimate(
                    base, cluster, training,
                    Layout([(0, base.num_layers)], num_microbatches=g // (n * b), recompute=True,
                           data_parallel=n, pipeline_degree=1, zero_stage=3),
                    solver=SolverInfo(status="feasible", gap=1.0, message="plan: the ZeRO-3 hand layout "
                                      "(every device a replica, every layer checkpointed; no faster plan found "
                                      "within the limit)"),
                    templates=templates,
                )
            except InputError:
                continue
            offer(plan)

    loads = {fam: _family_load(base, cluster, training, fam) for fam in families}
    work = {fam: load.work for fam, load in loads.items()}
    # no solve starts once the limits given out reach the time limit (late()), nor after the time
    # limit on the clock (a small instance's only after WALL_SAFETY times it: a loaded machine's clock)
    deadline = start + (WALL_SAFETY if small else min(WALL_SAFETY, 1.0)) * options.time_limit_s

    def late() -> bool:
        spent = not small and options.time_limit_s - allotted < MIN_SOLVE_S
        if (spent or time.perf_counter() > deadline) and best is not None:
            notes.append("time limit reached: open families bounded by their work")
            return True
        return False

    order = sorted(families, key=lambda f: (_promise(base, cluster, training, f, loads[f]), f.tensor_parallel,
                                            f.sequence_parallel, f.selective_recompute))
    # phase 1: ZeRO 0 in every family (D free), most promising family first; the selective-
    # recompute families (when the choice is free) only where some plan is memory-bound
    zero_families: list[_Family] = []
    # (a small instance searches every ZeRO stage and selective recompute: exact, not skipped)
    # (an MoE profile searches expert parallelism with ZeRO: E also divides the gradient reduction)
    skip_zero = zero_fixed is None and not small and not expert_fixed and experts == [1]
    deferred = [f for f in order if f.selective_recompute] if (
        options.selective_recompute is None and 0 in zeros and not small) else []
    memory_seen = False
    # bounds phase 4 may raise: a family's work bound where the clock left it unsolved (True: its
    # ZeRO-0 plans too), or the relaxed bound of its ZeRO plans
    open_pieces: dict[_Family, tuple[float, bool]] = {}
    def zero_search(fam: _Family) -> None:
        """Phase 2 for one family: its ZeRO (and expert-parallel) plans at the promising D."""
        if late():
            open_pieces[fam] = (work[fam], False)
            return
        exact = _exact_zero_degrees(base, cluster, training, options, fam)
        if exact:
            # a small instance: every (ZeRO stage, D) solved with D fixed, each solve's proven
            # bound covering its plans, so the gap over ZeRO is exact (no relaxation)
            # (with expert parallelism each E too: its all-to-alls priced on the closest members,
            # pipeline degree 1, so each solve's bound covers its plans at every K)
            for z, e, d in ((z, e, d) for z in zeros for e in experts for d in exact
                            if (z > 0 or e > 1) and not (expert_fixed and e == 1)
                            and (d * fam.context_parallel) % e == 0):
                if late():
                    bounds.append(work[fam])
                    break
                plan = run(fam, z, d, optimistic_link=True, expert=e)
                if plan is not None:
                    bounds.append(_bound_of(plan))
                    offer(reprice(plan, fam, z, e))
            return
        relaxed = run(fam, 0, options.data_parallel, relaxed=True)
        if relaxed is None:
            return  # not even the relaxation fits: no ZeRO plan of this family does
        lower = _bound_of(relaxed)
        open_pieces[fam] = (lower, False)
        if options.data_parallel is not None:
            ds = [options.data_parallel]
        else:
            ds = [relaxed.data_parallel_degree]
            if best is not None and (best.tensor_parallel_degree, best.context_parallel_degree) == (
                    fam.tensor_parallel, fam.context_parallel):
                ds.insert(0, best.data_parallel_degree)
        groups = cluster.num_devices // fam.group
        promising = set(ds)
        if options.data_parallel is None and (0 not in zeros or best is None):
            # ZeRO fixed by the user (the relaxation's D may be 1: nothing to shard), or nothing
            # found yet (the relaxation's D may not fit a ZeRO stage where another D does): every
            # other replica count is a candidate too, after the promising ones (late() bounds it)
            ds += [d for d in range(2, groups + 1) if groups % d == 0]
        ds = [d for d in dict.fromkeys(ds) if (d > 1 or 0 not in zeros) and d <= groups and training.global_batch_size % d == 0]
        # (the largest E first: it holds the fewest experts, so it needs the fewest stages)
        pairs = [(z, e) for e in sorted(experts, reverse=True) for z in zeros
                 if (z > 0 or e > 1) and not (expert_fixed and e == 1)]
        for z, e in pairs:
            # (with experts sharded the model needs fewer stages, so more replicas: the D of the
            # fewest stages its parameter state then fits is tried first)
            own = _expert_replicas(base, cluster, training, fam, e, zero=z) if e > 1 else []
            for d in [*own, *(d for d in ds if d not in own)]:
                if (best is not None and lower >= best.predicted.step_time_ms * (1 - 1e-9)) or late():
                    break
                if d not in promising and 0 in zeros and best is not None and not expert_fixed:
                    continue  # (the other replica counts were for a first plan, now found)
                if (d * fam.context_parallel) % e:
                    continue  # E ranks are drawn from the D x C of a stage
                plan = run(fam, z, d, expert=e)
                if plan is not None:
                    offer(reprice(plan, fam, z, e))

    def phase1(fams: list[_Family], *, first_index: int) -> None:
        nonlocal skip_zero, memory_seen
        for i, fam in enumerate(fams, start=first_index):
            if best is not None and work[fam] >= best.predicted.step_time_ms:
                bounds.append(work[fam])  # its work alone reaches the best plan: every ZeRO stage too
                continue
            if i > 0 and late():  # (the first family is solved whatever the clock says)
                open_pieces[fam] = (work[fam], True)
                continue
            zero_families.append(fam)
            if 0 not in zeros or expert_fixed:
                continue
            plan0 = run(fam, 0, options.data_parallel, first=i == 0)
            if plan0 is not None:
                bounds.append(_bound_of(plan0))
                offer(reprice(plan0, fam, 0))
                skip_zero = skip_zero and not memory_bound(plan0)
                memory_seen = memory_seen or memory_bound(plan0)
                if (i == 0 and memory_bound(plan0) and not small and 1 in zeros and not expert_fixed
                        and options.data_parallel is None and plan0.data_parallel_degree > 1):
                    # the most promising family recomputes or fills its devices: ZeRO 1 at its
                    # plan's D frees the optimizer state that memory pays for; one probe, before
                    # the other families' ZeRO-0 solves take the clock (Llama 3's layout at
                    # 128K; the family's ZeRO search proper, with its bound, comes in phase 2)
                    probe = run(fam, 1, plan0.data_parallel_degree)
                    if probe is not None:
                        offer(reprice(probe, fam, 1))
            else:
                bounds.append(math.inf)  # proven: nothing of ZeRO 0 fits in this family
                skip_zero = False
                memory_seen = True

    # every family's hand-rule configurations first (cheap): whatever the clock allows later,
    # the plan is never slower than what a Megatron user would write for any T
    # (a family with sequence parallelism holds less and moves the same bytes as its twin without:
    # where both are searched, the twin's rule is not priced apart)
    seed_zero = zero_fixed if zero_fixed is not None else 0
    for fam in order:
        twin = _Family(fam.tensor_parallel, True, False)
        if not fam.selective_recompute and (fam.sequence_parallel or twin not in families):
            seeded = seed(fam, seed_zero)
            if seeded is not None:
                offer(seeded)
    zero3_layout()
    phase1([f for f in order if f not in deferred], first_index=0)
    skipped_selective = bool(deferred) and not memory_seen and best is not None
    if deferred and not skipped_selective:
        phase1(deferred, first_index=1)
    # phase 2: ZeRO 1-3, unless it is free and no family's ZeRO-0 plan is memory-bound (then the
    # gap covers ZeRO 0, and the message says so)
    if (not any(z > 0 for z in zeros) and experts == [1]) or skip_zero:
        skipped_zero.extend(zero_families if skip_zero else [])
        zero_families = []
    for fam in zero_families:
        zero_search(fam)
    # phase 4: the open pieces, least first, raised by their configuration floors where the
    # budget allows (the plan is settled: only the proven gap can change)
    searched_zero = any(z > 0 for z in zeros) and not skip_zero
    budget = FLOOR_SHARE * options.time_limit_s * WORK_PER_SECOND
    for fam in sorted(open_pieces, key=lambda f: (open_pieces[f][0], f.tensor_parallel, f.sequence_parallel,
                                                  f.selective_recompute)):
        if best is not None and open_pieces[fam][0] >= best.predicted.step_time_ms:
            break
        if time.perf_counter() > deadline and not small:
            break
        lower, zero0_too = open_pieces[fam]
        floor, used = _family_floor(base, cluster, training, options, sub, fam, zeros if searched_zero else [0],
                                    zero0_too=zero0_too and 0 in zeros, budget=budget)
        budget -= used
        if floor is None:
            break  # its bound stays the least of them: raising the rest changes no gap
        open_pieces[fam] = (max(lower, floor), zero0_too)
    bounds.extend(b for b, _ in open_pieces.values())
    if best is None:
        if cut_short:
            raise SearchCutShortError(
                f"no plan found within the time limit of {options.time_limit_s:g} s: some of the mesh "
                "search's solves ran out of time (a loaded machine, or a large problem) before they found a "
                f"plan or proved there is none; raise the time limit (--time-limit {max(2 * options.time_limit_s, 10):g})",
                {"bound_ms": min(bounds, default=0.0), "time_limit_s": options.time_limit_s},
            )
        raise _diagnose(base, cluster, training, options, families, zeros)
    bound = min(bounds) if bounds else best.predicted.step_time_ms
    step = best.predicted.step_time_ms
    gap = max(0.0, (step - bound) / step) if step > 0 else 0.0
    status = "optimal" if gap <= 1e-9 else "feasible"
    if status == "optimal":
        gap = 0.0
    wall = time.perf_counter() - start
    searched = [f for f in families if not (skipped_selective and f in deferred)]
    mesh_desc = ", ".join(f.describe() for f in searched)
    inner = best.solver.message
    if any(n.startswith("time limit reached") for n in notes):
        # the mesh search's note says it once, with what was left open
        inner = inner.removesuffix("; time limit reached")
    message = (
        f"mesh search: {len(searched)} {'family' if len(searched) == 1 else 'families'} ({mesh_desc}), ZeRO "
        f"{'/'.join(map(str, zeros))}; {solves} D x K solves"
        + (
            "; ZeRO 1-3 not searched: no ZeRO-0 plan is memory-bound (the gap covers ZeRO 0; --zero N searches it)"
            if skipped_zero
            else ""
        )
        + (
            "; selective recompute not searched: no plan is memory-bound (the gap covers plans without it; "
            "--selective-recompute searches it)"
            if skipped_selective
            else ""
        )
        + "; " + inner + "".join(f"; {n}" for n in dict.fromkeys(notes))
    )
    return best.model_copy(update={"solver": SolverInfo(status=status, gap=gap, wall_time_s=wall, message=message)})


#: a small instance (:func:`small_instance`) solves every (ZeRO stage, D) when there are at
#: most this many, instead of bounding ZeRO by its relaxation
EXACT_ZERO_SOLVES = 12
#: a small instance has at most SMALL_LAYERS layers, this many devices and this global batch
SMALL_DEVICES = 8
SMALL_BATCH = 64


def small_instance(profile: Profile, cluster: Cluster, training: TrainingSetup) -> bool:
    """Small enough to search exactly (every ZeRO stage and D apart, nothing skipped): at most
    ``SMALL_LAYERS`` layers, ``SMALL_DEVICES`` devices and a global batch of ``SMALL_BATCH``
    (the issue's "L <= 16 with K <= 4", with room; a large batch means long schedules)."""
    return (profile.num_layers <= SMALL_LAYERS and cluster.num_devices <= SMALL_DEVICES
            and training.global_batch_size <= SMALL_BATCH)


def _exact_zero_degrees(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions,
                        fam: _Family) -> list[int]:
    """The replica counts D > 1 to solve one by one for ZeRO on a small instance (empty: not a
    small instance, or the intra-node link is not the faster one, which those solves assume)."""
    if not small_instance(profile, cluster, training) or not _faster(cluster.intra_node, cluster.inter_node):
        return []
    groups = cluster.num_devices // fam.tensor_parallel
    g = training.global_batch_size
    ds = [options.data_parallel] if options.data_parallel else list(range(2, groups + 1))
    ds = [d for d in ds if 1 < d <= groups and g % d == 0]  # (D need not divide the devices: some may idle)
    stages = 3 if options.zero_stage is None else 1
    return ds if 0 < len(ds) * stages <= EXACT_ZERO_SOLVES else []


#: a plan is memory-bound when a stage recomputes or a device is this full
MEMORY_BOUND_FILL = 0.85


def _faster(a: Interconnect, b: Interconnect) -> bool:
    """Link ``a`` is at least as fast as ``b`` in both bandwidth and latency."""
    return a.bandwidth_bytes_per_s >= b.bandwidth_bytes_per_s and a.latency_s <= b.latency_s


def _family_floor(
    profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions, sub: PlanOptions,
    fam: _Family, zeros: list[int], *, zero0_too: bool, budget: float,
) -> tuple[float | None, float]:
    """(the least configuration floor over the family's ZeRO problems, work units used): one
    problem per ZeRO stage > 0 in ``zeros`` and replica count D, each with its own static memory
    and collectives (:func:`planner.search.floor.configuration_floor`), and with ``zero0_too``
    the ZeRO-0 problem (D free), so their least floor bounds every plan of the family at those
    stages.  D = 1 is left out when ZeRO 0 is in ``zeros`` (ZeRO shards nothing there: ZeRO 0's
    bound covers it).  ZeRO-2/3's per-micro-batch collectives are priced on the faster link of
    the two, which no placement beats.  ``None`` when the estimate exceeds ``budget`` (nothing
    computed) or neither link is the faster in both bandwidth and latency."""
    stages = [z for z in zeros if z > 0]
    if not stages and not zero0_too:
        return None, 0.0
    if _faster(cluster.intra_node, cluster.inter_node):
        k_hint = 1  # the intra-node link wherever D x T fits a node
    elif _faster(cluster.inter_node, cluster.intra_node) or all(z < 2 for z in stages):
        k_hint = cluster.num_devices  # (ZeRO 0 and 1 move nothing per micro-batch)
    else:
        return None, 0.0
    groups = cluster.num_devices // fam.tensor_parallel
    ds = [options.data_parallel] if options.data_parallel is not None else list(range(1, groups + 1))
    # (every D the driver enumerates: divisors of the batch up to the groups, D x K <= groups)
    ds = [d for d in ds if d <= groups and training.global_batch_size % d == 0 and (d > 1 or 0 not in zeros)]
    opts = sub if not fam.selective_recompute else sub.model_copy(update={"recompute": False})
    # the estimate before the work: every configuration of the family, once per ZeRO stage
    try:
        whole = mesh_problem(profile, cluster, training, fam.mesh(0), data_parallel=1, pipeline_degree=k_hint,
                             across_nodes=options.tensor_parallel_across_nodes)
        count = len(enumerate_configs(whole.profile, whole.cluster, whole.training,
                                      opts.model_copy(update={"data_parallel": None})))
    except InputError:
        return None, 0.0
    units = floor_units(profile.num_layers)
    if (len(stages) + zero0_too) * count * units > budget:
        return None, 0.0
    least, used = math.inf, 0.0
    if zero0_too:
        floor, n = configuration_floor(whole.profile, whole.cluster, whole.training, opts)
        used += n * units
        least = floor
    for z in stages:
        for d in ds:
            try:
                problem = mesh_problem(profile, cluster, training, fam.mesh(z), data_parallel=d, pipeline_degree=k_hint,
                                       across_nodes=options.tensor_parallel_across_nodes)
                floor, n = configuration_floor(problem.profile, problem.cluster, problem.training,
                                               opts.model_copy(update={"data_parallel": d}))
            except InputError:
                return None, used  # a problem the solves cannot pose either: keep the relaxation
            used += n * units
            least = min(least, floor)
    return least, used


def memory_bound(plan: Plan) -> bool:
    """True when memory shaped ``plan``: a stage recomputes, or a device is nearly full (where
    ZeRO, which only saves memory, may pay)."""
    return any(s.recompute or s.memory_bytes > MEMORY_BOUND_FILL * s.memory_limit_bytes for s in plan.stages)


def _plain(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> Plan:
    """The D x K search alone (T = 1, ZeRO 0, no sequence parallelism)."""
    try:
        return solve_mesh_family(profile, cluster, training, options)
    except SearchCutShortError:
        raise  # (out of time: no mesh fix to look for)
    except InfeasibleError as err:
        raise _with_mesh_fixes(err, profile_in_dtype(profile, training.dtype), cluster, training, options) from None


def _expert_replicas(
    profile: Profile, cluster: Cluster, training: TrainingSetup, fam: _Family, e: int, *, zero: int
) -> list[int]:
    """For expert parallelism ``e`` (and ZeRO ``zero``): the replica count of the fewest pipeline
    stages whose parameter state fits half a device with the experts sharded over E (and the
    optimizer state over D at ZeRO >= 1, the gradients at >= 2), the largest D of them that E
    divides (with C) and the batch allows -- what a DeepSeek-style layout takes, a candidate the
    replica counts of the plans without experts sharded do not reach.  [] when none."""
    experts = sum(x.moe.expert_param_bytes for x in profile.layers if x.moe is not None)
    total = sum(x.param_bytes for x in profile.layers)
    groups = max(1, cluster.num_devices // fam.group)
    usable = min(usable_bytes(d, training) for d in cluster.devices) / 2
    grad, opt = training.gradient_bytes_per_param_byte, training.optimizer_state_factor
    for k in range(1, groups + 1):
        if groups % k:
            continue
        d = groups // k
        share = ((total - experts) + experts / e) / fam.tensor_parallel / k
        state = share * (1 + (grad / d if zero >= 2 else grad) + (opt / d if zero >= 1 else opt))
        if state > usable:
            continue
        for dd in range(d, 0, -1):
            if (dd * fam.context_parallel) % e == 0 and training.global_batch_size % dd == 0 and groups % dd == 0:
                return [dd]
        return []
    return []


@dataclass(frozen=True)
class _Load:
    """A family's work bound (valid: no plan of it is faster) and, for ordering only, the
    activations of one micro-batch of the smallest profiled size on one device of its group:
    the largest layer's and the whole model's."""

    work: float
    largest_activation: int
    activations: int


def _promise(profile: Profile, cluster: Cluster, training: TrainingSetup, fam: _Family, load: _Load) -> float:
    """For ordering only: the family's work bound times the 1F1B bubble of the fewest pipeline
    stages its parameter state needs, 1 + (K - 1) / M (a large model at small T needs a deep,
    bubbly pipeline), a third more where one micro-batch's activations exceed half a device
    (1F1B's first rank holds about the whole model's: it must recompute), and last (inf) where
    one layer's alone exceed the device (a long sequence at small T x C: nothing fits)."""
    static = sum(x.param_bytes for x in profile.layers) * (
        1 + training.gradient_bytes_per_param_byte + training.optimizer_state_factor
    )
    device = min(usable_bytes(d, training) for d in cluster.devices)
    if load.largest_activation > device:
        return math.inf
    usable = device / 2
    groups = max(1, cluster.num_devices // fam.group)
    k = min(groups, max(1, math.ceil(static / fam.tensor_parallel / max(usable, 1.0))))
    d = max(1, groups // k)
    m = max(1, training.global_batch_size // d)
    recompute = 4 / 3 if load.activations > usable else 1.0
    return load.work * (1 + (k - 1) / m) * recompute


def _family_load(profile: Profile, cluster: Cluster, training: TrainingSetup, fam: _Family) -> _Load:
    """:class:`_Load`: all the family's forward and backward work spread over its groups (no
    plan is faster), and its activations per device."""
    problem = mesh_problem(profile, cluster, _relaxed_training(training), fam.mesh(), data_parallel=1, across_nodes=True)
    acts = [x.activation_bytes[0] for x in problem.profile.layers]
    return _Load(lower_bound_ms(problem.profile, problem.cluster, problem.training), max(acts), sum(acts))


def _fits(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions, mesh: Mesh, d: int | None,
          *, deadline: float = math.inf) -> bool:
    try:
        problem = mesh_problem(profile, cluster, training, mesh, data_parallel=d or 1,
                               pipeline_degree=cluster.num_devices, across_nodes=options.tensor_parallel_across_nodes)
    except InputError:
        return False
    opts = options.model_copy(update={"tensor_parallel": None, "zero_stage": None, "sequence_parallel": None,
                                      "selective_recompute": None, "context_parallel": None, "expert_parallel": None,
                                      "data_parallel": d})
    return bool(any_fits(problem.profile, problem.cluster, problem.training, opts, deadline=deadline))


def _mesh_fixes(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions) -> list[str]:
    """The mesh settings, beyond those the user fixed, with which some plan fits (those shown to
    fit within the diagnosis's budget, :data:`planner.infeasible.DIAGNOSIS_BUDGET_S`)."""
    from planner import infeasible

    deadline = time.perf_counter() + infeasible.DIAGNOSIS_BUDGET_S

    def fits(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions, mesh: Mesh,
             d: int | None) -> bool:
        return _fits(profile, cluster, training, options, mesh, d, deadline=deadline)

    out: list[str] = []
    t_fixed = options.tensor_parallel or 1
    dpn = cluster.devices_per_node
    sharded = any(layer.shards for layer in profile.layers)
    ts = [t for t in (2, 4, 8, 16) if t != t_fixed and t <= min(dpn, cluster.num_devices) and dpn % t == 0] if sharded else []
    for t in ts:
        if fits(profile, cluster, training, options, Mesh(t, 0, False), options.data_parallel):
            out.append(f"--tensor-parallel {t} fits")
            break
        if fits(profile, cluster, training, options, Mesh(t, 0, True), options.data_parallel):
            out.append(f"--tensor-parallel {t} --sequence-parallel fits")
            break
    if options.selective_recompute is False and recomputes_selectively(profile) and fits(
            profile, cluster, training, options.model_copy(update={"recompute": False}),
            Mesh(t_fixed, options.zero_stage or 0, bool(options.sequence_parallel) and t_fixed > 1, True),
            options.data_parallel):
        out.append("--selective-recompute fits")
    groups = cluster.num_devices // t_fixed
    ds = [options.data_parallel] if options.data_parallel else sorted(
        {d for d in (groups, groups // 2, groups // 4) if d > 1 and training.global_batch_size % d == 0}, reverse=True)
    for z in (1, 2, 3):
        if options.zero_stage == z:
            continue
        hit = next((d for d in ds if fits(profile, cluster, training, options,
                                           Mesh(t_fixed, z, bool(options.sequence_parallel) and t_fixed > 1), d)), None)
        if hit is not None:
            out.append(f"--zero {z} fits (with --data-parallel {hit})")
            break
    sp = bool(options.sequence_parallel) and t_fixed > 1
    seq = sequence_length(profile)
    if options.context_parallel in (None, 1) and seq is not None:
        for c in (2, 4, 8, 16):
            if seq % c or t_fixed * c > cluster.num_devices or cluster.num_devices % (t_fixed * c):
                continue
            if fits(profile, cluster, training, options, Mesh(t_fixed, 0, sp, context_parallel=c), None):
                out.append(f"--context-parallel {c} fits")
                break
    if options.expert_parallel in (None, 1):
        counts = expert_counts(profile)
        for e in (2, 4, 8, 16, 32, 64):
            if not counts or any(n % e for n in counts):
                continue
            hit = next((d for d in ds if d % e == 0 and fits(profile, cluster, training, options,
                                                               Mesh(t_fixed, 0, sp, expert_parallel=e), d)), None)
            if hit is not None:
                out.append(f"--expert-parallel {e} fits (with --data-parallel {hit})")
                break
    return out


def _with_mesh_fixes(err: InfeasibleError, profile: Profile, cluster: Cluster, training: TrainingSetup,
                     options: PlanOptions) -> InfeasibleError:
    fixes = _mesh_fixes(profile, cluster, training, options)
    if not fixes:
        return err
    details = dict(err.details, mesh_fixes=fixes)
    return InfeasibleError(f"{err} Across more axes: {'; '.join(fixes)}.", details)


def _diagnose(profile: Profile, cluster: Cluster, training: TrainingSetup, options: PlanOptions,
              families: list[_Family], zeros: list[int]) -> InfeasibleError:
    """Nothing fits in the searched mesh space: the D x K diagnosis, with the mesh fixes."""
    from planner.infeasible import diagnose

    plain = options.model_copy(update={"tensor_parallel": None, "zero_stage": None, "sequence_parallel": None,
                                       "selective_recompute": None})
    tried = ", ".join(f.describe() for f in families)
    zero_text = "/".join(map(str, zeros))
    if len(families) == 1 and families[0].group > 1 and options.expert_parallel in (None, 1):
        # the user fixed the family (T, and C): its own problem is diagnosed, in GPUs, not the
        # plain T = 1 one (which would contradict the fixed T)
        fam = families[0]
        try:
            problem = mesh_problem(profile, cluster, training, fam.mesh(), data_parallel=1,
                                   pipeline_degree=cluster.num_devices,
                                   across_nodes=options.tensor_parallel_across_nodes)
            own = plain.model_copy(update={"context_parallel": None, "expert_parallel": None,
                                           "recompute": False if fam.selective_recompute else options.recompute})
            err = diagnose(problem.profile, problem.cluster, problem.training, own, group=fam.group)
        except InputError:
            pass
        else:
            base = InfeasibleError(
                f"no plan fits with {tried} and ZeRO {zero_text}. With {tried} and ZeRO 0: {err}", err.details)
            return _with_mesh_fixes(base, profile, cluster, training, options)
    err = diagnose(profile, cluster, training, plain)
    base = InfeasibleError(
        f"no plan fits with {tried} and ZeRO {zero_text}. Without tensor parallelism or ZeRO: {err}",
        err.details,
    )
    return _with_mesh_fixes(base, profile, cluster, training, options)
