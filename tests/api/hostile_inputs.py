"""Hostile and careless inputs for the service and the command line (hypothesis strategies).

A body is a valid request with one to three fields replaced by something a careless or
hostile client sends: extreme integers (10^18, -1, 2^63), NaN and Infinity, huge strings,
unicode and lone surrogates, wrong types, deep nesting, sizes at and just past each limit;
sometimes a duplicate key.  :func:`encode` writes the JSON text itself (NaN, 100,000-deep
nesting and integers of 5,000 digits are not what ``json.dumps`` makes).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

#: the live server's limits in these tests (its defaults, and a 1 s time-limit cap)
MAX_LAYERS = 4096
MAX_DEVICES = 4096
MAX_MICROBATCHES = 1024
MAX_GLOBAL_BATCH = 2**20
MAX_PROFILE_SIZES = 64
MAX_JSON_DEPTH = 32


@dataclass(frozen=True)
class Raw:
    """JSON text put into a document as is."""

    text: str


@dataclass(frozen=True)
class Repeat:
    """The list at this path repeated to ``n`` items (layers get unique names)."""

    n: int


EXTREME_INTS = (10**18, -1, 0, 2**63, 2**63 - 1, -(2**63), 2**31, 2**64 + 1, 10**400)
NON_FINITE = (float("nan"), float("inf"), float("-inf"))
RAW_NUMBERS = (Raw("1e999"), Raw("-1e999"), Raw("1" + "0" * 5000), Raw("NaN"), Raw("-Infinity"), Raw("1E+0400"))
WRONG_TYPES: tuple[Any, ...] = (None, True, False, "", "8", "1e18", [], {}, [1, 2, 3], {"a": 1}, 1.5, -0.0, [[[]]])
STRINGS = (
    "x" * 1_000_000,
    "\ud800",
    "a\udfffb",
    "\u0000",
    "🙂" * 1000,
    "١٢٣",
    "<script>",
    "../../etc/passwd",
    "80GiB",
    "1e400GiB",
    "-1GiB",
    "NaNGiB",
    "h100-80g",
)


def _nested(depth: int, *, kind: str = "list") -> Raw:
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


DEEP = (_nested(MAX_JSON_DEPTH - 1, kind="dict"), _nested(MAX_JSON_DEPTH + 1, kind="dict"), _nested(1000), _nested(100_000), _nested(5000, kind="dict"))

#: sizes at and just past each limit, by field name
AT_LIMITS: dict[str, tuple[Any, ...]] = {
    "devices": (MAX_DEVICES, MAX_DEVICES + 1, 16_384, 16_385, 10**7, 10**9),
    "devices_per_node": (MAX_DEVICES, MAX_DEVICES + 1, 16_385),
    "global_batch_size": (MAX_GLOBAL_BATCH, MAX_GLOBAL_BATCH + 1, 10**18),
    "num_microbatches": (MAX_MICROBATCHES, MAX_MICROBATCHES + 1, 65_536, 65_537),
    "time_limit_s": (1.0, 1.0001, 3600.0, 3600.5, 1e300, 1e-300),
    "stages": (MAX_DEVICES, MAX_DEVICES + 1, Repeat(MAX_LAYERS), Repeat(MAX_LAYERS + 1)),
    "data_parallel": (MAX_DEVICES, 16_384, 16_385),
    "virtual_stages": (65_536, 65_537),
    "layers": (Repeat(MAX_LAYERS), Repeat(MAX_LAYERS + 1), Repeat(0)),
    "microbatch_sizes": (Repeat(MAX_PROFILE_SIZES), Repeat(MAX_PROFILE_SIZES + 1), [1, 2, 2**20 + 1], [1, 2, 10**18]),
    "recompute": (Repeat(MAX_LAYERS + 1),),
    "memory": ("1PiB", 2**62, 2**62 + 1, "1e30GB"),
    "param_bytes": (2**62, 2**62 + 1, 10**150),
    "forward_ms": ([1e12, 1e12, 1e12], [1.1e12, 1, 1], [1e300, 1e300, 1e300]),
    "metadata": (*DEEP[:2], {str(i): i for i in range(10_000)}),
}


def hostile_values(name: str) -> st.SearchStrategy[Any]:
    """Something to put where field ``name`` goes."""
    options: list[st.SearchStrategy[Any]] = [
        st.sampled_from(EXTREME_INTS),
        st.sampled_from(NON_FINITE),
        st.sampled_from(RAW_NUMBERS),
        st.sampled_from(WRONG_TYPES),
        st.sampled_from(STRINGS),
        st.sampled_from(DEEP),
        st.text(max_size=20),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
    ]
    if name in AT_LIMITS:
        options.append(st.sampled_from(AT_LIMITS[name]))
        options.append(st.sampled_from(AT_LIMITS[name]))  # twice as likely
    return st.one_of(options)


def _resolve(container: Any, key: Any, value: Any) -> Any:
    if isinstance(value, Repeat):
        current = container.get(key) if isinstance(container, dict) else None
        items = current if isinstance(current, list) and current else [1]
        out = [copy.deepcopy(items[i % len(items)]) for i in range(value.n)]
        for i, item in enumerate(out):
            if isinstance(item, dict) and "name" in item:
                item["name"] = f"{item['name']}-{i}"
            elif isinstance(item, dict) and "start" in item:  # stage ranges: one layer each
                item.update(start=i, stop=i + 1)
        return out
    return value


def set_path(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``doc`` with ``path`` set to ``value`` (missing containers are made; the root can be replaced)."""
    if not path:
        return _resolve({}, None, value)
    node = doc
    for key in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(key, {})
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return doc
    last = path[-1]
    if isinstance(node, dict):
        node[last] = _resolve(node, last, value)
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = _resolve({}, None, value)
    return doc


