"""Solving off the event loop, in a bounded pool of worker processes (or threads).

A worker receives the canonical request as JSON text and sends back text: nothing is
pickled from a request, and the solver's exceptions travel as plain data (an
``InfeasibleError``'s ``details`` survive the trip).  A solve that overruns its time limit
by the grace period has its worker process killed and replaced (:mod:`api.workers`).
"""

from __future__ import annotations

import functools
import importlib
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

from api.intake import json_safe, safe_entries, safe_text
from api.workers import Job, WorkerDiedError, WorkerPool, WorkerTimeoutError
from planner.errors import InfeasibleError, InputError
from planner.schema import Cluster, Plan, PlanOptions, Profile, TrainingSetup

SolveFn = Callable[[Profile, Cluster, TrainingSetup, PlanOptions], Plan]

#: the planner's solver, imported in the worker on first use
DEFAULT_SOLVER = "planner.solver:solve"


class SolverBusyError(Exception):
    """Too many solves queued or running."""


class SolverTimeoutError(Exception):
    """A solve ran far past its time limit."""


class SolverFailedError(Exception):
    """The solver raised something other than a planner error (a bug)."""


def resolve(path: str) -> SolveFn:
    """``"package.module:function"`` -> the function (server configuration, never request data)."""
    module, _, name = path.partition(":")
    fn: SolveFn = getattr(importlib.import_module(module), name)
    return fn


def _outcome(kind: str, payload: str) -> bytes:
    return kind.encode() + b"\n" + payload.encode("utf-8", "replace")


def solve_json(solver: str | SolveFn, request_json: str) -> bytes:
    """Parse a canonical request, solve it, and return the outcome.

    ``plan\n<plan JSON>``, ``infeasible\n{"message", "details"}``,
    ``invalid\n{"message", "errors"}`` or ``failed\n<message>``.
    """
    try:
        fn = resolve(solver) if isinstance(solver, str) else solver
        data = json.loads(request_json)
        profile = Profile.model_validate(data["profile"])
        cluster = Cluster.model_validate(data["cluster"])
        training = TrainingSetup.model_validate(data["training"])
        options = PlanOptions.model_validate(data["options"])
        return _outcome("plan", fn(profile, cluster, training, options).model_dump_json())
    except BaseException as err:
        return _failure(err)


def _failure(err: BaseException) -> bytes:
    if isinstance(err, InfeasibleError):
        return _outcome("infeasible", json.dumps({"message": safe_text(str(err)), "details": json_safe_details(err.details)}))
    if isinstance(err, InputError):
        return _outcome("invalid", json.dumps({"message": safe_text(str(err)), "errors": safe_entries(err.errors)}))
    if isinstance(err, ValueError):  # PipeplanError and the validators' errors: bad input
        return _outcome("invalid", json.dumps({"message": safe_text(str(err)), "errors": []}))
    return _outcome("failed", f"{type(err).__name__}: {err}")


def json_safe_details(details: Mapping[str, Any]) -> dict[str, Any]:
    return {safe_text(str(k), 200): json_safe(v) for k, v in list(details.items())[:50]}


def estimate_json(request_json: str) -> bytes:
    """The cost model's plan for a canonical :class:`EstimateRequest`, as an outcome like :func:`solve_json`."""
    from api.models import EstimateRequest
    from planner.cost import Layout, estimate

    try:
        body = EstimateRequest.model_validate_json(request_json)
        plan = estimate(
            body.profile, body.cluster, body.training,
            Layout(
                body.stages,
                num_microbatches=body.num_microbatches,
                schedule=body.schedule,
                recompute=body.recompute,
                recompute_layers=body.recompute_layers,
                data_parallel=body.data_parallel,
                pipeline_degree=body.pipeline_degree,
                devices=body.devices,
                tensor_parallel=body.tensor_parallel,
                zero_stage=body.zero_stage,
                sequence_parallel=body.sequence_parallel,
                selective_recompute=body.selective_recompute,
                context_parallel=body.context_parallel,
                expert_parallel=body.expert_parallel,
                context_attention=body.context_attention,
            ),
        )
        return _outcome("plan", plan.model_dump_json())
    except BaseException as err:
        return _failure(err)


def sweep_json(solver: str | SolveFn, request_json: str) -> bytes:
    """The sweep of a canonical :class:`api.models.SweepRequest`, as an outcome like
    :func:`solve_json` (``plan\n`` carries the sweep result's JSON)."""
    from api.intake import sweep_defaults
    from api.models import SweepRequest
    from planner.sweep import sweep

    try:
        fn = resolve(solver) if isinstance(solver, str) else solver
        body = SweepRequest.model_validate_json(request_json)
        result = sweep(
            body.profile, body.training, body.sweep, options=body.options,
            defaults=sweep_defaults(body.profile, body.sweep), solve=fn,
        )
        return _outcome("plan", result.model_dump_json())
    except BaseException as err:
        return _failure(err)


def sweep_job(payload: bytes) -> bytes:
    """Job of a solver worker: ``solver path \n canonical sweep request`` -> an outcome."""
    solver, _, request = payload.partition(b"\n")
    return sweep_json(solver.decode(), request.decode())


