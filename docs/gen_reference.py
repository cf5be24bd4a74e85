"""Generate the reference pages of the docs site from the code itself, at build time.

Run by mkdocs-gen-files (``mkdocs.yml``: ``plugins: gen-files: scripts``), which executes this file
with ``runpy.run_path``; ``generate(write)`` is also called by ``tests/test_docs.py`` into a temporary
directory. Nothing here is written by hand, so none of it can drift from the code:

- ``reference/cli/<command>.md``: every subcommand and flag, from ``pipeplan.cli.build_parser()``;
- ``reference/schemas/<kind>.md``: the documents' JSON Schemas (``pipeplan schema KIND``);
- ``reference/http-api.md``: the service's paths and operations, from its OpenAPI document;
- ``reference/presets.md``: device, link and optimizer presets with their sources;
- ``design/modules.md``: the solver's and cost model's modules with their module docstrings.
"""

from __future__ import annotations

import argparse
import ast
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
Write = Callable[[str, str], None]

#: solver and cost-model packages whose modules design/modules.md lists
MODULE_PACKAGES = ("planner/search", "planner/bounds", "planner/cost", "planner/splits")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


# --------------------------------------------------------------------------------------- CLI


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """The ``pipeplan`` subcommands and their parsers, in ``--help`` order."""
    from pipeplan.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("pipeplan's parser has no subcommands")


