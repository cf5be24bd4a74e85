"""Worker processes that can be stopped: the service's solves and request reading run here.

A :class:`WorkerPool` runs *jobs*, functions ``bytes -> bytes`` named when the pool is made
(server code, never request data).  In ``"process"`` mode each of its ``workers`` threads owns
one spawned process and talks to it over a pipe with bytes only (nothing is pickled from a
request).  A job that runs past its timeout gets its process killed and replaced at once, so
a runaway solve frees its worker; a process that dies is replaced on the next job.  The event
loop only waits on futures: parsing, validating and solving all happen elsewhere, off the GIL.

``"thread"`` mode runs jobs in threads of this process (tests, tiny deployments): a timed-out
job is abandoned, not stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import importlib
import multiprocessing
import signal
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any, Literal

Job = Callable[[bytes], bytes]


class WorkerTimeoutError(Exception):
    """A job ran past its timeout (its process was killed and replaced)."""


class WorkerDiedError(Exception):
    """A worker process died during a job (out of memory, killed): it is replaced."""


def job_path(fn: Job) -> str:
    """``module:function`` of a module-level job, checked to import back to ``fn``."""
    path = f"{fn.__module__}:{fn.__qualname__}"
    if _resolve(path) is not fn:
        raise ValueError(f"a job of a process pool must be a module-level function, not {fn!r}")
    return path


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _serve(conn: Connection, jobs: dict[str, str], warm: tuple[str, ...]) -> None:
    """Main loop of a worker process: ``name NUL payload`` in, the job's bytes out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops us
    table: dict[str, Job] = {name: _resolve(path) for name, path in jobs.items()}
    for path in warm:  # e.g. import the solver (OR-Tools) before the first request needs it
        try:
            _resolve(path)
        except Exception:  # reported by the first job that needs it
            pass
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the server went away
            return
        name, _, payload = message.partition(b"\0")
        try:
            out = table[name.decode()](payload)
        except BaseException as err:  # jobs answer errors themselves; this is a last resort
            out = b"failed\n" + f"{type(err).__name__}: {err}".encode("utf-8", "replace")
        try:
            conn.send_bytes(out)
        except OSError:
            return


class _Process:
    """One spawned worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, jobs: dict[str, str], warm: tuple[str, ...], name: str) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, args=(child, jobs, warm), name=name, daemon=True)
        self.process.start()
        child.close()

    @property
    def pid(self) -> int | None:
        pid: int | None = self.process.pid
        return pid

    def call(self, data: bytes, timeout_s: float) -> bytes | None:
        """The job's answer, or ``None`` after ``timeout_s``; ``EOFError``/``OSError`` if it died."""
        self.conn.send_bytes(data)
        if not self.conn.poll(timeout_s):
            return None
        answer: bytes = self.conn.recv_bytes()
        return answer

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()


class WorkerPool:
    """At most ``workers`` jobs run at once; the rest wait their turn (first come, first served).

    ``jobs`` maps names to module-level functions (``bytes -> bytes``); ``warm`` lists
    ``module:function`` paths each process imports when it starts.  Process mode spawns
    its processes on :meth:`start` or on the first job.
    """

    def __init__(
        self,
        jobs: Mapping[str, Job],
        *,
        workers: int = 2,
        mode: Literal["process", "thread"] = "process",
        warm: tuple[str, ...] = (),
        name: str = "pipeplan-worker",
    ) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least 1 worker, got {workers}")
        self.jobs = dict(jobs)
        self.workers = workers
        self.mode = mode
        self.name = name
        self._paths = {k: job_path(fn) for k, fn in self.jobs.items()} if mode == "process" else {}
        self._warm = warm
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._threads: cf.ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._spare: list[_Process] = []
        self._live: set[_Process] = set()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Jobs waiting or running now."""
        return self._pending

    def pids(self) -> list[int]:
        """Process ids of the live worker processes (process mode)."""
        with self._lock:
            return sorted(p.pid for p in self._live if p.pid is not None)

    def _spawn(self) -> _Process:
        proc = _Process(self._ctx, self._paths, self._warm, self.name)
        with self._lock:
            self._live.add(proc)
        return proc

    def _retire(self, proc: _Process) -> None:
        with self._lock:
            self._live.discard(proc)
        proc.kill()

    def start(self) -> None:
        """Spawn the worker processes now (they import their jobs in the background)."""
        if self.mode != "process":
            return
        with self._lock:
            missing = self.workers - len(self._spare) - len(self._live)
        for _ in range(max(0, missing)):
            proc = self._spawn()
            with self._lock:
                self._spare.append(proc)

    def _executor(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._threads is None:
                self._threads = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name)
            return self._threads

    def _own_process(self) -> _Process:
        proc: _Process | None = getattr(self._local, "proc", None)
        if proc is None or not proc.process.is_alive():
            if proc is not None:
                self._retire(proc)
            with self._lock:
                proc = self._spare.pop() if self._spare else None
            self._local.proc = proc = proc if proc is not None else self._spawn()
        return proc

    def _run_in_process(self, name: str, payload: bytes, timeout_s: float) -> bytes:
        proc = self._own_process()
        try:
            answer = proc.call(name.encode() + b"\0" + payload, timeout_s)
        except (EOFError, OSError):
            self._retire(proc)
            self._local.proc = None
            raise WorkerDiedError(f"a {self.name} process died during a job (out of memory?)") from None
        if answer is None:
            self._retire(proc)
            self._local.proc = self._spawn()  # the replacement starts now
            raise WorkerTimeoutError(f"the job ran past {timeout_s:g} s: its {self.name} process was stopped")
        return answer

    def _run_in_thread(self, name: str, payload: bytes, timeout_s: float) -> bytes:
        result: list[bytes] = []
        failure: list[BaseException] = []

        def target() -> None:
            try:
                result.append(self.jobs[name](payload))
            except BaseException as err:
                failure.append(err)

        runner = threading.Thread(target=target, name=f"{self.name}-job", daemon=True)
        runner.start()
        runner.join(timeout_s)
        if runner.is_alive():
            raise WorkerTimeoutError(f"the job ran past {timeout_s:g} s (thread mode: it is abandoned, not stopped)")
        if failure:
            raise failure[0]
        return result[0]

    async def run(self, name: str, payload: bytes, *, timeout_s: float) -> bytes:
        """Run job ``name`` on ``payload``; its clock starts when a worker takes it."""
        if name not in self.jobs:
            raise KeyError(f"no job {name!r} in this pool")
        run = self._run_in_process if self.mode == "process" else self._run_in_thread
        with self._lock:
            self._pending += 1
        try:
            future = self._executor().submit(run, name, payload, timeout_s)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _future: cf.Future[bytes]) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        """Stop every worker process (a later job starts new ones)."""
        with self._lock:
            threads, self._threads = self._threads, None
            procs = list(self._live)
            self._spare.clear()
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            self._retire(proc)
