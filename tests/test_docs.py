"""The docs cannot rot: the CLI's help, the generated reference and the README's console examples.

- every flag of every subcommand has help text (the reference is generated from it);
- ``docs/gen_reference.py`` writes a page for every subcommand, schema, HTTP path and preset, and
  ``mkdocs.yml``'s nav lists the generated CLI and schema pages;
- the console examples of the README (and of the pages in ``CHECKED_PAGES``) are run and their
  output compared with the block. In a block, ``$ `` starts a command; the lines after it are its
  expected output (stdout and stderr together). A line ``…`` stands for any number of lines, a
  line ending in `` …`` for any line starting with what precedes it; the solver's wall time and
  sha256 prefixes are normalised. A block that cannot run here (a GPU, several hosts, torch,
  minutes) is marked by ``<!-- not run in CI: reason -->`` on the line before it, and counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: pages whose console blocks are run (all of them, unless marked "not run in CI"): the README and
#: every tutorial and how-to with console blocks, but those in ``UNCHECKED_PAGES``
CHECKED_PAGES = (
    "README.md",
    "docs/tutorials/cpu-model.md",
    "docs/tutorials/plan-from-config.md",
    "docs/how-to/calibrate.md",
    "docs/how-to/export.md",
    "docs/how-to/infeasible.md",
    "docs/how-to/run-a-plan.md",
    "docs/how-to/see-a-plan.md",
    "docs/how-to/sweep.md",
    "docs/how-to/team-service.md",
    "docs/tutorials/service.md",
)

#: tutorials and how-tos with console blocks that are not run yet, and why
UNCHECKED_PAGES: dict[str, str] = {}

NOT_RUN = re.compile(r"^<!-- not run in CI: (.+) -->$")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


# ------------------------------------------------------------------------------- CLI help


def test_every_flag_of_every_subcommand_has_help() -> None:
    missing = []
    for name, parser in gen.all_parsers():
        for action in gen.arguments(parser):
            if action.help == argparse.SUPPRESS:
                continue  # hidden on purpose (internal flags, e.g. run's --inject-fault)
            if not (action.help or "").strip():
                flag = "/".join(action.option_strings) or action.dest
                missing.append(f"pipeplan {name} {flag}")
    assert not missing, "flags without help text: " + ", ".join(missing)


# ------------------------------------------------------------------------- generated reference


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs-generated")

    def write(path: str, text: str) -> None:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text, encoding="utf-8")

    gen.generate(write)
    return out


def test_reference_covers_every_subcommand_and_flag(generated: Path) -> None:
    commands = gen.subcommands()
    assert len(commands) >= 11
    index = (generated / "reference/cli/index.md").read_text(encoding="utf-8")
    for name in commands:
        page = generated / f"reference/cli/{name}.md"
        assert page.is_file(), f"no reference page for pipeplan {name}"
        assert f"]({name}.md)" in index, f"pipeplan {name} is not in the CLI index"
    for name, parser in gen.all_parsers():
        text = (generated / f"reference/cli/{name.split()[0]}.md").read_text(encoding="utf-8")
        assert f"`pipeplan {name}`" in text, f"no section for pipeplan {name}"
        for action in gen.arguments(parser):
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in text, f"pipeplan {name} {flag} is missing from its reference page"


def test_reference_covers_schemas_api_and_presets(generated: Path) -> None:
    from planner.presets import DEVICES, INTERCONNECTS
    from planner.schema import DOCUMENTS, json_schema

    for kind in DOCUMENTS:
        text = (generated / f"reference/schemas/{kind}.md").read_text(encoding="utf-8")
        for field in json_schema(kind).get("properties", {}):
            assert f"`{field}`" in text, f"schema {kind}: field {field} missing"
    api = (generated / "reference/http-api.md").read_text(encoding="utf-8")
    for path in gen.openapi_document()["paths"]:
        assert f"`{path}`" in api, f"HTTP path {path} missing"
    presets = (generated / "reference/presets.md").read_text(encoding="utf-8")
    for name in [*DEVICES, *INTERCONNECTS]:
        assert f"`{name}`" in presets
    modules = (generated / "design/modules.md").read_text(encoding="utf-8")
    for package in gen.MODULE_PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            assert f"`{package}/{path.name}`" in modules


def test_nav_lists_the_generated_pages() -> None:
    import yaml

    from planner.schema import DOCUMENTS

    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    yaml.safe_load(nav)  # parses
    for name in gen.subcommands():
        assert f"reference/cli/{name}.md" in nav, f"mkdocs.yml's nav lacks reference/cli/{name}.md"
    for kind in DOCUMENTS:
        assert f"reference/schemas/{kind}.md" in nav


# ----------------------------------------------------------------------------- the README


def test_readme_is_short_and_opens_with_the_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count("\n") <= 150
    first = re.search(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
    assert first is not None and first.group(1) == "bash"
    assert len(first.group(2).splitlines()) == 2  # .ci/run reads them


# ----------------------------------------------------------------------- console examples


def console_blocks(page: str) -> tuple[list[list[str]], list[str]]:
    """The ``console`` blocks of a page to run, and the reasons of those marked not to run."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    run, skipped = [], []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```console":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            before = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
            mark = NOT_RUN.match(before)
            if mark:
                skipped.append(mark.group(1))
            else:
                run.append(lines[i + 1 : j])
            i = j
        i += 1
    return run, skipped


