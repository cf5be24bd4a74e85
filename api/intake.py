"""Reading a request body: strict JSON, sizes against the server's limits, validation, canonical form.

This runs as a job of the service's reading pool (a worker process by default), so the event
loop never parses or validates a body and a 30 MB one cannot stall ``/healthz``.  The order is
what keeps a hostile body cheap:

1. strict JSON (``NaN``/``Infinity`` are errors naming the field; so is deep nesting);
2. every size (layers, micro-batch sizes, devices, global batch, micro-batches) is compared
   with the server's limits on the parsed JSON, before validation builds anything
   proportional to it or the cluster shorthand is expanded;
3. validation by the schema classes; then the limits that need validated values;
4. the canonical text, whose SHA-256 is the cache key.

Every error becomes :class:`planner.errors.InputError` with JSON-safe entries (a 422).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from api.models import EstimateRequest, PlanRequest, SweepRequest
from api.version import service_version
from api.workers import Job, WorkerPool
from planner.errors import InputError
from planner.limits import (
    check_cluster_data,
    check_count,
    check_profile_data,
    check_schedule_size,
    check_sweep_data,
    find_path,
    loads_strict,
)
from planner.schema import MAX_SWEEP_POINTS, PlanOptions, Profile, SweepSpec

if TYPE_CHECKING:
    from api.settings import ApiSettings

#: longest message line or shown input kept in an error body
_SHOWN = 200
_T = TypeVar("_T")


@dataclass(frozen=True)
class Limits:
    """The server's size limits a request is read against (from ``PIPEPLAN_MAX_*``)."""

    max_layers: int
    max_devices: int
    max_microbatches: int
    max_global_batch: int
    max_time_limit_s: float

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> Limits:
        return cls(
            max_layers=settings.max_layers,
            max_devices=settings.max_devices,
            max_microbatches=settings.max_microbatches,
            max_global_batch=settings.max_global_batch,
            max_time_limit_s=settings.max_time_limit_s,
        )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, text: bytes) -> Limits:
        return cls(**json.loads(text))


# --------------------------------------------------------------------------- error bodies


