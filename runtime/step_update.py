"""The end of a training step: :func:`update` steps the optimizer at the step's learning rate
(keeping, with ``--check``, what it steps on) and :func:`save_if_due` saves a checkpoint when
one is due. Called by :func:`runtime.step.train_step`.
"""

from __future__ import annotations

import time

from runtime.faults import write_status
from runtime.rank_state import RankState, StepRecords, Training


def update(state: RankState, training: Training, records: StepRecords, step: int, skip: bool) -> float:
    """Step the optimizer at the step's learning rate (unless the step is skipped); with
    ``--check``, keep what it steps on first.  Returns the learning rate."""
    from runtime.mesh import full_gradients, gradient_norms

    opt = training.opt
    lr: float = state.job.opts.lr_at(step)
    for group in opt.param_groups if opt is not None else ():
        group["lr"] = lr
    if state.job.args.check:  # what the optimizer steps on, against the reference's (DTensors: collectives)
        records.check_norms[step] = {} if skip else gradient_norms(training.named)
        if step in training.grad_steps and not skip:
            records.check_grads[step] = full_gradients(training.named)
    if not skip and opt is not None:
        opt.step()
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    return lr


def save_if_due(state: RankState, training: Training, step: int) -> None:
    """``--checkpoint DIR``: save after every ``--every`` steps and after the last."""
    args, plan, spec = state.job.args, state.plan, state.spec
    if not (args.checkpoint and ((args.every and (step + 1) % args.every == 0) or step + 1 == args.steps)):
        return
    from runtime.checkpoint import save_checkpoint

    state.job.status.phase = "saving a checkpoint"
    write_status(args.run_dir, state.job.status)
    save_checkpoint(
        args.checkpoint, step + 1, training.named, training.opt, model=args.model, sha256=state.job.split.sha256(),
        plan=f"K={plan.pipeline_degree} D={spec.data_parallel_degree} T={spec.tensor_parallel_degree} "
        f"zero={spec.zero_stage} {plan.schedule}",
        optimizer_name=state.job.opts.optimizer, loss_scale=training.scaler.state(),
    )  # fmt: skip
    state.job.progress.beat = time.monotonic()
