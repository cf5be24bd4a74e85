"""load_entrypoint: MODULE:FUNC and file.py:FUNC specs, and clear errors for bad ones."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from planner.errors import InputError
from profiler.loading import Entrypoint, check_example_inputs, default_loss, load_entrypoint


def _write(tmp_path: Path, body: str, name: str = "usermodel.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_module_spec_loads_the_example_gpt() -> None:
    entry = load_entrypoint("examples.gpt:tiny")
    assert isinstance(entry, Entrypoint)
    assert isinstance(entry.model, torch.nn.Module)
    assert isinstance(entry.example_inputs, tuple) and len(entry.example_inputs) == 1
    assert entry.example_inputs[0].dtype == torch.long
    assert entry.loss_fn is not None
    assert entry.spec == "examples.gpt:tiny"
    out = entry.model(*entry.example_inputs)
    assert entry.loss(out).dim() == 0


def test_file_spec_wraps_a_single_tensor_and_defaults_the_loss(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        import torch
        def make():
            return torch.nn.Linear(3, 2), torch.ones(4, 3)
        """,
    )
    entry = load_entrypoint(f"{path}:make")
    assert len(entry.example_inputs) == 1 and entry.example_inputs[0].shape == (4, 3)
    assert entry.loss_fn is None
    out = entry.model(*entry.example_inputs)
    assert torch.equal(entry.loss(out), out.float().mean())


def test_entrypoint_is_frozen() -> None:
    entry = load_entrypoint("examples.amoebanet:tiny")
    with pytest.raises(AttributeError):
        entry.spec = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("examples.gpt", "MODULE:FUNC"),
        ("no_such_module_xyz:tiny", "no_such_module_xyz"),
        ("examples.gpt:no_such_func", "no_such_func"),
        ("examples/does_not_exist.py:tiny", "does not exist"),
        ("examples.gpt:not-an-identifier", "MODULE:FUNC"),
    ],
)
def test_bad_specs_name_the_value_and_the_fix(spec: str, needle: str) -> None:
    with pytest.raises(InputError) as err:
        load_entrypoint(spec)
    assert needle in str(err.value)
    assert spec.split(":")[0] in str(err.value)


def test_missing_function_lists_the_functions_there() -> None:
    with pytest.raises(InputError, match="tiny"):
        load_entrypoint("examples.gpt:tinyy")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("def f():\n    raise RuntimeError('boom')\n", "boom"),
        ("def f():\n    return 3\n", "must return (model, example_inputs)"),
        ("import torch\ndef f():\n    return 'model', torch.ones(2)\n", "torch.nn.Module"),
        ("import torch\ndef f():\n    return torch.nn.Linear(2, 2), [torch.ones(1, 2), 5]\n", "example_inputs[1]"),
        ("import torch\ndef f():\n    return torch.nn.Linear(2, 2), {'x': torch.ones(1, 2)}\n", "tuple of tensors"),
        ("import torch\ndef f():\n    return torch.nn.Linear(2, 2), torch.tensor(1.0)\n", "0-d"),
        ("import torch\ndef f():\n    return torch.nn.Linear(2, 2), (torch.ones(2, 2), torch.ones(3, 2))\n", "[2, 3]"),
        ("import torch\ndef f():\n    return torch.nn.Linear(2, 2), torch.ones(2, 2), 'mean'\n", "loss"),
        ("import torch\nraise ImportError('broken file')\n", "broken file"),
    ],
)
def test_bad_functions_get_clear_errors(tmp_path: Path, body: str, needle: str) -> None:
    path = _write(tmp_path, body, name=f"m{abs(hash(body)) % 10**8}.py")
    with pytest.raises(InputError) as err:
        load_entrypoint(f"{path}:f")
    assert needle in str(err.value)


def test_non_tensor_inputs_name_the_value() -> None:
    with pytest.raises(InputError, match=r"example_inputs\[0\] is a str \('tokens'\)"):
        check_example_inputs(("tokens",))


def test_default_loss_walks_containers_and_refuses_integers() -> None:
    a, b = torch.arange(4.0), torch.ones(2, 2)
    assert default_loss({"a": a, "rest": (b, torch.arange(3))}).item() == pytest.approx(1.5 + 1.0)
    with pytest.raises(InputError, match="third element"):
        default_loss(torch.arange(3))


def test_file_spec_can_import_its_siblings(tmp_path: Path) -> None:
    _write(tmp_path, "import torch\nWIDTH = 5\n", name="sibling_cfg_xyz.py")
    path = _write(
        tmp_path,
        """
        import torch
        from sibling_cfg_xyz import WIDTH
        def make():
            return torch.nn.Linear(WIDTH, 2), torch.ones(2, WIDTH)
        """,
        name="uses_sibling.py",
    )
    entry = load_entrypoint(f"{path}:make")
    assert entry.example_inputs[0].shape == (2, 5)
    import sys

    assert str(tmp_path) not in sys.path