def solve_job(payload: bytes) -> bytes:
    """Job of a solver worker: ``solver path \n canonical request`` -> an outcome."""
    solver, _, request = payload.partition(b"\n")
    return solve_json(solver.decode(), request.decode())


def estimate_job(payload: bytes) -> bytes:
    """Job of a solver worker: a canonical estimate request -> an outcome."""
    return estimate_json(payload.decode())


def outcome_text(answer: bytes) -> str:
    """The plan JSON text of a worker's answer, or the exception it stands for."""
    kind, _, rest = answer.partition(b"\n")
    if kind == b"plan":
        return rest.decode()
    if kind == b"infeasible":
        out = json.loads(rest)
        raise InfeasibleError(out["message"], out["details"])
    if kind == b"invalid":
        out = json.loads(rest)
        raise InputError(out["message"], out["errors"])
    raise SolverFailedError(rest.decode("utf-8", "replace"))


def outcome_plan(answer: bytes) -> Plan:
    """The :class:`Plan` of a worker's answer, or the exception it stands for."""
    return Plan.model_validate_json(outcome_text(answer))


class SolverPool:
    """At most ``workers`` solves run at once and at most ``max_pending`` wait or run.

    ``mode="process"`` runs solves in spawned worker processes (the event loop and the GIL
    stay free; a solve that runs ``grace_s`` past its time limit has its process killed and
    replaced); ``"thread"`` in threads of this process (for tests and small machines: a
    runaway solve is abandoned, not stopped).  The processes start on the first solve.
    Estimates (``/v1/estimate``) run here too.
    """

    def __init__(
        self,
        *,
        workers: int = 2,
        mode: Literal["process", "thread"] = "process",
        max_pending: int = 64,
        solver: str | SolveFn = DEFAULT_SOLVER,
        grace_s: float = 30.0,
    ) -> None:
        if mode == "process" and not isinstance(solver, str):
            raise ValueError("a process pool needs the solver as an import path 'module:function'")
        self.workers = workers
        self.mode = mode
        self.max_pending = max_pending
        self.solver = solver
        self.grace_s = grace_s
        jobs: dict[str, Job] = {"estimate": estimate_job}
        jobs["solve"] = solve_job if isinstance(solver, str) else functools.partial(_solve_with, solver)
        jobs["sweep"] = sweep_job if isinstance(solver, str) else functools.partial(_sweep_with, solver)
        self.pool = WorkerPool(
            jobs,
            workers=workers,
            mode=mode,
            warm=(solver,) if isinstance(solver, str) else (),
            name="pipeplan-solver",
        )
        self._lock = threading.Lock()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Solves and estimates queued or running now."""
        return self._pending

    async def _run(self, job: str, payload: bytes, *, timeout_s: float, what: str) -> str:
        with self._lock:
            if self._pending >= self.max_pending:
                raise SolverBusyError(
                    f"{self._pending} solves are queued or running (the limit is {self.max_pending}): "
                    "retry later, or raise PIPEPLAN_MAX_PENDING_SOLVES"
                )
            self._pending += 1
        try:
            answer = await self.pool.run(job, payload, timeout_s=timeout_s)
        except WorkerTimeoutError:
            raise SolverTimeoutError(
                f"the {what} did not finish within {timeout_s:g} s and was stopped: retry with fewer "
                "free decisions (fix stages or schedule in options)"
            ) from None
        except WorkerDiedError:
            raise SolverFailedError(f"the {what}'s worker process died (out of memory?): retry") from None
        finally:
            with self._lock:
                self._pending -= 1
        return outcome_text(answer)

    async def solve(self, request_json: str, *, time_limit_s: float) -> str:
        """Solve a canonical request (JSON text) off the event loop: the plan's JSON text."""
        header = self.solver.encode() if isinstance(self.solver, str) else b""
        return await self._run(
            "solve", header + b"\n" + request_json.encode(), timeout_s=time_limit_s + self.grace_s, what="solve"
        )

    async def sweep(self, request_json: str, *, points: int, time_limit_s: float) -> str:
        """Plan every point of a canonical sweep request: the sweep result's JSON text.  It is
        stopped after each point's time limit (three times over, the solver's wall-clock
        safety net) plus the grace period."""
        header = self.solver.encode() if isinstance(self.solver, str) else b""
        timeout = points * 3 * time_limit_s + self.grace_s
        return await self._run("sweep", header + b"\n" + request_json.encode(), timeout_s=timeout, what="sweep")

    async def estimate(self, request_json: str, *, timeout_s: float) -> str:
        """The cost model's plan for a canonical estimate request: the plan's JSON text."""
        return await self._run("estimate", request_json.encode(), timeout_s=timeout_s, what="estimate")

    def close(self) -> None:
        self.pool.close()


def _sweep_with(solver: SolveFn, payload: bytes) -> bytes:
    """Thread-mode sweep job for a solver given as a function (tests)."""
    return sweep_json(solver, payload.partition(b"\n")[2].decode())


def _solve_with(solver: SolveFn, payload: bytes) -> bytes:
    """Thread-mode job for a solver given as a function (tests)."""
    return solve_json(solver, payload.partition(b"\n")[2].decode())
