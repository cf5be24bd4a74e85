"""synth reads the shipped Hugging Face configs (examples/configs) without torch: the parameter
counts their publishers give, and the architectures synth does not write refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.errors import InputError
from profiler.decoder import total_param_count
from profiler.hf_spec import read_config, spec_from_config

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("llama3-8b", 8.03e9),  # Meta-Llama-3-8B model card: 8.03B
        ("llama3-70b", 70.6e9),  # Meta-Llama-3-70B: 70.6B
        ("llama3.1-405b", 405.9e9),  # Llama 3.1 405B: 405.85B in transformers' count
        ("mixtral-8x7b", 46.7e9),  # Mixtral of Experts (Jiang et al. 2024): 46.7B
        ("qwen3-30b-a3b", 30.5e9),  # Qwen3-30B-A3B model card: 30.5B
    ],
)
def test_shipped_configs_give_the_published_parameter_counts(name: str, published: float) -> None:
    spec = spec_from_config(read_config(CONFIGS / name), seq=4096)
    assert total_param_count(spec) == pytest.approx(published, rel=0.005)


@pytest.mark.parametrize("name", ["deepseek-v3", "gemma2-9b"])
def test_architectures_synth_does_not_write_are_refused(name: str) -> None:
    with pytest.raises(InputError, match="pipeplan profile --fake --hf-config"):
        spec_from_config(read_config(CONFIGS / name), seq=4096)
