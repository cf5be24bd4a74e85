"""``pipeplan profile --fake``: profiles from fake tensors (profiler/fake.py).

The fake profile of a model small enough to measure has the real CPU profile's layers,
parameter, activation, output and cut bytes, kept inputs and operation census, exactly; its
times are the device model's price of that census; a forward that needs tensor values fails
with the module and the line, and nothing is written.
"""

from __future__ import annotations

import importlib.util
import math
import os
import textwrap
import warnings

import pytest
import torch

from planner.cost.compute import default_constants, layer_times
from planner.errors import InputError
from profiler import _torch_fake
from profiler.fake import fake_profile
from profiler.loading import load_entrypoint
from profiler.measure import profile

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
SIZES = [1, 2]
BYTE_FIELDS = ("param_bytes", "activation_bytes", "output_bytes", "cut_bytes", "kept_inputs", "operations")


def _real(spec: str, dtype: str = "float32") -> object:
    entry = load_entrypoint(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return profile(
            entry.model, entry.example_inputs, microbatch_sizes=SIZES, dtype=dtype, loss_fn=entry.output_loss(),
            keywords=entry.keywords, warmup=0, repeats=1, progress=False,
        )  # fmt: skip


def _fake(spec: str, dtype: str = "float32", device_type: str = "h100-80g") -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fake_profile(lambda: load_entrypoint(spec), device_type=device_type, microbatch_sizes=SIZES, dtype=dtype)


ZOO = [
    "examples.gpt:tiny",
    "examples.resnet:tiny",
    pytest.param("examples.hf:llama", marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")),
    pytest.param("examples.hf:bert", marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")),
]


@pytest.mark.parametrize("spec", ZOO)
def test_fake_profile_equals_the_real_cpu_profile_in_every_byte_and_the_census(spec: str) -> None:
    real, fake = _real(spec), _fake(spec)
    assert [x.name for x in fake.layers] == [x.name for x in real.layers]
    assert fake.input_bytes == real.input_bytes
    assert fake.split_points == real.split_points
    for f, r in zip(fake.layers, real.layers, strict=True):
        for field in BYTE_FIELDS:
            assert getattr(f, field) == getattr(r, field), (f.name, field)
        assert f.tensor_parallel == r.tensor_parallel and f.tp_replicated_activation_bytes == r.tp_replicated_activation_bytes
    assert sum(x.param_bytes for x in fake.layers) == sum(p.numel() * 4 for p in load_entrypoint(spec).model.parameters())


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_fake_profile_in_bfloat16_equals_the_real_one() -> None:
    real, fake = _real("examples.hf:llama", "bfloat16"), _fake("examples.hf:llama", "bfloat16")
    assert fake.measured_on.dtype == real.measured_on.dtype == "bfloat16"
    for f, r in zip(fake.layers, real.layers, strict=True):
        for field in BYTE_FIELDS:
            assert getattr(f, field) == getattr(r, field), (f.name, field)


def test_times_are_the_device_model_price_of_the_census() -> None:
    prof = _fake("examples.gpt:tiny", device_type="a100-80g")
    assert prof.measured_on.device == "fake:a100-80g"
    c = default_constants("a100-80g")
    assert prof.measured_on.pricing is not None
    assert "device model a100-80g" in prof.measured_on.pricing
    assert f"gemm efficiency {c.gemm_efficiency:.2f}" in prof.measured_on.pricing
    assert f"memory efficiency {c.memory_efficiency:.2f}" in prof.measured_on.pricing
    for i, layer in enumerate(prof.layers):
        assert layer.operations is not None
        for k, ops in enumerate(layer.operations):
            t = layer_times(ops, device_type="a100-80g", constants=None)
            assert layer.forward_ms[k] == pytest.approx(t.forward) and t.forward > 0
            assert layer.backward_ms[k] == pytest.approx(t.backward)
            if i == 0:  # the token ids need no gradient: the whole backward is W, as measured
                assert layer.backward_input_ms[k] == 0 and layer.backward_weight_ms[k] == pytest.approx(t.backward)
            else:
                assert layer.backward_input_ms[k] == pytest.approx(t.backward_input)
                assert layer.backward_weight_ms[k] == pytest.approx(t.backward_weight)
    assert prof.layers[2].forward_ms[1] > prof.layers[2].forward_ms[0]  # a block costs more at a larger micro-batch


def test_unknown_device_type_is_refused_with_the_presets() -> None:
    with pytest.raises(InputError, match=r"unknown device type 'h100'.*h100-80g"):
        fake_profile(lambda: load_entrypoint("examples.gpt:tiny"), device_type="h100")


_DATA_DEPENDENT = '''
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 0:
            return self.lin(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), Gate(), nn.Linear(8, 8)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build():
    return Net(), torch.randn(4, 8)
'''


def test_a_forward_that_reads_values_names_the_module_and_line_and_writes_nothing(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeplan.cli import main

    path = os.path.join(str(tmp_path), "gated.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(_DATA_DEPENDENT))
    out = os.path.join(str(tmp_path), "p.json")
    rc = main(["profile", "--fake", "--device-type", "h100-80g", "--model", f"{path}:build", "-q", "-o", out])
    text = capsys.readouterr().err
    assert rc != 0
    assert "module 'blocks.1' (Gate)" in text
    assert "gated.py:12" in text and "x.sum().item()" in text
    assert "drop --fake" in text and "--split-points" in text
    assert "Traceback" not in text
    assert sorted(os.listdir(str(tmp_path))) == ["gated.py"]  # no profile, no temporary file


def test_fake_profile_allocates_no_parameter_memory() -> None:
    """A 4 GiB model (1024 x 1M parameters, float32) built and profiled under fake tensors."""
    rss_before = _rss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = fake_profile(_big, device_type="h100-80g", microbatch_sizes=[1], dtype="float32")
    assert sum(x.param_bytes for x in prof.layers) == 4 * (4 * 16384 * 16384 + 4 * 16384)
    assert _rss() - rss_before < 512 * 2**20


def _big() -> object:
    from profiler.loading import check_entrypoint_result

    model = torch.nn.Sequential(*(torch.nn.Linear(16384, 16384) for _ in range(4)))
    return check_entrypoint_result((model, torch.randn(2, 16384)), spec="big")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------- private torch APIs


def test_torch_fake_private_apis() -> None:
    """profiler/_torch_fake.py: what a torch upgrade may move."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401  (named in the error)

    with _torch_fake.fake_mode():
        a = torch.randn(4, 4)
        b = torch.randn(4, 4)
        p = torch.nn.Parameter(torch.randn(2))
        assert _torch_fake.is_fake(a) and _torch_fake.is_fake(p)
        assert _torch_fake.storage_key(a) == _torch_fake.storage_key(a[1:]) == _torch_fake.storage_key(a.t())
        assert _torch_fake.storage_key(a) != _torch_fake.storage_key(b)
        errors = _torch_fake.data_dependent_errors()
        with pytest.raises(errors):
            a.sum().item()
        with pytest.raises(errors):
            torch.nonzero(a)
    real = torch.zeros(3)
    assert not _torch_fake.is_fake(real)
    assert _torch_fake.storage_key(real) == real.untyped_storage().data_ptr() == _torch_fake.storage_key(real[1:])


# --------------------------------------------------------------------------- MemTracker cross-check


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_stage_activation_bytes_match_torch_mem_tracker_under_fake_tensors() -> None:
    """torch's MemTracker, run under FakeTensorMode on a tiny Llama cut into stages, sees the
    activation bytes the fake profile predicts for each stage (within 3 %)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from profiler.measure import reference_pass, resize_batch, state_storages
    from profiler.split import split_model

    prof = _fake("examples.hf:llama")
    stages = [(0, 3), (3, 5), (5, len(prof.layers))]
    b = 1
    with _torch_fake.fake_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entry = load_entrypoint("examples.hf:llama")
        entry.model.train()
        split = split_model(entry.model, entry.example_inputs, keywords=entry.keywords)
        batch = resize_batch(entry.example_inputs, b)
        loss = entry.output_loss()
        ref = reference_pass(split, batch, loss, exclude=state_storages(split), backward=False)
        cuts = [tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in ins)
                for ins in ref.inputs]  # fmt: skip
        del ref
        for a, z in stages:
            stage = split.stage_module(a, z, pipeline=True)
            tracker = MemTracker()
            tracker.track_external(stage)
            with tracker:
                # a stage receives fresh inputs (allocated in the tracker: they count when kept)
                ins = tuple(t.clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and a > 0 else t
                            for t in cuts[a])  # fmt: skip
                out = stage(*ins)
                if z == len(split):
                    out = loss(split.rebuild_output(out))
                outs = out if isinstance(out, tuple) else (out,)
                graph = [t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]  # keeps what backward needs
                del ins, out, outs
                snapshot = tracker.get_tracker_snapshot("current")
            tracked = sum(v for d in snapshot.values() for k, v in d.items() if getattr(k, "name", "") == "ACT")
            kept = prof.layers[a].kept_inputs or []
            predicted = sum(x.activation_bytes[0] for x in prof.layers[a:z]) + sum(
                k.bytes[0] for k in kept if k.offset < z - a
            )
            assert graph
            assert tracked == pytest.approx(predicted, rel=0.03), (a, z)


def test_cli_fake_profile_of_a_builder(tmp_path: object) -> None:
    from pipeplan.cli import main
    from planner.schema import Profile

    out = os.path.join(str(tmp_path), "gpt.json")
    rc = main(["profile", "--fake", "--device-type", "h100-80g", "--model", "examples.gpt:tiny",
               "--microbatch-sizes", "1,2", "-q", "-o", out])  # fmt: skip
    assert rc == 0
    with open(out) as f:
        prof = Profile.model_validate_json(f.read())
    assert prof.model == "examples.gpt:tiny" and prof.measured_on.device == "fake:h100-80g"
    assert prof.measured_on.dtype == "bfloat16"  # --fake's default: a GPU training dtype
    api = _fake("examples.gpt:tiny", dtype="bfloat16")
    assert [x.activation_bytes for x in prof.layers] == [x.activation_bytes for x in api.layers]
    assert main(["profile", "--model", "examples.gpt:tiny", "--device-type", "h100-80g", "-q"]) != 0  # needs --fake
    assert main(["profile", "--fake", "--model", "examples.gpt:tiny", "-q"]) != 0  # needs --device-type


def test_fake_and_measured_profiles_of_one_model_plan_the_same_split() -> None:
    """The planner gets the same answer from either profile where bytes decide: two devices whose
    memory fits exactly one cut of the zoo GPT (fixed schedule, M, no recompute, no T or ZeRO)."""
    from planner.cost import Layout, estimate
    from planner.schema import Cluster, PlanOptions, TrainingSetup
    from planner.solver import solve

    real, fake = _real("examples.gpt:small"), _fake("examples.gpt:small", device_type="cpu")
    training = TrainingSetup(global_batch_size=2, optimizer="adam")
    options = PlanOptions(schedule="1f1b", num_microbatches=2, recompute=False, data_parallel=1, tensor_parallel=1,
                          zero_stage=0, time_limit_s=5.0)

    def cluster(memory: int) -> Cluster:
        return Cluster.model_validate({"devices": [{"memory_bytes": memory}] * 2, "intra_node": "pcie4"})

    n = real.num_layers
    peaks = {}
    for cut in range(1, n):
        plan = estimate(real, cluster(2**40), training, Layout([(0, cut), (cut, n)], num_microbatches=2,
                                                               schedule="1f1b", pipeline_degree=2))
        peaks[cut] = max(s.memory_bytes for s in plan.stages)
    best = min(peaks, key=peaks.__getitem__)
    others = sorted(v for c, v in peaks.items() if c != best)
    memory = math.ceil(peaks[best] / 0.9) + 1  # usable (10 % margin) fits the best cut only
    assert others[0] > peaks[best] * 1.001 and 0.9 * memory < others[0]
    plans = [solve(p, cluster(memory), training, options) for p in (real, fake)]
    assert [[(s.start, s.stop) for s in p.stages] for p in plans] == [[(0, best), (best, n)]] * 2
    assert [max(s.memory_bytes for s in p.stages) for p in plans] == [peaks[best]] * 2
