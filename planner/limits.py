"""What pipeplan plans at most, and strict JSON reading.

Every size a document or a command line gives is checked against these ceilings before
anything proportional to it is allocated or computed: a typo such as ``--devices 20000000``
is an error at once, not a 10 GB list.  The service has its own, lower, configurable
limits (``PIPEPLAN_MAX_*``) within these.

JSON is read strictly: ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's parser accepts
but JSON does not have), and numbers too large for a float, are errors naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pydantic_core

from planner.errors import InputError

#: devices in one cluster
MAX_DEVICES = 16_384
#: layers in one profile
MAX_LAYERS = 65_536
#: micro-batch sizes measured in one profile
MAX_PROFILE_SIZES = 64
#: samples per training step (the global batch), and the largest micro-batch size
MAX_GLOBAL_BATCH = 2**20
#: micro-batches per step a plan or an estimate may fix
MAX_MICROBATCHES = 65_536
#: stages x micro-batches of one schedule (the simulator steps through each cell)
MAX_SCHEDULE_CELLS = 2**22
#: a forward or backward time, milliseconds (about 30 years: keeps every sum finite)
MAX_LAYER_MS = 1e12
#: solver time limit, seconds
MAX_TIME_LIMIT_S = 3_600.0
#: memory of one device, and any byte count in a profile (4 EiB: sums stay exact floats' range)
MAX_MEMORY_BYTES = 2**62
#: a JSON file the command line reads
MAX_FILE_BYTES = 512 * 2**20
#: nesting of free-form JSON (a profile's metadata)
MAX_JSON_DEPTH = 32
#: training steps in one run report
MAX_REPORT_STEPS = 100_000
#: per-rank step rows and timeline rows (stage x replica x step) in one run report
MAX_REPORT_ROWS = 2**20
#: run reports one calibration reads
MAX_REPORTS = 64
#: micro-batch cells (rows x micro-batches) of one run report's timeline (pipeplan run writes 2**18 at most)
MAX_TIMELINE_CELLS = 2**20


def _suggestion(value: int, limit: int) -> int | None:
    """``value`` with the fewest trailing zeros removed that brings it within ``limit``
    (20,000,000 -> 2,000 for a limit of 16,384), when it ends in that many zeros."""
    x = value
    while x > limit and x % 10 == 0:
        x //= 10
    return x if 1 <= x <= limit and x != value else None


def too_large(
    what: str, value: int, limit: int, *, by: str = "pipeplan plans", fix: str = "", suggest: bool = False
) -> str:
    """``'20,000,000 devices is beyond what pipeplan plans (at most 16,384); did you mean 2,000?'``.

    ``suggest`` (for numbers someone typed) offers the value without the extra zeros."""
    text = f"{value:,} {what} is beyond what {by} (at most {limit:,})"
    guess = _suggestion(value, limit) if suggest else None
    if guess is not None:
        text += f"; did you mean {guess:,}?"
    if fix:
        text += f": {fix}"
    return text


def check_count(
    what: str,
    value: int,
    limit: int,
    *,
    loc: str = "",
    by: str = "pipeplan plans",
    fix: str = "",
    suggest: bool = False,
) -> None:
    """Raise :class:`InputError` when ``value`` exceeds ``limit``."""
    if value > limit:
        message = too_large(what, value, limit, by=by, fix=fix, suggest=suggest)
        raise InputError(message, [{"loc": loc, "msg": f"at most {limit}", "input": value}])


# --------------------------------------------------------------------------- strict JSON


class _NonFinite:
    """Stands in for a NaN/Infinity while parsing, so the error can name its field."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _parse_float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


#: every digit as 0 and E as e, so a few substring searches (C speed) find the shapes below
_DIGITS = bytes.maketrans(b"123456789E", b"000000000e")


def _maybe_beyond_float(raw: bytes) -> bool:
    """Whether ``raw`` may hold a number a float cannot hold (read as infinity): an exponent
    of 3+ digits or 309+ digits in a row.  Conservative: text like ``"stage100"`` also counts."""
    shape = raw.translate(_DIGITS)
    return b"e000" in shape or b"e+000" in shape or b"0" * 309 in shape