def encode(doc: Any, *, duplicate: tuple[str, Any] | None = None) -> bytes:
    """JSON text of ``doc`` with :class:`Raw` pieces in place, NaN/Infinity as tokens, and
    ``duplicate`` as a second top-level key after the first."""
    raws: list[str] = []

    def swap(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**4000:
            raws.append(str(value))
            return f"\x00RAW{len(raws) - 1}\x00"
        return value

    text = json.dumps(swap(doc))
    if duplicate is not None and text.endswith("}") and text != "{}":
        text = text[:-1] + f", {json.dumps(duplicate[0])}: {json.dumps(swap(duplicate[1]))}}}"
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), raw)
    return text.encode("utf-8", "surrogatepass")


#: fields of a plan request worth breaking (the last part names the value kind)
PLAN_PATHS: tuple[tuple[Any, ...], ...] = (
    (),
    ("cluster",),
    ("cluster", "devices"),
    ("cluster", "memory"),
    ("cluster", "device_type"),
    ("cluster", "devices_per_node"),
    ("cluster", "intra_node"),
    ("cluster", "speed"),
    ("training",),
    ("training", "global_batch_size"),
    ("training", "optimizer"),
    ("training", "memory_margin"),
    ("options",),
    ("options", "num_microbatches"),
    ("options", "time_limit_s"),
    ("options", "stages"),
    ("options", "data_parallel"),
    ("options", "virtual_stages"),
    ("options", "schedule"),
    ("options", "recompute"),
    ("profile",),
    ("profile", "model"),
    ("profile", "schema_version"),
    ("profile", "microbatch_sizes"),
    ("profile", "layers"),
    ("profile", "metadata"),
    ("profile", "measured_on"),
    ("profile", "layers", 0, "name"),
    ("profile", "layers", 1, "forward_ms"),
    ("profile", "layers", 2, "forward_ms", 0),
    ("profile", "layers", 3, "param_bytes"),
    ("profile", "layers", 4, "activation_bytes", 1),
    ("profile", "layers", 5),
    ("unknown_key",),
)

ESTIMATE_PATHS: tuple[tuple[Any, ...], ...] = (
    *(p for p in PLAN_PATHS if p[:1] != ("options",)),
    ("stages",),
    ("stages", 0, "stop"),
    ("num_microbatches",),
    ("schedule",),
    ("recompute",),
    ("data_parallel",),
    ("pipeline_degree",),
    ("devices",),
)


def _name(path: tuple[Any, ...]) -> str:
    named = [p for p in path if isinstance(p, str)]
    return named[-1] if named else ""


@st.composite
def hostile_document(draw: st.DrawFn, base: dict[str, Any], paths: tuple[tuple[Any, ...], ...]) -> bytes:
    """``base`` with one to three of ``paths`` broken, maybe a duplicate key: the JSON text."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(paths))
        doc = set_path(doc, path, draw(hostile_values(_name(path))))
    duplicate = None
    if isinstance(doc, dict) and doc and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(doc)))
        duplicate = (key, _resolve(doc, key, draw(hostile_values(key))))
    return encode(doc, duplicate=duplicate)


def document_paths(doc: Any, *, limit: int = 40) -> tuple[tuple[Any, ...], ...]:
    """Paths into ``doc`` (dict keys and the first two list items, breadth first)."""
    out: list[tuple[Any, ...]] = [()]
    queue: list[tuple[tuple[Any, ...], Any]] = [((), doc)]
    while queue and len(out) < limit:
        path, node = queue.pop(0)
        children = list(node.items()) if isinstance(node, dict) else list(enumerate(node[:2])) if isinstance(node, list) else []
        for key, child in children:
            out.append((*path, key))
            queue.append(((*path, key), child))
    return tuple(out[:limit])
