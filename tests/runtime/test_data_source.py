"""FUNC's data with targets: the forms it may take, how a rank reads it, and its errors.

No process is launched here: the data sources are read in this process as a rank would
(``runtime.data.DataSource.open(replica, replicas).next(step)``), and the ranks' agreement
check is tested on hand-made reports.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.charlm import CharWindows, next_char_loss
from planner.errors import InputError
from profiler.loading import Loader, check_entrypoint_result, load_entrypoint, loss_takes_target
from runtime.data import DataReport, DataSource, judge, loads_data

X = torch.arange(24 * 3, dtype=torch.float32).reshape(24, 3)
Y = torch.arange(24) % 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _entry(data: object, loss: object = F.cross_entropy):  # type: ignore[no-untyped-def]
    return check_entrypoint_result((_model(), X[:4], loss, data), spec="t.py:f")


def _source(entry, g: int = 8, steps: int = 3) -> DataSource:  # type: ignore[no-untyped-def]
    return DataSource.of(entry, global_batch_size=g, steps=steps)


# ---- the loss says whether batches carry targets


@pytest.mark.parametrize(
    ("loss", "takes"),
    [
        (lambda out: out.mean(), False),
        (lambda out, target: (out - target).mean(), True),
        (lambda out, target=None: out.mean(), False),
        (F.cross_entropy, True),
        (torch.nn.CrossEntropyLoss(), True),
        (next_char_loss, True),
    ],
)
def test_a_loss_with_two_required_parameters_takes_targets(loss: object, takes: bool) -> None:
    assert loss_takes_target(loss) is takes  # type: ignore[arg-type]


def test_a_loss_with_three_required_parameters_is_refused() -> None:
    with pytest.raises(InputError, match=r"3 required parameters \(a, b, c\)"):
        loss_takes_target(lambda a, b, c: a)


def test_a_loss_that_takes_targets_needs_data() -> None:
    with pytest.raises(InputError, match="takes \\(output, target\\) but FUNC returns no data"):
        check_entrypoint_result((_model(), X[:4], F.cross_entropy), spec="t.py:f")


# ---- the forms of the data


def test_a_data_loader_of_global_batches_gives_each_replica_its_rows() -> None:
    entry = _entry(DataLoader(TensorDataset(X, Y), batch_size=8))
    source = _source(entry)
    assert source.kind == "iterable" and entry.takes_target
    whole, fp_whole = source.open(0, 1).next(0)
    assert torch.equal(whole.inputs[0], X[:8]) and torch.equal(whole.targets, Y[:8])  # type: ignore[arg-type]
    shard, fp = source.open(1, 2).next(0)
    assert torch.equal(shard.inputs[0], X[4:8]) and torch.equal(shard.targets, Y[4:8])  # type: ignore[arg-type]
    assert fp == fp_whole  # the fingerprint is of the global batch, the same on every replica
    reader = source.open(0, 2)
    assert [reader.next(s)[0].inputs[0][0, 0].item() for s in range(3)] == [0.0, 24.0, 48.0]


def test_a_loader_is_told_the_batch_size() -> None:
    sizes: list[int] = []

    def make(batch_size: int) -> DataLoader:  # type: ignore[type-arg]
        sizes.append(batch_size)
        return DataLoader(TensorDataset(X, Y), batch_size=batch_size)

    batch, _ = _source(_entry(Loader(make)), g=6).open(0, 1).next(0)
    assert sizes == [6] and batch.inputs[0].shape == (6, 3)


def test_a_per_replica_loader_is_told_its_replica_and_rows() -> None:
    calls: list[tuple[int, int, int]] = []

    def make(batch_size: int, replica: int, replicas: int):  # type: ignore[no-untyped-def]
        calls.append((batch_size, replica, replicas))
        return ((X[replica::replicas][i : i + batch_size], Y[replica::replicas][i : i + batch_size]) for i in range(0, 12, batch_size))

    source = _source(_entry(Loader(make, per_replica=True)), g=8)
    assert source.kind == "per-replica"
    a, fa = source.open(0, 2).next(0)
    b, fb = source.open(1, 2).next(0)
    assert calls == [(4, 0, 2), (4, 1, 2)]
    assert torch.equal(a.inputs[0], X[0:8:2]) and torch.equal(b.inputs[0], X[1:8:2]) and fa != fb


def test_a_data_function_may_return_inputs_and_targets() -> None:
    entry = _entry(lambda step, n: (X[step * n : (step + 1) * n], Y[step * n : (step + 1) * n]))
    assert entry.data_fn is not None and entry.data is None
    batch, _ = _source(entry, g=4).open(0, 1).next(2)
    assert torch.equal(batch.inputs[0], X[8:12]) and torch.equal(batch.targets, Y[8:12])  # type: ignore[arg-type]


def test_old_entry_points_keep_working() -> None:
    legacy = load_entrypoint("examples.gpt:tiny_with_data")
    assert not legacy.takes_target and _source(legacy).kind == "function"
    batch, _ = _source(legacy, g=4).open(0, 1).next(1)
    assert batch.targets is None and torch.equal(batch.inputs[0], legacy.batch(1, 4)[0])
    synthetic = load_entrypoint("examples.gpt:tiny")
    assert _source(synthetic).kind == "synthetic" and synthetic.output_loss() is synthetic.loss_fn


# ---- errors, at the step they happen


def test_data_that_ends_early_is_an_error_at_that_step() -> None:
    reader = _source(_entry(iter([(X[:8], Y[:8]), (X[8:16], Y[8:16])])), steps=5).open(0, 1)
    reader.next(0)
    reader.next(1)
    with pytest.raises(InputError, match=r"ended after 2 batches, at step 2 of --steps 5"):
        reader.next(2)


def test_data_with_a_known_length_too_short_for_the_steps_is_an_error_at_the_first_step() -> None:
    reader = _source(_entry(DataLoader(TensorDataset(X, Y), batch_size=8)), steps=4).open(0, 1)
    with pytest.raises(InputError, match="has 3 batches but --steps 4 needs 4"):
        reader.next(0)


@pytest.mark.parametrize(
    ("batches", "needles"),
    [
        ([(X[:6], Y[:6])], ["input 0 as shape (6, 3)", "expected shape (8, 3)", "batch_size=8"]),
        ([(X[:8, :2], Y[:8])], ["input 0 as shape (8, 2)", "expected shape (8, 3) float32"]),
        ([X[:8]], ["expected a pair (inputs, targets)"]),
        ([(X[:8], Y[:7])], ["targets of shape (7,)", "leading dimension of 8"]),
        ([(X[:8], Y[:8]), (X[:8], Y[:8].float())], ["batch 1 (step 1)", "like the first batch's targets"]),
    ],
)
def test_a_batch_of_the_wrong_shape_says_what_was_expected(batches: list[object], needles: list[str]) -> None:
    reader = _source(_entry(batches), steps=1).open(0, 1)
    with pytest.raises(InputError) as err:
        for step in range(len(batches)):
            reader.next(step)
    for needle in needles:
        assert needle in str(err.value)


def test_an_exception_inside_the_data_is_an_input_error() -> None:
    def broken():  # type: ignore[no-untyped-def]
        yield (X[:8], Y[:8])
        raise OSError("disk gone")

    reader = _source(_entry(broken())).open(0, 1)
    reader.next(0)
    with pytest.raises(InputError, match="reading batch 1 of the data of 't.py:f' raised OSError: disk gone"):
        reader.next(1)


def test_bad_fourth_elements_are_refused() -> None:
    for bad in ("data.bin", torch.zeros(3), {"x": 1}, 3):
        with pytest.raises(InputError, match="fourth element must be"):
            _entry(bad)


# ---- which ranks read, and their agreement


def test_only_the_ranks_that_use_the_data_read_it() -> None:
    for kind in ("function", "iterable", "per-replica"):
        assert loads_data(kind, has_first=True, has_last=False, takes_target=True)  # type: ignore[arg-type]
        assert loads_data(kind, has_first=False, has_last=True, takes_target=True)  # type: ignore[arg-type]
        assert not loads_data(kind, has_first=False, has_last=True, takes_target=False)  # type: ignore[arg-type]
        assert not loads_data(kind, has_first=False, has_last=False, takes_target=True)  # type: ignore[arg-type]
    assert not loads_data("synthetic", has_first=False, has_last=True, takes_target=False)


def test_judge_names_the_rank_that_read_other_data() -> None:
    same = [DataReport(0, 0, 7), DataReport(1, 0, None), DataReport(2, 0, 7)]
    assert judge(same, step=0, per_replica=False) == (None, None)
    error, _ = judge([*same, DataReport(3, 1, 8)], step=4, per_replica=False)
    assert error is not None and "rank 3 a different global batch than rank 0 at step 4" in error
    # per replica: replicas differ (fine); within one they must agree
    ok = [DataReport(0, 0, 1), DataReport(1, 0, 1), DataReport(2, 1, 2), DataReport(3, 1, 2)]
    assert judge(ok, step=0, per_replica=True) == (None, None)
    error, _ = judge([*ok[:3], DataReport(3, 1, 5)], step=1, per_replica=True)
    assert error is not None and "rank 3 a different replica 1's rows than rank 2" in error
    _, warning = judge([DataReport(0, 0, 1), DataReport(1, 1, 1)], step=0, per_replica=True)
    assert warning is not None and "replicas 0 and 1 read the same rows" in warning


def test_judge_passes_a_rank_s_read_error_to_every_rank() -> None:
    error, _ = judge([DataReport(0, 0, None, "it ended"), DataReport(1, 0, 3), DataReport(2, 0, None, "it ended")],
                     step=2, per_replica=False)  # fmt: skip
    assert error == "it ended (on rank 0 and 1 other rank(s))"


# ---- the corpus example and profiling an entry point with targets


def test_the_corpus_example_shifts_targets_by_one_character() -> None:
    windows = CharWindows()
    x, y = windows[3]
    assert torch.equal(x[1:], y[:-1]) and len(windows) > 100
    entry = load_entrypoint("examples.charlm:gpt")
    a, _ = DataSource.of(entry, global_batch_size=16, steps=2).open(0, 1).next(1)
    b, _ = DataSource.of(load_entrypoint("examples.charlm:gpt"), global_batch_size=16, steps=2).open(0, 1).next(1)
    assert torch.equal(a.inputs[0], b.inputs[0])  # every call of FUNC reads the same batches
    sharded = load_entrypoint("examples.charlm:gpt_sharded")
    rows = [DataSource.of(sharded, global_batch_size=16, steps=1).open(r, 2).next(0)[0].inputs[0] for r in range(2)]
    assert not torch.equal(rows[0], rows[1])


def test_an_entry_point_with_targets_can_be_profiled(tmp_path: Path) -> None:
    from profiler import measure_split, split_model

    entry = load_entrypoint("examples.charlm:gpt")
    loss = entry.output_loss()
    assert loss is not None
    out = entry.call(entry.model, entry.example_inputs)
    expected = next_char_loss(out, entry.first_batch().targets)  # type: ignore[arg-type]
    assert torch.equal(loss(out), expected)
    assert loss(out[:3]).dim() == 0  # re-sliced to the output's batch size
    split = split_model(entry.model, entry.example_inputs)
    profile = measure_split(split, entry.example_inputs, microbatch_sizes=[2], loss_fn=loss, warmup=0, repeats=1)
    assert profile.num_layers == 6 and profile.sha256() == split.sha256()


def test_the_readme_entry_point_example_trains(tmp_path: Path) -> None:
    """The docs' copyable entry point (docs/how-to/run-a-plan.md, once the README's) loads, yields
    (inputs, targets) and trains."""
    from runtime.training import TrainOptions, train_reference
    from tests.conftest import ROOT

    text = (ROOT / "docs" / "how-to" / "run-a-plan.md").read_text(encoding="utf-8")
    section = text[text.index("## The entry point: model, inputs, loss, data") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))]
    (tmp_path / "job.py").write_text(code)
    entry = load_entrypoint(f"{tmp_path / 'job.py'}:job")
    assert entry.takes_target and isinstance(entry.data, Loader)
    source = DataSource.of(entry, global_batch_size=32, steps=3)
    opts = TrainOptions(optimizer="sgd", lr=0.1, steps=3, clip_grad_norm=1.0, dtype="bfloat16")
    ref = train_reference(entry.model, entry.example_inputs, entry.loss, steps=3, global_batch_size=32, microbatch_size=8,
                          replicas=2, optimizer="sgd", lr=0.1, seed=0, source=source, options=opts)  # fmt: skip
    assert len(ref.losses) == 3 and all(2.0 < x < 2.6 for x in ref.losses)  # about ln(10) for 10 classes
