"""CP-SAT model of one configuration: prove its lower bound or that nothing fits.

For a configuration (D, K, M, schedule, v) left open by the fast search, the model chooses
the K·v stage boundaries and the recompute flags jointly and minimises the split's lower
bound of :func:`planner.bounds.split.split_lower_bound` (with the schedule's idle term), under
the per-rank memory limit.  Compact formulation (no layer x stage booleans):

* boundary variables ``x_0 = 0 < x_1 < ... < x_n = L``;
* element constraints read the prefix sums of forward time, backward time, parameter
  state bytes, activation bytes and stage-input bytes at every boundary;
* a stage's work is a difference of two prefix reads (plus what a recompute re-runs when it
  recomputes); a rank's memory is its static bytes plus, per chunk, the closed-form count
  of :func:`planner.schedules.first_backward_counts` times what the chunk keeps, plus the
  live bytes of a recomputing lone chunk (a moment of its walk, so a lower bound);
* ``Z >= in_f + idle + max(M·work + allreduce, M·pre_gradient + out_b)`` for every rank
  (:mod:`planner.bounds.split`), and for every later chunk of an interleaved rank the chunk
  bound; minimise ``Z``.

Numbers are scaled to integers so that the model is a relaxation (times rounded down,
memory limits rounded up by the rounding error), so CP-SAT's proven objective bound is a
valid lower bound of the configuration and "infeasible" proves that nothing fits.
Heterogeneous clusters are relaxed to their fastest speed and largest memory.
The search's best split of the configuration is the hint.  One worker and a fixed seed
keep results repeatable.  :func:`planner.search.tighten.tighten_cpsat` decides which open
configurations get a model and for how long.
"""

from __future__ import annotations

import math

from planner.cost import static_bytes
from planner.schedules import forwards_before_chunk
from planner.search.model import Split, StageModel
from planner.search.space import Group

#: integer resolution of times: the objective's scale is about this many units
TIME_UNITS = 10**9
#: CP-SAT time per configuration, at most
PER_CONFIG_S = 2.0
#: skip models with more (stage boundaries x layers) than this: building them alone is slow
MAX_MODEL_SIZE = 2_000


def _scaled_prefix(values: tuple[float, ...], unit: float) -> list[int]:
    return [math.floor(v / unit) for v in values]