def json_safe(value: Any, *, depth: int = 0) -> Any:
    """``value`` as something ``json.dumps(allow_nan=False)`` accepts: non-finite floats and
    odd objects become strings, long strings are cut, large containers become ``None``."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        text = value if len(value) <= _SHOWN else value[: _SHOWN - 3] + "..."
        return text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates become '?'
    if isinstance(value, bytes):
        return json_safe(value[:_SHOWN].decode("utf-8", "replace"))
    if isinstance(value, dict | list | tuple):
        if depth >= 3 or len(value) > 20:
            return None
        if isinstance(value, dict):
            return {json_safe(str(k)): json_safe(v, depth=depth + 1) for k, v in value.items()}
        return [json_safe(v, depth=depth + 1) for v in value]
    return json_safe(str(value))


def format_loc(loc: Sequence[Any]) -> str:
    """``("body", "profile", "layers", 3, "forward_ms")`` -> ``body.profile.layers[3].forward_ms``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_entries(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """pydantic's errors as ``{"loc", "msg", "input"}`` entries, JSON-safe."""
    entries = []
    for e in errors:
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        ctx = e.get("ctx") or {}
        if e.get("type") == "json_invalid" and "error" in ctx:
            msg = f"the body is not valid JSON: {ctx['error']}"
        entries.append({"loc": format_loc(e.get("loc", ())), "msg": msg, "input": json_safe(e.get("input"))})
    return entries


def invalid_request(entries: list[dict[str, Any]]) -> InputError:
    lines = [f"  {e['loc'] or '(body)'}: {e['msg']}" for e in entries[:20]]
    more = f"\n  ... and {len(entries) - 20} more" if len(entries) > 20 else ""
    return InputError("invalid request:\n" + "\n".join(lines) + more, entries)


# --------------------------------------------------------------------------- reading


#: whose limits a size is beyond, in messages
_BY = "this server plans"


def _parse(raw: bytes) -> Any:
    try:
        return loads_strict(raw, what="the request body", loc_prefix="body")
    except json.JSONDecodeError as err:
        entry = {"loc": "body", "msg": f"the body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}", "input": None}
        raise invalid_request([entry]) from None


def _precheck(data: Any, limits: Limits) -> None:
    """Sizes on the parsed JSON, before validation or the cluster shorthand."""
    if not isinstance(data, dict):
        return
    check_profile_data(
        data.get("profile"),
        max_layers=limits.max_layers,
        loc="body.profile",
        by=_BY, fix="merge layers into blocks, or raise PIPEPLAN_MAX_LAYERS",
    )
    check_cluster_data(
        data.get("cluster"),
        max_devices=limits.max_devices,
        loc="body.cluster",
        by=_BY, fix="plan one data-parallel group, or raise PIPEPLAN_MAX_DEVICES",
        suggest=False,
    )
    training = data.get("training")
    if isinstance(training, dict):
        g = training.get("global_batch_size")
        if isinstance(g, int | float) and not isinstance(g, bool) and g > limits.max_global_batch:
            check_count(
                "samples per step", int(g) if math.isfinite(g) else 2**63, limits.max_global_batch,
                loc="body.training.global_batch_size",
                by=_BY, fix="raise PIPEPLAN_MAX_GLOBAL_BATCH",
            )


def _check_microbatches(m: int | None, limits: Limits, loc: str) -> None:
    if m is not None:
        check_count(
            "micro-batches", m, limits.max_microbatches, loc=loc,
            by=_BY, fix="use fewer, larger micro-batches, or raise PIPEPLAN_MAX_MICROBATCHES",
        )


def _validate(cls: type[Any], data: Any) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in err.errors(include_url=False)]
        raise invalid_request(validation_entries(errors)) from None
    except (TypeError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as err:
        raise InputError(
            f"invalid request: {type(err).__name__}: {err}: check the body against /openapi.json",
            [{"loc": "body", "msg": json_safe(str(err)), "input": None}],
        ) from None


def _dump(dump: Callable[[], _T], data: Any) -> _T:
    """A model's JSON, or a 422 naming the string that is not valid Unicode."""
    try:
        return dump()
    except (PydanticSerializationError, UnicodeError) as err:
        paths = find_path(data, lambda v: isinstance(v, str) and not _is_utf8(v), limit=5)
        where = ", ".join(f"body.{p}" if p else "body" for p in paths) or "body"
        raise InputError(
            f"invalid request: {where} holds text that is not valid Unicode (a lone UTF-16 surrogate "
            "such as \\ud800): send UTF-8 text",
            [{"loc": f"body.{p}" if p else "body", "msg": "not valid Unicode", "input": None} for p in paths]
            or [{"loc": "body", "msg": json_safe(str(err)), "input": None}],
        ) from None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def canonical_request(body: PlanRequest, max_time_limit_s: float) -> tuple[str, float]:
    """The request as canonical JSON text (defaults filled, shorthands expanded, free-form
    metadata sorted, the time limit capped by the server) and the time limit it carries."""
    options = body.options or PlanOptions()
    time_limit = min(options.time_limit_s, max_time_limit_s)
    options = options.model_copy(update={"time_limit_s": time_limit})
    profile = body.profile
    if profile.metadata:
        profile = profile.model_copy(update={"metadata": _sorted(profile.metadata)})
    text = (
        f'{{"cluster":{body.cluster.model_dump_json()},"options":{options.model_dump_json()},'
        f'"profile":{profile.model_dump_json()},"training":{body.training.model_dump_json()}}}'
    )
    return text, time_limit


def request_sha256(canonical: str) -> str:
    """The cache key: the canonical request and the planner version that answers it."""
    return hashlib.sha256(f"pipeplan {service_version()}\n{canonical}".encode()).hexdigest()


@dataclass(frozen=True)
class PlanIntake:
    """A request that passed: its canonical text, cache key, capped time limit and model name."""

    canonical: str
    sha256: str
    time_limit_s: float
    model: str


def read_plan(raw: bytes, limits: Limits) -> PlanIntake:
    """Read a ``POST /v1/plans`` body; :class:`InputError` (422) when it is not one the server plans."""
    data = _parse(raw)
    _precheck(data, limits)
    body: PlanRequest = _validate(PlanRequest, data)
    if body.options is not None:
        _check_microbatches(body.options.num_microbatches, limits, "body.options.num_microbatches")
    canonical, time_limit = _dump(lambda: canonical_request(body, limits.max_time_limit_s), data)
    return PlanIntake(canonical, request_sha256(canonical), time_limit, body.profile.model)


def read_sweep(raw: bytes, limits: Limits) -> tuple[str, int, float]:
    """Read a ``POST /v1/sweeps`` body: its canonical JSON text (each point's time limit capped
    by the server, every point's cluster checked against the server's device limit), the
    number of points and the time limit of each."""
    from planner.sweep import point_cluster, point_kinds

    data = _parse(raw)
    _precheck(data, limits)
    if isinstance(data, dict) and isinstance(data.get("sweep"), dict):
        check_sweep_data(data["sweep"], loc="body.sweep", max_points=MAX_SWEEP_POINTS)
    body: SweepRequest = _validate(SweepRequest, data)
    spec = body.sweep
    for n in spec.devices:
        check_count("devices", n, limits.max_devices, loc="body.sweep.devices", by=_BY,
                    fix="sweep smaller clusters, or raise PIPEPLAN_MAX_DEVICES")
    defaults = sweep_defaults(body.profile, spec)
    for _, kind in point_kinds(spec):  # a kind the cluster shorthand refuses is a 422 now
        point_cluster(spec, min(spec.devices), kind, defaults=defaults)
    time_limit = min(spec.time_limit_s, limits.max_time_limit_s)
    body = body.model_copy(update={"sweep": spec.model_copy(update={"time_limit_s": time_limit})})
    points = len(set(spec.devices)) * len(point_kinds(spec))
    return _dump(body.model_dump_json, data), points, time_limit


def sweep_defaults(profile: Profile, spec: SweepSpec) -> dict[str, object]:
    """The cluster fields every point shares: the profile's device preset when the sweep names
    neither device types nor memories (a 422 when the profile has none either)."""
    if spec.device_types or spec.memories:
        return {}
    kind = profile.measured_on.device
    if kind.startswith("synthetic:"):
        return {"device_type": kind.split(":", 1)[1]}
    raise InputError(
        f"the profile was measured on {kind!r}: say which devices to sweep with sweep.device_types "
        "(e.g. [\"h100-80g\"]) or sweep.memories (e.g. [\"80GiB\"])",
        [{"loc": "body.sweep", "msg": "needs device_types or memories", "input": None}],
    )


def read_estimate(raw: bytes, limits: Limits) -> str:
    """Read a ``POST /v1/estimate`` body; its canonical JSON text for the solver pool."""
    data = _parse(raw)
    _precheck(data, limits)
    body: EstimateRequest = _validate(EstimateRequest, data)
    _check_microbatches(body.num_microbatches, limits, "body.num_microbatches")
    stages = len(body.stages)
    check_schedule_size(stages, body.num_microbatches, loc="body.num_microbatches", what="the estimate's schedule")
    return _dump(body.model_dump_json, data)


# --------------------------------------------------------------------------- jobs


def _answer(kind: str, payload: bytes) -> bytes:
    return kind.encode() + b"\n" + payload


def safe_text(text: str, limit: int = 4000) -> str:
    """``text`` cut to ``limit`` characters, lone surrogates replaced: always encodable."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.encode("utf-8", "replace").decode("utf-8")


def safe_entries(entries: Sequence[Any]) -> list[dict[str, Any]]:
    """Error entries ``{"loc", "msg", "input"}`` (at most 50) that serialize whatever they hold."""
    out = []
    for e in entries[:50]:
        e = e if isinstance(e, dict) else {"msg": e}
        out.append({
            "loc": safe_text(str(e.get("loc", "")), 500),
            "msg": safe_text(str(e.get("msg", "")), 1000),
            "input": json_safe(e.get("input")),
        })
    return out


def _invalid(err: InputError) -> bytes:
    body = {"message": safe_text(str(err)), "errors": safe_entries(err.errors)}
    return _answer("invalid", json.dumps(body).encode())


def _run_reader(fn: Callable[[bytes, Limits], bytes], payload: bytes, *, own_process: bool) -> bytes:
    head, _, raw = payload.partition(b"\n")
    if own_process:
        gc.disable()  # a worker process of its own: no cycles are made, and GC passes triple the time
    try:
        return fn(raw, Limits.from_json(head))
    except InputError as err:
        return _invalid(err)
    finally:
        if own_process:
            gc.enable()


def _plan_answer(raw: bytes, limits: Limits) -> bytes:
    r = read_plan(raw, limits)
    meta = json.dumps({"sha256": r.sha256, "time_limit_s": r.time_limit_s, "model": r.model})
    return _answer("ok", meta.encode() + b"\n" + r.canonical.encode())


def _estimate_answer(raw: bytes, limits: Limits) -> bytes:
    return _answer("ok", b"{}\n" + read_estimate(raw, limits).encode())


def _sweep_answer(raw: bytes, limits: Limits) -> bytes:
    canonical, points, time_limit = read_sweep(raw, limits)
    meta = json.dumps({"points": points, "time_limit_s": time_limit})
    return _answer("ok", meta.encode() + b"\n" + canonical.encode())


def plan_job(payload: bytes) -> bytes:
    """Job of a reading worker process: ``limits JSON \\n body`` -> the answer bytes."""
    return _run_reader(_plan_answer, payload, own_process=True)


def estimate_job(payload: bytes) -> bytes:
    return _run_reader(_estimate_answer, payload, own_process=True)


def sweep_job(payload: bytes) -> bytes:
    return _run_reader(_sweep_answer, payload, own_process=True)


def plan_job_in_thread(payload: bytes) -> bytes:
    return _run_reader(_plan_answer, payload, own_process=False)


def estimate_job_in_thread(payload: bytes) -> bytes:
    return _run_reader(_estimate_answer, payload, own_process=False)


def sweep_job_in_thread(payload: bytes) -> bytes:
    return _run_reader(_sweep_answer, payload, own_process=False)


def decode_answer(answer: bytes) -> tuple[dict[str, Any], str]:
    """A reading job's answer: ``(meta, canonical text)``, or the :class:`InputError` it carries."""
    kind, _, rest = answer.partition(b"\n")
    if kind == b"ok":
        meta, _, text = rest.partition(b"\n")
        return json.loads(meta), text.decode()
    if kind == b"invalid":
        body = json.loads(rest)
        raise InputError(body["message"], body["errors"])
    raise RuntimeError(rest.decode("utf-8", "replace"))


#: a body that takes longer than this to read means an overloaded server: 503
READ_TIMEOUT_S = 30.0


class RequestReader:
    """Reads request bodies in its own worker pool (processes in ``"process"`` mode).

    ``await reader.plan(raw)`` -> :class:`PlanIntake`, ``await reader.estimate(raw)`` ->
    canonical text; :class:`InputError` for a body the server does not plan."""

    def __init__(self, limits: Limits, *, workers: int = 2, mode: Literal["process", "thread"] = "process") -> None:
        in_process = mode == "process"
        jobs: dict[str, Job] = {
            "plan": plan_job if in_process else plan_job_in_thread,
            "estimate": estimate_job if in_process else estimate_job_in_thread,
            "sweep": sweep_job if in_process else sweep_job_in_thread,
        }
        self.limits = limits
        self.pool = WorkerPool(jobs, workers=workers, mode=mode, name="pipeplan-reader")
        self._head = limits.to_json() + b"\n"

    def start(self) -> None:
        self.pool.start()

    async def plan(self, raw: bytes) -> PlanIntake:
        meta, canonical = decode_answer(await self.pool.run("plan", self._head + raw, timeout_s=READ_TIMEOUT_S))
        return PlanIntake(canonical, str(meta["sha256"]), float(meta["time_limit_s"]), str(meta["model"]))

    async def estimate(self, raw: bytes) -> str:
        _, canonical = decode_answer(await self.pool.run("estimate", self._head + raw, timeout_s=READ_TIMEOUT_S))
        return canonical

    async def sweep(self, raw: bytes) -> tuple[str, int, float]:
        """Canonical text, point count and per-point time limit of a sweep request."""
        meta, canonical = decode_answer(await self.pool.run("sweep", self._head + raw, timeout_s=READ_TIMEOUT_S))
        return canonical, int(meta["points"]), float(meta["time_limit_s"])

    def close(self) -> None:
        self.pool.close()