def find_path(data: Any, found: Callable[[Any], bool], *, limit: int = 10) -> list[str]:
    """Paths (``layers[3].forward_ms[0]``) of up to ``limit`` values for which ``found`` holds.

    Iterative, so any nesting depth is fine."""
    out: list[str] = []
    stack: list[tuple[str, Any]] = [("", data)]
    while stack and len(out) < limit:
        path, value = stack.pop()
        if isinstance(value, dict):
            for k in reversed(list(value)):
                stack.append((f"{path}.{k}" if path else str(k), value[k]))
        elif isinstance(value, list):
            for i in range(len(value) - 1, -1, -1):
                stack.append((f"{path}[{i}]", value[i]))
        elif found(value):
            out.append(path)
    return out


def loads_strict(text: str | bytes, *, what: str = "the JSON", loc_prefix: str = "") -> Any:
    """Parse JSON, refusing ``NaN``, ``Infinity``, ``-Infinity`` and numbers beyond a float.

    Raises :class:`InputError` naming each offending field, and for nesting too deep, a
    number with too many digits, or bytes that are not UTF-8.  Anything else that is not
    JSON raises ``json.JSONDecodeError`` (the caller words it with the file name)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if not _maybe_beyond_float(raw):
        # fast path (Rust, twice as fast as json): no NaN/Infinity; it refuses lone surrogates
        # and deep nesting too, which the path below reads or words exactly
        try:
            return pydantic_core.from_json(raw, allow_inf_nan=False)
        except ValueError:
            pass
    seen: list[str] = []

    def constant(name: str) -> Any:
        seen.append(name)
        return _NonFinite(name)

    def floats(text: str) -> Any:
        value = _parse_float(text)
        if isinstance(value, _NonFinite):
            seen.append(text)
        return value

    try:
        data = json.loads(text, parse_constant=constant, parse_float=floats)
    except RecursionError:
        raise InputError(
            f"{what} is nested too deeply to read: flatten it",
            [{"loc": loc_prefix, "msg": "nested too deeply", "input": None}],
        ) from None
    except UnicodeDecodeError as err:
        raise InputError(
            f"{what} is not UTF-8 text: {err.reason} at byte {err.start}",
            [{"loc": loc_prefix, "msg": "not UTF-8", "input": None}],
        ) from None
    except json.JSONDecodeError:
        raise
    except ValueError as err:  # e.g. an integer with more than 4300 digits
        raise InputError(
            f"{what} holds a number pipeplan cannot read: {err}",
            [{"loc": loc_prefix, "msg": str(err), "input": None}],
        ) from None
    if seen:
        paths = find_path(data, lambda v: isinstance(v, _NonFinite))
        prefix = f"{loc_prefix}." if loc_prefix and paths and not paths[0].startswith("[") else loc_prefix
        entries = [
            {"loc": f"{prefix}{p}", "msg": "JSON has no NaN or Infinity: give a finite number", "input": seen_text}
            for p, seen_text in zip(paths, seen, strict=False)
        ]
        where = ", ".join(e["loc"] or "(top level)" for e in entries) or "a key given twice (the later value won)"
        if not entries:
            entries = [{"loc": loc_prefix, "msg": "JSON has no NaN or Infinity", "input": seen[0]}]
        raise InputError(
            f"{what} holds {seen[0]} at {where}: JSON has no NaN or Infinity (and numbers must fit a "
            "64-bit float); give a finite number",
            entries,
        )
    return data


def json_depth_exceeds(data: Any, limit: int) -> bool:
    """Whether ``data`` nests lists/dicts deeper than ``limit`` (iterative)."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth >= limit:
                return True
            children = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in children)
    return False


# --------------------------------------------------------------------------- pre-checks


