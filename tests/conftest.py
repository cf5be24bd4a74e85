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


# --------------------------------------------------------------------------- the nightly tests
# The slowest end-to-end combinations whose axes a faster test runs by default: marked `nightly`
# here (besides the runtime matrix's own), so the default test command stays within CI's budget.
# `bash scripts/test.sh -m nightly` runs them alone (docs/design/development.md).  Each with the
# test that covers it by default.
_R = "tests/runtime/"
NIGHTLY = {
    _R + "test_check_optimizers.py::test_gpt2_passes_the_check_with_the_default_adam":
        "GPT-2 with Adam: test_mesh_hf_blocks (T = 2) and the matrix (Adam, every axis)",
    _R + "test_check_optimizers.py::test_a_dropped_gradient_fails_the_check[sgd]": "the [adam] case",
    _R + "test_check_optimizers.py::test_a_dropped_gradient_fails_the_check[adamw]": "the [adam] case",
    _R + "test_zoo_run.py::test_gpt2_through_the_command_line": "test_mesh_hf_blocks[examples.hf:gpt2]",
    _R + "test_mesh_hf_blocks.py::test_gpt2_at_t2_saves_a_checkpoint_and_resumes_as_if_uninterrupted":
        "test_strided_checkpoint.py (the c_attn placements, ZeRO 3 x T = 2, saved and loaded) with "
        "test_mesh_hf_blocks.py::test_hf_blocks_at_t2_are_priced_sharded_and_check_passes_with_adam[examples.hf:gpt2] "
        "and test_resume_check.py (Adam's check after --resume under another plan)",
    _R + "test_mesh.py::test_zero3_then_tensor_parallel_resumed_from_its_checkpoint":
        "test_mesh_run.py::test_checkpoint_resumes_under_another_plan",
    _R + "test_mesh_sp_zero.py::test_hf_layers_run_tensor_parallel_and_match_the_unsplit_model[llama-tp]": "[llama-tp-sp]",
    _R + "test_mesh_sp_zero.py::test_hf_layers_run_tensor_parallel_and_match_the_unsplit_model[bert-tp]": "[bert-tp-sp]",
    _R + "test_mesh_sp_zero.py::test_sequence_parallel_and_zero_with_tp_match_the_unsplit_model[D2-T2-zero1]":
        "[D2-T2-zero2-SP] and the matrix's D2-T2sp-K1-z2",
    _R + "test_mesh_sp_zero.py::test_sequence_parallel_and_zero_with_tp_match_the_unsplit_model[D2-T2-zero3]":
        "[D2-T2-zero2-SP] and the matrix's D2-T2sp-K1-z2",
    **{
        _R + f"test_mesh_hf_sp.py::test_hf_blocks_with_sequence_parallelism_pass_the_check_with_adam[{case}]":
            "[T2-SP] (GPT-2's blocks sequence-parallel), with test_mesh_sp_zero's [D2-T2-zero2-SP] and "
            "[T2-SP-K2-zbh1] (the axes on the zoo GPT)"
        for case in ("D2-T2-SP", "K2-T2-SP")
    },
    **{
        _R + f"test_mesh_hf_sp.py::test_hf_blocks_with_sequence_parallelism_pass_the_check_with_adam[{case}]":
            "test_mesh_hf_sp.py::test_t5_blocks_run_on_sequence_shards_and_match_them_whole (T5's blocks against "
            "themselves whole), test_only_the_hidden_states_are_split_on_entry and [T2-SP]"
        for case in ("t5-T2-SP", "t5-K2-T2-SP")
    },
    **{
        _R + f"test_run_schedules.py::test_schedule_runs_and_matches_the_unsplit_model[{case}]": "the matrix's default run"
        for case in ("gpt-gpipe-K2", "gpt-1f1b-K2", "gpt-interleaved-1f1b-K2", "gpt-zb-h1-K2", "gpt-zbv-K2",
                     "seq_model-zb-h1-K4")
    },
    **{
        _R + f"test_run_schedules.py::test_schedule_runs_and_matches_the_unsplit_model[{case}]":
            "the zoo GPT's case, or the matrix's (gpipe)"
        for case in ("seq_model-gpipe-K2", "seq_model-interleaved-zb-K2", "seq_model-dualpipev-K2")
    },
    "tests/profiler/test_repeat.py::test_tracing_one_block_of_each_kind_gives_the_whole_trace[gemma2-9b]": "[deepseek-v3]",
    **{
        _R + f"test_strided_full_tensor.py::test_gpt2_with_zero_and_tensor_parallelism_passes_the_check_with_adam[{case}]":
            "test_strided_full_tensor.py::test_check_gathers_fsdp_sharded_head_split_parameters_whole (the gather "
            "of GPT-2's c_attn.bias under FSDP2 + T) and test_mesh_sp_zero's [D2-T2-zero2-SP] (the axes on the zoo GPT)"
        for case in ("zero2", "zero3-SP")  # 80-100 s each
    },
}


@pytest.hookimpl(tryfirst=True)  # before the `-m 'not nightly'` of pyproject's addopts deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in NIGHTLY:
            item.add_marker(pytest.mark.nightly)
