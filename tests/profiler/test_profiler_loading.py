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
        ("import torch\ndef f():\n    return torch.nn.Linear(2, 2), {'x': torch.ones(1, 2)}\n", "'x' is not a parameter of Linear.forward"),
        ("import torch\ndef f():\n    return torch.nn.Linear(2, 2), {'input': [torch.ones(1, 2)]}\n", "example_inputs['input']"),
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


# ---- the data function (FUNC's optional 4th element)

_DATA_MODEL = """
import torch
def model_and_inputs():
    return torch.nn.Linear(3, 2), torch.zeros(4, 3)
"""


def test_data_function_is_loaded_and_checked() -> None:
    entry = load_entrypoint("examples.gpt:tiny_with_data")
    assert entry.data_fn is not None
    (ids,) = entry.batch(2, 5)
    assert ids.shape == (5, entry.example_inputs[0].shape[1]) and ids.dtype == torch.long
    # deterministic in (step, batch_size), and steps differ
    assert torch.equal(entry.batch(2, 5)[0], ids)
    assert not torch.equal(entry.batch(3, 5)[0], ids)


def test_old_forms_have_no_data_function(tmp_path: Path) -> None:
    assert load_entrypoint("examples.gpt:tiny").data_fn is None
    with pytest.raises(InputError, match="no data function"):
        load_entrypoint("examples.gpt:tiny").batch(0, 2)


def test_data_function_with_no_loss(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        _DATA_MODEL
        + """
def f():
    m, x = model_and_inputs()
    return m, x, None, lambda step, n: torch.full((n, 3), float(step))
""",
        name="data_no_loss.py",
    )
    entry = load_entrypoint(f"{path}:f")
    assert entry.loss_fn is None and entry.data_fn is not None
    (x,) = entry.batch(7, 2)
    assert torch.equal(x, torch.full((2, 3), 7.0))


@pytest.mark.parametrize(
    ("data_fn", "needles"),
    [
        ("'tokens.bin'", ["fourth element", "data_fn(step, batch_size)", "'tokens.bin'"]),
        ("None", ["fourth element", "return only (model, example_inputs, loss_fn)"]),
        ("lambda: torch.zeros(4, 3)", ["raised TypeError", "must take (step, batch_size)"]),
        ("lambda s, n: [[0.0] * 3] * n", ["returned a list", "shape (4, 3) float32"]),
        ("lambda s, n: {'x': torch.zeros(n, 3)}", ["returned a dict", "shape (4, 3) float32"]),
        ("lambda s, n: torch.zeros(n, 5)", ["input 0 as shape (4, 5) float32", "expected shape (4, 3) float32"]),
        ("lambda s, n: torch.zeros(n + 1, 3)", ["input 0 as shape (5, 3) float32", "expected shape (4, 3)"]),
        ("lambda s, n: torch.zeros(n, 3, dtype=torch.float64)", ["float64", "expected shape (4, 3) float32"]),
        ("lambda s, n: (torch.zeros(n, 3), torch.zeros(n))", ["returned 2 tensor(s)", "takes 1 input(s)", "no labels"]),
        ("lambda s, n: 1 / 0", ["ZeroDivisionError", "step=0, batch_size=4"]),
    ],
)
def test_bad_data_functions_say_what_was_expected_and_got(tmp_path: Path, data_fn: str, needles: list[str]) -> None:
    body = _DATA_MODEL + f"\ndef f():\n    m, x = model_and_inputs()\n    return m, x, None, {data_fn}\n"
    path = _write(tmp_path, body, name=f"d{abs(hash(body)) % 10**8}.py")
    with pytest.raises(InputError) as err:
        load_entrypoint(f"{path}:f")
    for needle in needles:
        assert needle in str(err.value)


def test_data_function_that_breaks_later_is_caught_at_that_step(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        _DATA_MODEL
        + """
def f():
    m, x = model_and_inputs()
    return m, x, None, lambda step, n: torch.zeros(n, 3 if step < 3 else 4)
""",
        name="data_breaks_later.py",
    )
    entry = load_entrypoint(f"{path}:f")
    assert entry.batch(2, 8)[0].shape == (8, 3)
    with pytest.raises(InputError, match=r"step=3, batch_size=8.*shape \(8, 4\)"):
        entry.batch(3, 8)


def test_five_elements_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, _DATA_MODEL + "\ndef f():\n    m, x = model_and_inputs()\n    return m, x, None, None, 1\n", name="five.py")
    with pytest.raises(InputError, match="returned a 5-element tuple.*loss_fn, data\\)"):
        load_entrypoint(f"{path}:f")
