"""The summary table (torch-free) and the GPU check's no-CUDA path."""

from __future__ import annotations

import pytest
import torch

from planner.schema import LayerProfile, MeasuredOn, Profile
from profiler.summary import print_summary


def _profile(n: int, *, peak: bool) -> Profile:
    layers = [
        LayerProfile(
            name=f"l{i}",
            param_bytes=1024 * (i + 1),
            forward_ms=[1.0 + i],
            backward_ms=[2.0],
            activation_bytes=[3 << 20],
            output_bytes=[4096],
            peak_memory_bytes=[5 << 20] if peak else None,
        )
        for i in range(n)
    ]
    return Profile(model="m", measured_on=MeasuredOn(device="cuda" if peak else "cpu"), microbatch_sizes=[4], layers=layers)


def test_summary_shows_cuda_peaks_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    print_summary(_profile(3, peak=True))
    err = capsys.readouterr().err
    assert "CUDA peak" in err and "5.00 MiB" in err
    assert "9.00 MiB" in err  # total activations
    assert "6.000" in err  # total forward ms: 1 + 2 + 3


def test_summary_abridges_long_models(capsys: pytest.CaptureFixture[str]) -> None:
    print_summary(_profile(50, peak=False), max_rows=10)
    err = capsys.readouterr().err
    assert "... 40 more" in err and "l0" in err and "l49" in err and "l20 " not in err
    assert "CUDA peak" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_check_without_cuda_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from profiler.gpu_check import main

    assert main() == 0
    assert "no CUDA" in capsys.readouterr().out
