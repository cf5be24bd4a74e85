"""Solving off the event loop, in a bounded pool of worker processes (or threads).

A worker receives the canonical request as JSON text and sends back JSON text: nothing is
pickled from a request, and the solver's exceptions travel as plain data (an
``InfeasibleError``'s ``details`` survive the trip).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import importlib
import json
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal

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


def solve_json(solver: str | SolveFn, request_json: str) -> str:
    """Parse a canonical request, solve it, and return the outcome as JSON text.

    ``{"plan": {...}}``, ``{"infeasible": {"message", "details"}}``,
    ``{"invalid": {"message", "errors"}}`` or ``{"failed": {"message"}}``.
    """
    try:
        fn = resolve(solver) if isinstance(solver, str) else solver
        data = json.loads(request_json)
        profile = Profile.model_validate(data["profile"])
        cluster = Cluster.model_validate(data["cluster"])
        training = TrainingSetup.model_validate(data["training"])
        options = PlanOptions.model_validate(data["options"])
        plan = fn(profile, cluster, training, options)
        return json.dumps({"plan": plan.model_dump(mode="json")})
    except InfeasibleError as err:
        return json.dumps({"infeasible": {"message": str(err), "details": err.details}}, default=str)
    except InputError as err:
        return json.dumps({"invalid": {"message": str(err), "errors": err.errors}}, default=str)
    except ValueError as err:  # PipeplanError and the validators' errors: bad input
        return json.dumps({"invalid": {"message": str(err), "errors": []}})
    except Exception as err:
        return json.dumps({"failed": {"message": f"{type(err).__name__}: {err}"}})


def _warm(solver: str) -> None:
    """Worker initializer: import the solver once, so the first request does not pay for it."""
    try:
        resolve(solver)
    except Exception:  # reported on the first solve instead
        pass


def outcome_plan(text: str) -> Plan:
    """The plan of a worker's answer, or the exception it stands for."""
    out: dict[str, Any] = json.loads(text)
    if "plan" in out:
        return Plan.model_validate(out["plan"])
    if "infeasible" in out:
        raise InfeasibleError(out["infeasible"]["message"], out["infeasible"]["details"])
    if "invalid" in out:
        raise InputError(out["invalid"]["message"], out["invalid"]["errors"])
    raise SolverFailedError(out["failed"]["message"])


class SolverPool:
    """At most ``workers`` solves run at once and at most ``max_pending`` wait or run.

    ``mode="process"`` runs solves in spawned worker processes (the event loop and the GIL
    stay free); ``"thread"`` in threads of this process (for tests and small machines).
    The pool starts on the first solve.
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
        self._executor: cf.Executor | None = None
        self._lock = threading.Lock()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Solves queued or running now."""
        return self._pending

    def _pool(self) -> cf.Executor:
        with self._lock:
            if self._executor is None:
                if self.mode == "process":
                    assert isinstance(self.solver, str)
                    self._executor = cf.ProcessPoolExecutor(
                        max_workers=self.workers,
                        mp_context=multiprocessing.get_context("spawn"),
                        initializer=_warm,
                        initargs=(self.solver,),
                    )
                else:
                    self._executor = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="solve")
            return self._executor

    async def solve(self, request_json: str, *, time_limit_s: float) -> Plan:
        """Solve a canonical request (JSON text) without blocking the event loop."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise SolverBusyError(
                    f"{self._pending} solves are queued or running (the limit is {self.max_pending}): "
                    "retry later, or raise PIPEPLAN_MAX_PENDING_SOLVES"
                )
            self._pending += 1
        try:
            try:
                future = self._pool().submit(solve_json, self.solver, request_json)
            except (BrokenProcessPool, RuntimeError, OSError) as err:
                with self._lock:
                    self._executor = None
                raise SolverFailedError(f"cannot start a solver worker: {err}") from None
            waited = asyncio.wrap_future(future)
            # queued solves wait for the ones ahead of them: allow for a full round of those
            rounds = 1 + self._pending // max(1, self.workers)
            try:
                text = await asyncio.wait_for(waited, timeout=rounds * time_limit_s + self.grace_s)
            except asyncio.TimeoutError:
                future.cancel()
                raise SolverTimeoutError(
                    f"the solve did not finish within {time_limit_s:g} s + {self.grace_s:g} s of grace: "
                    "retry with fewer free decisions (fix stages or schedule in options)"
                ) from None
            except BrokenProcessPool:
                with self._lock:
                    self._executor = None
                raise SolverFailedError("a solver worker process died (out of memory?): retry") from None
            return outcome_plan(text)
        finally:
            with self._lock:
                self._pending -= 1

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None
