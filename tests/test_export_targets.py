"""`pipeplan export` checked by the targets themselves: Megatron-core's layout parser and
TransformerConfig, torchtitan's config classes and command-line parser, DeepSpeed's
PipelineModule and pipeline engine (2 CPU ranks), and torch.distributed.pipelining's pipeline().

megatron-core, deepspeed and torch come with the test install.  torchtitan's dependencies
conflict with constraints/test.txt (its datasets pin wants huggingface_hub < 2), so its test runs
only where it is installed apart (`pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro`);
the golden files in tests/golden/export pin its fragment everywhere else.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from planner.export import export_plan, problems
from planner.export import megatron as mg
from planner.export.mapping import decoder_stack
from planner.schema import Plan, Schedule
from profiler.synth import synth_transformer
from tests.planner.test_export import (
    GPT_TINY,
    TINY,
    _plan,
    _profile,
    _random_split,
    _units,
    decoders_checkpointed,
    read_megatron,
)

ROOT = Path(__file__).resolve().parent.parent


def _plans() -> list[Plan]:
    """Zoo and synth plans: even and uneven splits, interleaved, recompute, data parallel."""
    rng = random.Random(7)
    out = [
        _plan(_profile(TINY), [(0, 4), (4, 6), (6, 8)], m=6, recompute=True, batch=12),
        _plan(_profile(TINY), [(0, 3), (3, 5), (5, 8)], m=6, batch=12),  # Megatron's even split
        _plan(_profile(GPT_TINY), [(0, 2), (2, 3), (3, 5), (5, 6)], k=2, m=4, schedule="interleaved-1f1b", batch=8),
    ]
    for blocks in (12, 30, 48):
        profile = synth_transformer(layers=blocks, hidden=256, heads=4, seq=128, vocab=1000)
        for k, v in ((2, 1), (4, 2), (3, 3)):
            stages = _random_split(rng, profile.num_layers, k * v)
            schedule: Schedule = "interleaved-1f1b" if v > 1 else "1f1b"
            out.append(_plan(profile, stages, k=k, m=2 * k, schedule=schedule, d=2, batch=16 * k, recompute=rng.random() < 0.5))
    return out


# --------------------------------------------------------------------------- Megatron-core


def test_megatron_core_reads_every_layout() -> None:
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_config import TransformerConfig

    chars = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.loss: "L"}
    layouts = 0
    for plan in _plans():
        assert not problems(plan, "megatron")
        names = [n for s in plan.stages for n in s.layer_names]
        flags = read_megatron(export_plan(plan, "megatron")[0].files[0].text)
        k = int(str(flags["--pipeline-model-parallel-size"]))
        n_dec = decoder_stack(names).num_decoder_layers
        layout = flags.get("--pipeline-model-parallel-layout")
        vpp = len(plan.stages) // k
        if layout is not None:
            layouts += 1
            parsed = PipelineParallelLayerLayout.from_str(layout, k)
            parsed.validate_layer_layout(num_layers=n_dec, mtp_num_layers=None)
            assert parsed.virtual_pipeline_model_parallel_size == vpp
            for s, stage in enumerate(plan.stages):  # stage s -> pipeline rank s % K, virtual stage s // K
                got = "".join(chars[t] for t in parsed.layout[s % k][s // k])
                units = decoder_stack(names).stage_units(stage.start, stage.stop)
                assert got == "".join(mg.LAYER_CHARS[u.kind] for u in units)
        else:
            assert int(str(flags.get("--num-virtual-stages-per-pipeline-rank") or 1)) == vpp
        config = TransformerConfig(
            num_layers=n_dec,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=k,
            pipeline_model_parallel_layout=layout,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 and layout is None else None,
            tensor_model_parallel_size=int(str(flags["--tensor-model-parallel-size"])),
            recompute_granularity=flags.get("--recompute-granularity"),
            recompute_method=flags.get("--recompute-method"),
            recompute_num_layers=int(str(flags["--recompute-num-layers"])) if "--recompute-num-layers" in flags else None,
            pipeline_dtype=torch.float32,
        )
        assert config.pipeline_model_parallel_size == k
    assert layouts >= 5
    # the parser can fail: one decoder layer too few is refused
    with pytest.raises(AssertionError, match="must match num_layers"):
        PipelineParallelLayerLayout.from_str("Ett|tt|tL", 3).validate_layer_layout(num_layers=6, mtp_num_layers=None)


def _partial_plans() -> list[Plan]:
    """Plans whose stages checkpoint the first N decoder layers each (all of a stage with fewer)."""
    tiny = _profile(TINY)  # embed, blocks.0-5, head
    synth = synth_transformer(layers=12, hidden=256, heads=4, seq=128, vocab=1000)  # embed, blocks.0-11, head
    return [
        _plan(tiny, [(0, 3), (3, 5), (5, 8)], m=6, recompute_layers=[2, 1, 1], batch=12),
        _plan(tiny, [(0, 3), (3, 4), (4, 8)], m=6, recompute_layers=[3, 1, 2], batch=12),
        _plan(synth, [(0, 4), (4, 8), (8, 11), (11, 14)], k=2, m=4, schedule="interleaved-1f1b",
              recompute_layers=[3, 2, 2, 2], batch=16),
    ]  # fmt: skip


def test_megatron_core_checkpoints_the_layers_the_plan_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-core's own TransformerBlock._checkpointed_forward, run under the exported flags on
    each stage's decoder layers (stub layers, a recording checkpoint): the layers it checkpoints
    are the plan's, for full recompute (uniform 1) and for the first N of each stage (block N)."""
    pytest.importorskip("megatron.core")
    import inspect
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_config import TransformerConfig

    inside: list[bool] = [False]
    ran: list[tuple[int, bool]] = []

    def recording_checkpoint(fn: Any, distribute: bool, *args: Any) -> Any:
        inside[0] = True
        try:
            return fn(*args)
        finally:
            inside[0] = False

    def stub(index: int) -> Any:
        def layer(hidden_states: Any, context: Any = None, **_: Any) -> Any:
            ran.append((index, inside[0]))
            return hidden_states, context

        return layer

    monkeypatch.setattr(transformer_block.tensor_parallel, "checkpoint", recording_checkpoint)
    forward = transformer_block.TransformerBlock._checkpointed_forward
    names = set(inspect.signature(forward).parameters) - {"self"}
    plans = [p for p in [*_partial_plans(), *_plans()] if any(p.stages[s].recompute for s in range(len(p.stages)))]
    for plan in plans:
        assert not problems(plan, "megatron")
        flags = read_megatron(export_plan(plan, "megatron")[0].files[0].text)
        k = int(str(flags["--pipeline-model-parallel-size"]))
        config = TransformerConfig(
            num_layers=decoder_stack([n for s in plan.stages for n in s.layer_names]).num_decoder_layers,
            hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=k, pipeline_dtype=torch.float32,
            recompute_granularity=flags["--recompute-granularity"], recompute_method=flags["--recompute-method"],
            recompute_num_layers=int(str(flags["--recompute-num-layers"])),
        )  # fmt: skip
        for s, units in enumerate(_units(plan)):
            layers = sum(u.kind == "decoder" for u in units)
            fake = SimpleNamespace(config=config, num_layers_per_pipeline_rank=layers, _get_layer=stub)
            ran.clear()
            forward(fake, **{n: (torch.zeros(1) if n == "hidden_states" else False if n.startswith("use_") else None) for n in names})
            assert [i for i, _ in ran] == list(range(layers))  # every layer ran once, in order
            assert sum(c for _, c in ran) == decoders_checkpointed(plan)[s], (flags, s, ran)
            assert all(c for _, c in ran[: decoders_checkpointed(plan)[s]])  # the first ones