def config_bound(
    sm: StageModel,
    groups: list[Group],
    *,
    hint: Split | None,
    time_limit_s: float,
    options_recompute: bool | list[bool] | None,
) -> tuple[float | None, tuple[tuple[int, int], ...] | None, list[bool] | None, bool, float]:
    """(lower bound or None if proven infeasible, best ranges, their recompute, proven
    optimal, deterministic time used)."""
    from ortools.sat.python import cp_model  # imported only when a model is built (slow import)

    cfg = sm.cfg
    k, m, v, d = cfg.pipeline_degree, cfg.num_microbatches, cfg.virtual_stages, cfg.data_parallel
    n = k * v
    num_layers = sm.L
    smax = max(g.speed for g in groups)
    limit = max(g.limit_bytes for g in groups)
    link = max((g.link for g in groups), key=lambda li: (li.bandwidth_bytes_per_s, -li.latency_s))

    total = (sm.F[-1] + sm.B[-1]) * 2 / smax * (m + n)
    unit = max(total / TIME_UNITS, 1e-12)
    fpre = _scaled_prefix(tuple(x / smax for x in sm.F), unit)
    # what a recompute re-runs (the forward less ZeRO-3's gather; the forward itself otherwise)
    rpre = fpre if sm.R == sm.F else _scaled_prefix(tuple(x / smax for x in sm.R), unit)
    bpre = _scaled_prefix(tuple(x / smax for x in sm.B), unit)
    split_bw = sm.split_backward
    # the gradient's path back (per layer the cheaper of B and I with a split backward)
    gpre = _scaled_prefix(tuple(x / smax for x in sm.G), unit) if split_bw else bpre
    # all-reduce is linear in gradient bytes: ar = alpha * bytes + beta
    if d > 1:
        steps = 2 * (d - 1)
        alpha_ms = steps / d / link.bandwidth_bytes_per_s * 1e3 * sm.grad_factor * sm.ar_exposed
        # (a rank with no gradient bytes pays no latency: counted only where every layer has some)
        paying = sm.grad_factor > 0 and sm.costs.params_in_every_layer
        beta = steps * link.latency_s * 1e3 * sm.ar_exposed if paying else 0.0
    else:
        alpha_ms = beta = 0.0
    arpre = [math.floor(p * alpha_ms / unit) for p in sm.PP]
    beta_u = math.floor(beta / unit)

    mem_unit = max(limit / 10**7, 1.0)
    spre = [math.floor(static_bytes(p, sm.training) / mem_unit) for p in sm.PP]
    apre = [math.floor(x / mem_unit) for x in sm.costs.prefix_activation]
    inp = [math.floor(sm.costs.stage_input_bytes(a) / mem_unit) if a < num_layers else 0 for a in range(num_layers + 1)]
    # one layer's activations at each start: a lower bound of the largest layer a stage
    # checkpointed layer by layer re-materialises in its backward
    one = [math.floor(x / mem_unit) for x in sm.costs.activation_bytes] + [0]
    limit_u = math.floor(limit / mem_unit)

    model = cp_model.CpModel()
    x = [model.new_int_var(j, num_layers - n + j, f"x{j}") for j in range(n + 1)]
    model.add(x[0] == 0)
    model.add(x[n] == num_layers)
    for j in range(n):
        model.add(x[j + 1] >= x[j] + 1)

    def element(arr: list[int], var: cp_model.IntVar, name: str) -> cp_model.IntVar:
        out = model.new_int_var(min(arr), max(arr), name)
        model.add_element(var, arr, out)
        return out

    fx = [element(fpre, x[j], f"f{j}") for j in range(n + 1)]
    rex = fx if rpre is fpre else [element(rpre, x[j], f"re{j}") for j in range(n + 1)]
    bx = [element(bpre, x[j], f"b{j}") for j in range(n + 1)]
    gx = [element(gpre, x[j], f"g{j}") for j in range(n + 1)] if split_bw else bx
    sx = [element(spre, x[j], f"s{j}") for j in range(n + 1)]
    ax = [element(apre, x[j], f"a{j}") for j in range(n + 1)]
    ix = [element(inp, x[j], f"i{j}") for j in range(n)]
    rx = [element(arpre, x[j], f"r{j}") for j in range(n + 1)] if d > 1 else None

    rc: list[cp_model.IntVar | int] = []
    for j in range(n):
        if isinstance(options_recompute, bool):
            rc.append(int(options_recompute))
        elif isinstance(options_recompute, list):
            rc.append(int(options_recompute[j]))
        else:
            rc.append(model.new_bool_var(f"rc{j}"))
    big_t = fpre[-1] + bpre[-1]
    fdiff = [fx[j + 1] - fx[j] for j in range(n)]
    rdiff = [rex[j + 1] - rex[j] for j in range(n)]
    bdiff = [bx[j + 1] - bx[j] for j in range(n)]
    refw = []
    for j in range(n):
        r = rc[j]
        if isinstance(r, int):
            refw.append(rdiff[j] if r else 0)
        else:
            e = model.new_int_var(0, big_t, f"rf{j}")
            model.add(e == rdiff[j]).only_enforce_if(r)
            model.add(e == 0).only_enforce_if(~r)
            refw.append(e)
    work = [fdiff[j] + bdiff[j] + refw[j] for j in range(n)]
    z = model.new_int_var(0, big_t * (m + n + 2) + 10**6 + beta_u + arpre[-1], "z")
    big_m = max(apre[-1], max(inp)) + 1
    before = forwards_before_chunk(cfg.schedule, k, m, v)
    for r in range(k):
        own = sm.rank_stages[r]
        first = own[0]
        rank_work = sum(work[j] for j in own)
        # what runs before the last gradient leaves the rank's first stage (all of its work
        # unless the weight gradients of a split backward may follow)
        rank_pre = sum(fdiff[j] + gx[j + 1] - gx[j] + refw[j] for j in own) if split_bw else rank_work
        idle: cp_model.LinearExpr | int = 0
        if v == 1 and cfg.schedule in ("1f1b", "gpipe", "zb-h1"):
            if cfg.schedule == "zb-h1":  # the first input gradient's wait (planner.bounds.split)
                down = (fpre[-1] + gpre[-1]) - (fx[first + 1] + gx[first + 1])
                credit = min(k - r - 1, m) * fdiff[first]
            else:
                down = (fpre[-1] + bpre[-1]) - (fx[first + 1] + bx[first + 1])
            if cfg.schedule == "1f1b":
                credit = min(k - r - 1, m) * (bdiff[first] + refw[first])
            elif cfg.schedule == "gpipe":
                credit = (m - 1) * fdiff[first]
            ivar = model.new_int_var(0, big_t, f"idle{r}")
            model.add(ivar >= down - credit)
            idle = ivar
        ar: cp_model.LinearExpr | int = 0
        if rx is not None:
            ar = sum(rx[j + 1] - rx[j] for j in own) + beta_u
        # z >= in_f + idle + max(M·work + allreduce, M·pre + out_b) (planner.bounds.split)
        model.add(z >= fx[first] + idle + m * rank_work + ar)
        model.add(z >= fx[first] + idle + m * rank_pre + gx[first])
        if v > 1:
            # chunk j starts after the path through all earlier stages, when the rank has
            # run only ``before`` forwards of each earlier chunk (see planner.bounds.split)
            for jj in range(1, v):
                s_ = own[jj]
                done = before[r][jj] * sum(fdiff[own[q]] for q in range(jj))
                model.add(z >= fx[s_] + m * rank_work - done + ar)
                model.add(z >= fx[s_] + m * rank_pre - done + gx[first])
        # memory of the rank at its first backward (planner.schedules.first_backward_counts):
        # static + sum over chunks of count x kept bytes (+ the live bytes of a lone chunk)
        static = sum(sx[j + 1] - sx[j] for j in own)
        kept: list[cp_model.LinearExpr] = []
        live: cp_model.LinearExpr | int = 0
        for jj, j in enumerate(own):
            acts = ax[j + 1] - ax[j]
            count = sm.counts[r][jj]
            rj = rc[j]
            if isinstance(rj, int):
                kept.append(count * (ix[j] if rj else acts))
                if rj and v == 1:
                    live = element(one, x[j], f"one{j}")
            else:
                stash = model.new_int_var(0, big_m, f"stash{j}")
                model.add(stash >= ix[j]).only_enforce_if(rj)
                model.add(stash >= acts).only_enforce_if(~rj)
                kept.append(count * stash)
                if v == 1:
                    lv = model.new_int_var(0, big_m, f"live{j}")
                    model.add(lv >= element(one, x[j], f"one{j}")).only_enforce_if(rj)
                    live = lv
        slack = sum(sm.counts[r]) + v + 4
        # each floored difference is off by less than one unit
        model.add(static + sum(kept) + live <= limit_u + slack)
    model.minimize(z)
    if hint is not None and len(hint.ranges) == n:
        for j in range(n):
            model.add_hint(x[j], hint.ranges[j][0])
            rj = rc[j]
            if not isinstance(rj, int):
                model.add_hint(rj, int(hint.recompute[j]))
    solver = cp_model.CpSolver()
    # deterministic time, so that the same input gives the same bound on any machine
    solver.parameters.max_deterministic_time = max(0.05, time_limit_s)
    # wall-clock safety net (only binds when the machine is far slower than usual)
    solver.parameters.max_time_in_seconds = max(0.1, 2 * time_limit_s)
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.solve(model)
    used = solver.deterministic_time
    if status == cp_model.INFEASIBLE:
        return None, None, None, True, used
    if status == cp_model.MODEL_INVALID:  # pragma: no cover - a bug in this module
        raise RuntimeError(solver.status_name(status))
    # rounding: every floored difference is off by less than one unit; a rank's bound sums
    # M x 3v of them, the idle term fewer than 2K + 2M, the rest a few
    margin = 4 * v * m + 2 * k + 2 * m + (k + 3) * v + 16 + max(before[r][j] for r in range(k) for j in range(v)) * v
    bound = (solver.best_objective_bound - margin) * unit
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # no solution in time; the objective bound is still proven
        return max(0.0, bound), None, None, False, used
    xs = [solver.value(x[j]) for j in range(n + 1)]
    ranges = tuple((xs[j], xs[j + 1]) for j in range(n))
    rcs = [bool(solver.value(r)) if not isinstance(r, int) else bool(r) for r in rc]
    return max(0.0, bound), ranges, rcs, status == cp_model.OPTIMAL, used