def _int(value: Any) -> int | None:
    """``value`` as an int when it is an integral number (pydantic accepts 8.0 for 8)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _join(loc: str, name: str) -> str:
    return f"{loc}.{name}" if loc else name


_MS_FIELDS = ("forward_ms", "backward_ms", "forward_ms_spread", "backward_ms_spread")
_BYTES_FIELDS = ("param_bytes", "activation_bytes", "output_bytes", "cut_bytes", "peak_memory_bytes")


def _largest(values: Any) -> Any:
    """The largest of a number or a list of numbers; ``None`` for anything else (validation
    names wrong types)."""
    if isinstance(values, int | float) and not isinstance(values, bool):
        return values
    if not isinstance(values, list) or not values:
        return None
    try:
        worst = max(values)
    except TypeError:  # mixed types
        return None
    return worst if isinstance(worst, int | float) and not isinstance(worst, bool) else None


def _check_value(value: Any, limit: float, where: str, unit: str, fix: str) -> None:
    if value is not None and value > limit:
        if isinstance(value, float):
            shown = f"{value:g}"
        else:
            shown = f"{value:,}" if value < 10**30 else f"a {len(str(value))}-digit number of"
        raise InputError(
            f"{where} holds {shown} {unit}, beyond what pipeplan plans (at most {limit:g} {unit}): {fix}",
            [{"loc": where, "msg": f"at most {limit:g} {unit}", "input": value if isinstance(value, float) else str(value)}],
        )


def check_profile_data(
    data: Any,
    *,
    max_layers: int = MAX_LAYERS,
    loc: str = "",
    by: str = "pipeplan plans",
    fix: str = "merge layers into blocks",
) -> None:
    """Sizes of a profile as parsed JSON, before it is validated: layer count, micro-batch
    sizes, per-layer times and the nesting of ``metadata``.  Wrong types are left to
    validation, which names them."""
    if not isinstance(data, dict):
        return
    layers = data.get("layers")
    if isinstance(layers, list):
        check_count("layers", len(layers), max_layers, loc=_join(loc, "layers"), by=by, fix=fix)
    sizes = data.get("microbatch_sizes")
    if isinstance(sizes, list):
        check_count(
            "micro-batch sizes", len(sizes), MAX_PROFILE_SIZES, loc=_join(loc, "microbatch_sizes"),
            fix="measure a few sizes (e.g. 1,2,4,8): the planner interpolates between them",
        )
        for i, b in enumerate(sizes):
            n = _int(b)
            if n is not None and n > MAX_GLOBAL_BATCH:
                check_count("samples per micro-batch", n, MAX_GLOBAL_BATCH, loc=_join(loc, f"microbatch_sizes[{i}]"))
    metadata = data.get("metadata")
    if metadata is not None and json_depth_exceeds(metadata, MAX_JSON_DEPTH):
        raise InputError(
            f"{_join(loc, 'metadata')} nests deeper than {MAX_JSON_DEPTH} levels: keep metadata flat",
            [{"loc": _join(loc, "metadata"), "msg": f"at most {MAX_JSON_DEPTH} levels", "input": None}],
        )
    _check_value(_largest(data.get("input_bytes")), MAX_MEMORY_BYTES, _join(loc, "input_bytes"), "bytes", "check the profile's units")
    calibration = data.get("calibration")
    if isinstance(calibration, dict):
        for name, what, limit in (("layers", "calibrated layers", max_layers), ("runs", "calibration runs", MAX_REPORTS)):
            values = calibration.get(name)
            if isinstance(values, list):
                check_count(what, len(values), limit, loc=_join(loc, f"calibration.{name}"), by=by)
    if not isinstance(layers, list):
        return
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            continue
        for field in _MS_FIELDS:
            where = _join(loc, f"layers[{i}].{field}")
            _check_value(_largest(layer.get(field)), MAX_LAYER_MS, where, "ms", "check the profile's units (milliseconds)")
        for field in _BYTES_FIELDS:
            where = _join(loc, f"layers[{i}].{field}")
            _check_value(_largest(layer.get(field)), MAX_MEMORY_BYTES, where, "bytes", "check the profile's units (bytes)")


def check_schedule_size(
    num_stages: int, num_microbatches: int, *, loc: str = "", what: str = "the schedule"
) -> None:
    """Refuse a schedule the simulator would need too long (or too much memory) to step through."""
    cells = num_stages * num_microbatches
    if cells > MAX_SCHEDULE_CELLS:
        raise InputError(
            f"{what} has {num_stages:,} stages x {num_microbatches:,} micro-batches = {cells:,} cells, "
            f"beyond what pipeplan simulates (at most {MAX_SCHEDULE_CELLS:,}): use fewer, larger "
            "micro-batches or fewer stages",
            [{"loc": loc, "msg": f"stages x micro-batches at most {MAX_SCHEDULE_CELLS}", "input": cells}],
        )


def check_plan_data(data: Any, *, loc: str = "") -> None:
    """Sizes of a plan as parsed JSON, before it is validated: its schedule and its cluster."""
    if not isinstance(data, dict):
        return
    m = _int(data.get("num_microbatches"))
    if m is not None:
        check_count("micro-batches", m, MAX_MICROBATCHES, loc=_join(loc, "num_microbatches"))
        stages = data.get("stages")
        if isinstance(stages, list):
            check_schedule_size(len(stages), m, loc=_join(loc, "num_microbatches"), what="the plan's schedule")
    for name, what, limit in (
        ("pipeline_degree", "pipeline stages", MAX_DEVICES),
        ("data_parallel_degree", "data-parallel replicas", MAX_DEVICES),
        ("virtual_stages", "virtual stages per device", MAX_LAYERS),
        ("num_layers", "layers", MAX_LAYERS),
    ):
        n = _int(data.get(name))
        if n is not None:
            check_count(what, n, limit, loc=_join(loc, name))
    check_cluster_data(data.get("cluster"), loc=_join(loc, "cluster"))


def check_cluster_data(
    data: Any,
    *,
    max_devices: int = MAX_DEVICES,
    loc: str = "",
    by: str = "pipeplan plans",
    fix: str = "",
    suggest: bool = True,
) -> None:
    """The device count of a cluster as parsed JSON (a count or a list), before it is validated
    or the shorthand expanded."""
    if not isinstance(data, dict):
        return
    devices = data.get("devices")
    n = len(devices) if isinstance(devices, list) else _int(devices)
    if n is not None:
        check_count("devices", n, max_devices, loc=_join(loc, "devices"), by=by, fix=fix, suggest=suggest)


def check_sweep_data(data: Any, *, loc: str = "", max_points: int = 32) -> None:
    """A sweep's device counts, before validation: at most ``max_points`` of them, each a count
    pipeplan plans."""
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        return
    counts = data["devices"]
    check_count("device counts", len(counts), max_points, loc=_join(loc, "devices"), by="one sweep takes",
                fix="sweep fewer counts")
    for i, value in enumerate(counts):
        n = _int(value)
        if n is not None:
            check_count("devices", n, MAX_DEVICES, loc=f"{_join(loc, 'devices')}[{i}]", suggest=True)


def check_report_data(data: Any, *, loc: str = "") -> None:
    """Sizes of a run report as parsed JSON, before it is validated: its steps, stages, ranks,
    per-rank steps and timeline rows (each row at most one entry per micro-batch), and its plan."""
    if not isinstance(data, dict):
        return
    for name, what, limit in (
        ("steps", "steps", MAX_REPORT_STEPS),
        ("stages", "stages", MAX_LAYERS),
        ("ranks", "ranks", MAX_DEVICES),
        ("rank_busy_fraction", "ranks", MAX_DEVICES),
        ("rank_steps", "per-rank step rows", MAX_REPORT_ROWS),
        ("timeline", "timeline rows", MAX_REPORT_ROWS),
        ("notes", "notes", MAX_REPORT_STEPS),
    ):
        values = data.get(name)
        if isinstance(values, list):
            check_count(what, len(values), limit, loc=_join(loc, name), by="a run report holds")
    plan = data.get("plan")
    check_plan_data(plan, loc=_join(loc, "plan"))
    m = _int(plan.get("num_microbatches")) if isinstance(plan, dict) else None
    timeline = data.get("timeline")
    if m is None or not isinstance(timeline, list):
        return
    check_count(
        "timeline cells (rows x micro-batches)", len(timeline) * m, MAX_TIMELINE_CELLS, loc=_join(loc, "timeline"),
        by="a run report holds",
    )
    for i, row in enumerate(timeline):
        if not isinstance(row, dict):
            continue
        for field in ("forward_start_ms", "forward_ms", "backward_start_ms", "backward_ms"):
            values = row.get(field)
            if isinstance(values, list) and len(values) > m:
                raise InputError(
                    f"{_join(loc, f'timeline[{i}].{field}')} has {len(values):,} entries but the plan has {m:,} "
                    "micro-batches: give one per micro-batch",
                    [{"loc": _join(loc, f"timeline[{i}].{field}"), "msg": f"at most {m} entries", "input": len(values)}],
                )