# --------------------------------------------------------------------------- torchtitan


def test_torchtitan_reads_the_fragment_and_the_overrides() -> None:
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip(
            "torchtitan is not installed (its dependencies conflict with constraints/test.txt): "
            "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro"
        )
    from dataclasses import field, make_dataclass

    import tyro
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.config import ConfigManager, ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import custom_registry
    from torchtitan.distributed.activation_checkpoint import (
        ActivationCheckpointingConfig,
        FullAC,
        SelectiveAC,
    )

    ConfigManager()  # registers torchtitan's command-line rules (comma lists) in custom_registry

    # the sections of torchtitan 0.3's Trainer.Config that the export sets (real annotations, not
    # this module's postponed strings, so that tyro can read them)
    job_type = make_dataclass(
        "Job",
        [
            ("training", TrainingConfig, field(default_factory=TrainingConfig)),
            ("parallelism", ParallelismConfig, field(default_factory=ParallelismConfig)),
            ("activation_checkpoint", ActivationCheckpointingConfig, field(default_factory=SelectiveAC.Config)),
        ],
        kw_only=True,
    )

    partial = _partial_plans()  # refused (every block or none), written as the nearest plan
    assert all(problems(plan, "torchtitan") for plan in partial)
    for plan in [*_plans(), *partial]:
        near = plan in partial
        text = export_plan(plan, "torchtitan", use_nearest=near)[0].files[0].text
        toml = tomllib.loads(text)
        par = ParallelismConfig(**toml["parallelism"])  # keyword-only dataclass: unknown keys raise
        tr = TrainingConfig(**toml["training"])
        get_schedule_class(par.pipeline_parallel_schedule)
        assert len(par.module_fqns_per_model_part or []) == len(plan.stages)
        assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == plan.num_microbatches
        overrides = text.split("command-line overrides:\n#   ", 1)[1].split("\n", 1)[0].split(" ")
        job = tyro.cli(job_type, args=overrides, registry=custom_registry)
        assert job.parallelism == par and job.training == tr
        assert isinstance(job.activation_checkpoint, FullAC.Config) == (toml["activation_checkpoint"]["mode"] == "full")
        if toml["activation_checkpoint"]["mode"] == "none":
            assert job.activation_checkpoint is None


