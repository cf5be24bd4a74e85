"""The worker's command-line flags, shared by ``python -m runtime.worker`` and ``pipeplan run``
(:func:`add_worker_args`), and their defaults.  :func:`runtime.worker_setup.train_options`
turns the training flags into checked options."""

from __future__ import annotations

import argparse

#: seconds a rank waits for another in a collective before the job fails (``--timeout``)
DEFAULT_TIMEOUT_S = 120.0
#: --check tolerance of a float32 run (16-bit runs: runtime.training.DEFAULT_TOLERANCES)
DEFAULT_TOLERANCE = 1e-5
#: --dtype choices (short and long names)
DTYPE_CHOICES = ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16")


def add_worker_args(p: argparse.ArgumentParser, *, for_launcher: bool = False) -> None:
    """Flags shared by ``pipeplan run`` and ``python -m runtime.worker``."""
    if not for_launcher:
        p.add_argument("--plan", required=True, help="plan JSON file")
    p.add_argument(
        "--model",
        required=True,
        help="MODULE:FUNC or path/to/file.py:FUNC (the profiled model); FUNC returns (model, example_inputs"
        "[, loss_fn[, data]]): loss_fn(output) or loss_fn(output, target); data: data_fn(step, batch_size), "
        "an iterable of global batches (a DataLoader) or runtime.data.Loader(make[, per_replica=True]), "
        "yielding (inputs, targets) when the loss takes a target",
    )
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument(
        "--optimizer",
        default=None,
        help="sgd, sgd-momentum, adam, adamw; must match the plan's training optimizer (default: the plan's)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine"),
        default="constant",
        help="constant, or cosine decay to --min-lr at the last step (default constant)",
    )
    p.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up steps (default 0)")
    p.add_argument("--min-lr", type=float, default=0.0, help="where the cosine schedule ends (default 0)")
    p.add_argument(
        "--clip-grad-norm",
        type=float,
        metavar="MAX",
        help="clip the gradient to this L2 norm, the norm of the whole model's gradient over every "
        "pipeline rank (after the data-parallel average)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        help="compute dtype: bf16/fp16 run the stages under autocast with fp32 master weights "
        "(fp16 with loss scaling); must match the plan's (default: the plan's, fp32 for a plan without one)",
    )
    p.add_argument(
        "--log-file",
        metavar="FILE",
        help="write loss, lr, step time, throughput and gradient norm per step: CSV for *.csv, else JSON lines",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model set-up and of the synthetic data (a data function from FUNC ignores it; default 0)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"collective timeout in seconds: a rank that waits longer for another fails the job (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="default: nccl on CUDA, else gloo")
    p.add_argument(
        "--check",
        action="store_true",
        help="compare losses, gradients and final parameters with the unsplit model trained in one process",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        help=f"--check relative tolerance (default {DEFAULT_TOLERANCE:g} for fp32, 1e-2 for bf16, 2e-3 for fp16)",
    )
    p.add_argument("--report", metavar="FILE", help="write the measured-vs-predicted report JSON here")
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="save model and optimizer state here with torch.distributed.checkpoint (sharded, every rank "
        "writes its own part); DIR/latest names the newest complete one",
    )
    p.add_argument(
        "--every", type=int, default=0, metavar="N", help="with --checkpoint: save every N steps (default 0: at the end)"
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from the newest complete checkpoint in DIR, under this or another plan (other K, D, T "
        "or ZeRO: the checkpoint is resharded on load); --steps counts from step 0",
    )
    p.add_argument(
        "--dp-bucket-mb",
        type=float,
        default=None,
        metavar="MIB",
        help="bucket size of the data-parallel gradient all-reduce (torch DDP, overlapped with each stage's last "
        "backward; default 25, DDP's)",
    )
    p.add_argument(
        "--dp-reduction",
        choices=("auto", "flat"),
        default="auto",
        help="data-parallel gradient reduction: auto (torch DDP, bucketed and overlapped with the backward, where "
        "the mesh allows it; else the flat all-reduce) or flat (the runtime's flat all-reduce after the schedule, "
        "to compare)",
    )
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    # RANK:STEP:MODE (FAULT_MODES): make one rank fail mid-step or compute wrongly, for tests
    p.add_argument("--inject-fault", help=argparse.SUPPRESS)
