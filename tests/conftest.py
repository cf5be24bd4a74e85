"""Shared fixtures: small profiles and clusters built in code."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from planner.schema import Profile, load_document

ROOT = Path(__file__).resolve().parent.parent

# Property tests draw the same examples on every run, so that a red CI run is the code's doing
# and reproduces anywhere.  HYPOTHESIS_PROFILE=explore draws fresh random examples instead (and
# prints the blob that replays a failure): run it when you change the planner.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture()
def tiny_profile() -> Profile:
    profile: Profile = load_document("profile", str(ROOT / "examples" / "profiles" / "tiny.json"))
    return profile


@pytest.fixture()
def tiny_profile_dict() -> dict:
    return json.loads((ROOT / "examples" / "profiles" / "tiny.json").read_text())


# --------------------------------------------------------------------------- missing packages
# The README's test command installs every package the suite needs.  A test skipped because an
# import failed would hide a package missing from that install step, so such a skip fails the
# run (set PIPEPLAN_ALLOW_IMPORT_SKIPS=1 to allow it, e.g. on a machine without transformers).


class _ImportSkips:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def _note(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and "could not import" in str(report.longrepr):
            self.reasons.append(f"{report.nodeid}: {report.longrepr}")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.reasons and os.environ.get("PIPEPLAN_ALLOW_IMPORT_SKIPS") != "1":
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.reasons and os.environ.get("PIPEPLAN_ALLOW_IMPORT_SKIPS") != "1":
            terminalreporter.write_line(
                f"error: {len(self.reasons)} test(s) skipped because a package is missing; the "
                "test command must install every package the suite needs (add it to the 'test' "
                "extra in pyproject.toml and pin it in constraints/test.txt):",
                red=True,
            )
            for reason in self.reasons[:20]:
                terminalreporter.write_line(f"  {reason}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_ImportSkips(), "pipeplan-import-skips")