# --------------------------------------------------------------------------- DeepSpeed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deepspeed_rank(rank: int, world: int, port: int, config: dict[str, Any], num_layers: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    import deepspeed
    import torch

    # DeepSpeed's CPU backend would JIT-compile a shared-memory collective (a minute of C++):
    # gloo is enough here
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    sys.path.insert(0, str(ROOT))
    from examples.deepspeed_pipeline import PlannedPipelineModule

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) for _ in range(num_layers)]
    model = PlannedPipelineModule.from_config(layers, config, loss_fn=torch.nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    batches = iter([(torch.randn(config["train_micro_batch_size_per_gpu"], 4), torch.randn(config["train_micro_batch_size_per_gpu"], 4)) for _ in range(config["gradient_accumulation_steps"])])
    loss = float(engine.train_batch(data_iter=batches))
    queue.put({
        "rank": rank, "stage": model.stage_id, "start": model._local_start, "stop": model._local_stop,
        "interval": model.activation_checkpoint_interval, "engine": type(engine).__name__, "loss": loss,
        "gas": engine.gradient_accumulation_steps(),
    })  # fmt: skip
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_deepspeed_runs_the_exported_boundaries(tmp_path: Path) -> None:
    """Two CPU ranks build examples/deepspeed_pipeline.py's PipelineModule from the exported
    ds_config.json and train one batch with DeepSpeed's pipeline engine (about 15 s)."""
    pytest.importorskip("deepspeed")
    import torch.multiprocessing as mp

    plan = _plan(_profile(TINY), [(0, 3), (3, 8)], m=4, recompute=[True, False], batch=8)
    config = json.loads(export_plan(plan, "deepspeed")[0].files[0].text)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.01}}  # the user's part of the config
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_deepspeed_rank, args=(r, 2, port, config, plan.num_layers, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = sorted((queue.get(timeout=240) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [(r["stage"], r["start"], r["stop"]) for r in results] == [(0, 0, 3), (1, 3, 8)]
    assert [r["interval"] for r in results] == [1, 0]  # stage 0 checkpointed layer by layer
    assert all(r["engine"] == "PipelineEngine" and r["gas"] == 4 and math.isfinite(r["loss"]) for r in results)


# --------------------------------------------------------------------------- torch.distributed.pipelining


@pytest.mark.parametrize(
    ("stages", "k", "schedule"),
    [([(0, 2), (2, 4), (4, 6)], 3, "1f1b"), ([(0, 2), (2, 3), (3, 5), (5, 6)], 2, "interleaved-1f1b")],
)
def test_torch_pipeline_splits_at_the_exported_spec(stages: list[tuple[int, int]], k: int, schedule: Schedule) -> None:
    import torch
    from torch.distributed.pipelining import pipeline
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from examples.gpt import tiny

    plan = _plan(_profile(GPT_TINY), stages, k=k, m=2 * k, schedule=schedule, batch=4 * k)
    text = export_plan(plan, "torch")[0].files[0].text
    consts: dict[str, Any] = {}
    exec(compile(text, "split_plan.py", "exec"), consts)  # the exported module, with real torch imports
    model, inputs, _ = tiny()
    with torch.no_grad():
        pipe = pipeline(model, mb_args=(inputs[0][: consts["MICROBATCH_SIZE"]],), split_spec=consts["SPLIT_SPEC"])
    assert pipe.num_stages == consts["NUM_STAGES"] == len(stages)
    for s, layers in enumerate(consts["STAGE_LAYERS"]):
        params = {name for name, _ in pipe.get_stage_module(s).named_parameters()}
        blocks = {".".join(n.split(".")[:2]) for n in params if n.startswith("blocks.")}
        assert blocks == {n for n in layers if n.startswith("blocks.")}
        assert any(n.startswith("embed.pos") for n in params) == ("embed" in layers)
        assert any(n.startswith("head.ln") for n in params) == ("head" in layers)
    base = PipelineScheduleMulti if len(stages) > k else PipelineScheduleSingle
    assert issubclass(consts["SCHEDULE_CLASS"], base)