def commands_of(block: list[str]) -> list[tuple[str, list[str]]]:
    """``[(command, expected output lines)]`` of one block (``\\`` continues a command)."""
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(block):
        line = block[i]
        assert line.startswith("$ "), f"console block line is neither a command nor its output: {line!r}"
        command = line[2:]
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + " " + block[i].strip()
        i += 1
        expected = []
        while i < len(block) and not block[i].startswith("$ "):
            expected.append(block[i])
            i += 1
        out.append((command, expected))
    return out


def normalise(line: str) -> str:
    line = re.sub(r"\b\d+\.\d+ s\b", "N s", line.rstrip())  # the solver's wall time
    return re.sub(r"(sha256 )[0-9a-f]{12}", r"\g<1>HASH", line)


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether the actual lines fit the expected ones (``…`` lines and `` …`` prefixes)."""
    memo: dict[tuple[int, int], bool] = {}

    def go(e: int, a: int) -> bool:
        if (e, a) in memo:
            return memo[e, a]
        if e == len(expected):
            ok = a == len(actual)
        elif expected[e].strip() == "…":
            ok = go(e + 1, a) or (a < len(actual) and go(e, a + 1))
        elif a == len(actual):
            ok = False
        elif expected[e].endswith(" …"):
            ok = actual[a].startswith(expected[e][:-2].rstrip()) and go(e + 1, a + 1)
        else:
            ok = expected[e] == actual[a] and go(e + 1, a + 1)
        memo[e, a] = ok
        return ok

    return go(0, 0)


def run_in_shell(command: str, cwd: Path) -> list[str]:
    shim = (
        f'pipeplan() {{ "{sys.executable}" -m pipeplan "$@"; }}; '
        f'plan() {{ "{sys.executable}" -m pipeplan plan "$@"; }}; '
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("COLUMNS", None)
    proc = subprocess.run(
        ["bash", "-c", shim + command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    return proc.stdout.splitlines()


@pytest.mark.parametrize("page", CHECKED_PAGES)
def test_console_examples_run_as_shown(page: str, tmp_path: Path) -> None:
    blocks, skipped = console_blocks(page)
    assert blocks or skipped, f"{page} has no console examples"
    print(f"{page}: {len(blocks)} console blocks run, {len(skipped)} not run in CI: {skipped}")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for block in blocks:
        for command, expected in commands_of(block):
            actual = run_in_shell(command, tmp_path)
            want = [normalise(x) for x in expected]
            got = [normalise(x) for x in actual]
            assert matches(want, got), (
                f"{page}: `{command}` printed\n" + "\n".join(actual) + "\n\nbut the page shows\n" + "\n".join(expected)
            )


def test_every_tutorial_and_how_to_with_console_blocks_is_checked() -> None:
    pages = [
        page.relative_to(ROOT).as_posix()
        for folder in ("docs/tutorials", "docs/how-to")
        for page in sorted((ROOT / folder).glob("*.md"))
        if "```console" in page.read_text(encoding="utf-8")
    ]
    assert "docs/how-to/export.md" in pages
    missing = [page for page in pages if page not in CHECKED_PAGES and page not in UNCHECKED_PAGES]
    assert not missing, f"console blocks never run: add {missing} to CHECKED_PAGES"


def test_the_readme_tour_runs_and_no_block_is_skipped_without_a_reason() -> None:
    blocks, skipped = console_blocks("README.md")
    commands = [c for block in blocks for c, _ in commands_of(block)]
    assert sum(c.startswith(("pipeplan ", "plan ")) for c in commands) >= 5  # the five-command tour
    assert all(reason.strip() for reason in skipped)


def test_matcher() -> None:
    assert matches(["a", "…", "d"], ["a", "b", "c", "d"])
    assert matches(["a …", "b"], ["a and more", "b"])
    assert not matches(["a", "b"], ["a", "c"])
    assert not matches(["a"], ["a", "b"])
    assert normalise("solver: feasible, gap 3.60%, 0.49 s (mesh") == "solver: feasible, gap 3.60%, N s (mesh"