def subcommand_help() -> dict[str, str]:
    from pipeplan.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def arguments(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Every argument of a parser but ``-h/--help`` and nested subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        yield action


def nested(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A subcommand's own subcommands (``pipeplan synth transformer``), if any."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def all_parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``("synth transformer", parser)``: every subcommand, nested ones included."""

    def walk(
        name: str, parser: argparse.ArgumentParser
    ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
        yield name, parser
        for child, sub in nested(parser).items():
            yield from walk(f"{name} {child}", sub)

    for name, parser in subcommands().items():
        yield from walk(name, parser)


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return parser._get_formatter()._expand_help(action)


def _flag_names(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    return f"`{action.metavar or action.dest}`"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return f"`{metavar}`"


def _default(action: argparse.Action) -> str:
    if (
        action.nargs == 0
        or action.default in (None, argparse.SUPPRESS)
        or not action.option_strings
    ):
        return ""
    return f"`{action.default}`"


def _parser_section(
    name: str, parser: argparse.ArgumentParser, summary: str, level: int
) -> list[str]:
    lines = [f"{'#' * level} `pipeplan {name}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ("" if summary.endswith(".") else "."), ""]
    if parser.description and parser.description != summary:
        lines += [parser.description, ""]
    usage = parser.format_usage().removeprefix("usage: ").strip()
    lines += ["```", usage, "```", ""]
    rows = [a for a in arguments(parser) if a.help != argparse.SUPPRESS]  # hidden on purpose
    if rows:
        lines += ["| argument | value | default | help |", "| --- | --- | --- | --- |"]
        for action in rows:
            lines.append(
                f"| {_flag_names(action)} | {_cell(_value(action))} | {_cell(_default(action))} "
                f"| {_cell(expanded_help(parser, action))} |"
            )
        lines.append("")
    if parser.epilog:
        lines += [parser.epilog, ""]
    for child, sub in nested(parser).items():
        lines += _parser_section(f"{name} {child}", sub, "", level + 1)
    return lines


def cli_page(name: str, parser: argparse.ArgumentParser, summary: str) -> str:
    lines = _parser_section(name, parser, summary, 1)
    lines += ["*Generated from `pipeplan/cli.py`'s parser by `docs/gen_reference.py`.*", ""]
    return "\n".join(lines)


def cli_pages(write: Write) -> None:
    commands = subcommands()
    helps = subcommand_help()
    index = [
        "# Command line",
        "",
        "`pipeplan COMMAND ...`; `plan ...` is `pipeplan plan ...`. Every command answers bad input with "
        "`error: ...` and exit code 1, and exit code 2 when no plan fits memory.",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    for name, parser in commands.items():
        write(f"reference/cli/{name}.md", cli_page(name, parser, helps.get(name, "")))
        index.append(f"| [`{name}`]({name}.md) | {_cell(helps.get(name, ''))} |")
    write("reference/cli/index.md", "\n".join([*index, ""]))


# ------------------------------------------------------------------------------------ schemas

SCHEMA_TITLES = {
    "profile": "Profile",
    "cluster": "Cluster",
    "training": "Training setup",
    "plan": "Plan",
    "options": "Plan options",
    "sweep": "Sweep specification",
    "report": "Run report",
}


def _type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    if "allOf" in prop and len(prop["allOf"]) == 1:
        return _type(prop["allOf"][0])
    if "enum" in prop:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    kind = prop.get("type", "any")
    if kind == "array" and "items" in prop:
        return f"array of {_type(prop['items'])}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"object of {_type(prop['additionalProperties'])}"
    return str(kind)


def _properties_table(schema: dict[str, Any]) -> list[str]:
    props = schema.get("properties", {})
    if not props:
        return ["(no fields)", ""]
    required = set(schema.get("required", []))
    lines = [
        "| field | type | required | default | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, prop in props.items():
        default = f"`{json.dumps(prop['default'])}`" if "default" in prop else ""
        lines.append(
            f"| `{name}` | {_cell(_type(prop))} | {'yes' if name in required else ''} | {_cell(default)} "
            f"| {_cell(prop.get('description', ''))} |"
        )
    return [*lines, ""]


def schema_page(kind: str, schema: dict[str, Any]) -> str:
    title = SCHEMA_TITLES.get(kind, kind)
    lines = [f"# {title} (`{kind}`)", ""]
    lines += [
        f"The JSON Schema of the {title.lower()} document, as `pipeplan schema {kind}` prints it "
        "and the service's OpenAPI document serves it. What the formats mean, with examples: "
        "[the formats](../formats.md).",
        "",
    ]
    if schema.get("description"):
        lines += [schema["description"], ""]
    lines += [f"## {schema.get('title', title)}", ""]
    lines += _properties_table(schema)
    for name, sub in sorted(schema.get("$defs", {}).items()):
        lines += [f"## {name}", ""]
        if sub.get("description"):
            lines += [sub["description"], ""]
        if "enum" in sub:
            lines += ["One of " + ", ".join(f"`{json.dumps(v)}`" for v in sub["enum"]) + ".", ""]
        else:
            lines += _properties_table(sub)
    lines += [
        "## The whole schema",
        "",
        '??? note "JSON"',
        "",
        "    ```json",
        *("    " + line for line in json.dumps(schema, indent=2).splitlines()),
        "    ```",
        "",
        "*Generated from `planner/schema.py` by `docs/gen_reference.py`.*",
        "",
    ]
    return "\n".join(lines)


def schema_pages(write: Write) -> None:
    from planner.schema import DOCUMENTS, json_schema

    index = [
        "# Document schemas",
        "",
        "Every document pipeplan reads or writes is a pydantic model in `planner/schema.py`; "
        "`pipeplan schema KIND` prints its JSON Schema. One page per kind:",
        "",
    ]
    for kind in DOCUMENTS:
        write(f"reference/schemas/{kind}.md", schema_page(kind, json_schema(kind)))
        index.append(f"- [{SCHEMA_TITLES.get(kind, kind)}]({kind}.md): `pipeplan schema {kind}`")
    write("reference/schemas/index.md", "\n".join([*index, ""]))


# ----------------------------------------------------------------------------------- HTTP API


def openapi_document() -> dict[str, Any]:
    from api.app import create_app
    from api.settings import ApiSettings

    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(ApiSettings(db=f"sqlite:///{tmp}/plans.db"))
        return dict(app.openapi())


def http_page(doc: dict[str, Any]) -> str:
    info = doc.get("info", {})
    lines = ["# HTTP API", ""]
    lines += [
        f"The planning service (`pipeplan serve`, `api/app.py`), OpenAPI {doc.get('openapi', '')}, "
        f"version `{info.get('version', '')}`. A running service serves the whole document at "
        "`/openapi.json` and an explorer at `/docs`. How to use it: "
        "[the planning service tutorial](../tutorials/service.md).",
        "",
        "| method | path | summary |",
        "| --- | --- | --- |",
    ]
    operations = []
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if method.startswith("x-") or not isinstance(op, dict):
                continue
            operations.append((path, method, op))
            lines.append(f"| `{method.upper()}` | `{path}` | {_cell(op.get('summary', ''))} |")
    lines.append("")
    for path, method, op in operations:
        lines += [f"## `{method.upper()} {path}`", ""]
        if op.get("description"):
            lines += [op["description"], ""]
        params = op.get("parameters", [])
        if params:
            lines += ["| parameter | in | required | description |", "| --- | --- | --- | --- |"]
            for p in params:
                lines.append(
                    f"| `{p.get('name')}` | {p.get('in', '')} | {'yes' if p.get('required') else ''} "
                    f"| {_cell(p.get('description', ''))} |"
                )
            lines.append("")
        body = op.get("requestBody", {}).get("content", {})
        for media, content in body.items():
            ref = content.get("schema", {}).get("$ref", "")
            lines += [
                f"Request body: `{media}`" + (f", `{ref.rsplit('/', 1)[-1]}`" if ref else "") + ".",
                "",
            ]
        responses = op.get("responses", {})
        if responses:
            codes = ", ".join(
                f"`{code}` {_cell(r.get('description', ''))}" for code, r in responses.items()
            )
            lines += [f"Responses: {codes}.", ""]
    if info.get("description"):
        lines += ["## About the service", "", info["description"], ""]
    lines += ["*Generated from `api/app.py`'s `.openapi()` by `docs/gen_reference.py`.*", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ presets


def presets_page() -> str:
    from planner.presets import DEVICES, INTERCONNECTS, OPTIMIZERS

    lines = [
        "# Device, link and optimizer presets",
        "",
        "The constants behind `--device-type`, `--interconnect` and `--optimizer` "
        "(`planner/presets.py`), each with its source. Bandwidths are per direction.",
        "",
        "## Devices",
        "",
        "| preset | memory | peak FLOP/s by dtype | memory bandwidth | per node | links (intra / inter) "
        "| NICs | SMs | source |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, d in DEVICES.items():
        peaks = ", ".join(f"{k} {v / 1e12:g} T" for k, v in d.peak_flops.items())
        lines.append(
            f"| `{name}` | {d.memory_bytes / 2**30:g} GiB | {peaks} | {d.memory_bandwidth_bytes_per_s / 1e9:g} GB/s "
            f"| {d.devices_per_node} | `{d.intra_node}` / `{d.inter_node}` | {d.nics_per_node} | {d.sm_count} "
            f"| {_cell(d.source)} |"
        )
    lines += [
        "",
        "## Interconnects",
        "",
        "| preset | bandwidth | latency | source |",
        "| --- | --- | --- | --- |",
    ]
    for name, link in INTERCONNECTS.items():
        lines.append(
            f"| `{name}` | {link.bandwidth_bytes_per_s / 1e9:g} GB/s | {link.latency_s * 1e6:g} µs | {_cell(link.source)} |"
        )
    lines += [
        "",
        "## Optimizers",
        "",
        "Optimizer state bytes per parameter byte (parameters in the profile's dtype; the mixed-precision "
        "variants keep an fp32 master copy: Adam's 12 bytes per parameter of Rajbhandari et al. 2020 is "
        "6.0 per bf16 parameter byte).",
        "",
        "| preset | state bytes per parameter byte |",
        "| --- | --- |",
        *(f"| `{name}` | {value:g} |" for name, value in OPTIMIZERS.items()),
        "",
        "*Generated from `planner/presets.py` by `docs/gen_reference.py`.*",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- design: modules


def modules_page() -> str:
    lines = [
        "# Module map of the solver and the cost model",
        "",
        "Each module's own docstring, read from the source at build time (so this page follows the "
        "code). The solver's one entry point is `planner/solver.py` (`solve`); the method is in the "
        "docstring of `planner/search/driver.py`. See also the table of responsibilities in "
        "[Development](development.md).",
        "",
    ]
    for package in MODULE_PACKAGES:
        lines += [f"## `{package}/`", ""]
        for path in sorted((ROOT / package).glob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "(no docstring)"
            lines += [f"### `{package}/{path.name}`", ""]
            lines += ["```text", doc, "```", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- driver


def generate(write: Write) -> None:
    """Write every generated page through ``write(path_under_docs, text)``."""
    cli_pages(write)
    schema_pages(write)
    write("reference/http-api.md", http_page(openapi_document()))
    write("reference/presets.md", presets_page())
    write("design/modules.md", modules_page())


def _write_with_gen_files(path: str, text: str) -> None:
    import mkdocs_gen_files

    with mkdocs_gen_files.open(path, "w") as f:
        f.write(text)


if __name__ == "<run_path>":  # run by mkdocs-gen-files
    generate(_write_with_gen_files)
elif __name__ == "__main__":  # python docs/gen_reference.py OUTDIR
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs-generated")

    def _write(path: str, text: str) -> None:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text, encoding="utf-8")

    generate(_write)
