"""``pipeplan run`` argument handling that needs no processes."""

from __future__ import annotations

import sys
import types

import pytest

from pipeplan import cmd_run
from pipeplan.cli import build_parser, main
from tests.runtime.helpers import make_plan
from tests.runtime.test_plan_check import NAMES, PARAMS, _profile


def test_run_is_registered_with_its_flags() -> None:
    args = build_parser().parse_args(["run", "--plan", "p.json", "--model", "m:f", "--check", "--steps", "3"])
    assert args.func is cmd_run.run and args.check and args.steps == 3 and args.nnodes == 1
    assert args.timeout > 0 and args.optimizer is None


def test_plan_url_is_fetched_with_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan(_profile(NAMES, PARAMS), [(0, 2), (2, 5)])
    calls = []

    def fetch_plan(url: str, *, token: str | None = None):  # type: ignore[no-untyped-def]
        calls.append((url, token))
        return plan

    monkeypatch.setitem(sys.modules, "api.client", types.SimpleNamespace(fetch_plan=fetch_plan))
    monkeypatch.setenv("PIPEPLAN_API_TOKEN", "secret")
    got = cmd_run._load_plan("http://127.0.0.1:8000/v1/plans/abc")
    assert got is plan and calls == [("http://127.0.0.1:8000/v1/plans/abc", "secret")]


def test_bad_flags_are_clear_errors(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["run", "--plan", str(tmp_path / "missing.json"), "--model", "m:f"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "--plan", "p.json", "--model", "m:f", "--steps", "0"]) == 1
    assert "--steps 0: give at least 1" in capsys.readouterr().err
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(make_plan(_profile(NAMES, PARAMS), [(0, 2), (2, 5)], optimizer="adam").model_dump_json())
    assert main(["run", "--plan", str(plan_file), "--model", "m:f", "--optimizer", "adam-mixed"]) == 1
    assert "mixed precision" in capsys.readouterr().err


def test_model_file_paths_become_absolute(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "net.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert cmd_run._model_spec("net.py:build") == f"{tmp_path}/net.py:build"
    assert cmd_run._model_spec("examples.gpt:tiny") == "examples.gpt:tiny"
