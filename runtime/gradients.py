"""One step's gradients, after the schedule and before the optimizer.

In the order the step runs them: :func:`average_gradients` (the mean over micro-batches, then
over the data axis: what neither DDP, during the last backwards, nor FSDP2 averaged, by the
flat all-reduce), :func:`sum_tied` (tied weights whose copies sit on several pipeline ranks),
:func:`unscale` (float16's loss scale: one skip decision for the whole job) and
:func:`clip` (the global gradient norm over every pipeline rank, and ``--clip-grad-norm``).
"""

from __future__ import annotations

import math
from typing import Any

from planner.errors import InputError
from runtime.fault_injection import drop_gradient
from runtime.rank_state import RankState, StageSet, Training


def average_gradients(state: RankState, built: StageSet, training: Training, step: int) -> None:
    """Divide every gradient by M once, then average over the data axis what is left to us."""
    from runtime.mesh import all_reduce_grad, reduces_data_gradients

    params, spec, fault = training.params, state.spec, state.my_fault
    # DDP (find_unused_parameters=False) never reduces a bucket holding a weight left without a
    # gradient, and fails the next step obscurely: the splitter keeps no unused weight, so this
    # is a layer the backward did not reach (--inject-fault R:S:skip-layer)
    if built.by_ddp:
        unused = sorted({built.layer_of.get(id(p), "?") for p in params if id(p) in built.by_ddp and p.grad is None})
        if unused:
            raise InputError(
                f"rank {state.job.coords.rank}: a weight of layer(s) {', '.join(unused)} got no gradient in step "
                f"{step}'s backward; torch DDP cannot reduce a stage with unused weights: run with --dp-reduction flat"
            )
    for p in params:
        if p.grad is not None:
            p.grad.div_(state.plan.num_microbatches)  # mean over micro-batches, once per tensor
    if fault is not None and fault.mode == "drop-grad" and step == fault.step:
        drop_gradient(params)
    # the flat all-reduce, for what neither FSDP2 (ZeRO 2/3: what it shards) nor DDP (by_ddp)
    # averaged: kept for T > 1 and the split-backward schedules (runtime.mesh.gradient_reduction
    # says why), and under DDP for the weights it leaves out (two stages' of one rank)
    if state.dp_group is not None:
        d_deg = spec.data_parallel_degree
        mine_to_reduce = [
            p
            for p in params
            if p.grad is not None and not reduces_data_gradients(spec, p) and not built.axes.owns(p)
            and id(p) not in built.by_ddp
        ]  # fmt: skip
        allreduce_mean([p.grad for p in mine_to_reduce if not is_dtensor(p.grad)], state.dp_group, d_deg)
        for p in mine_to_reduce:
            if is_dtensor(p.grad):  # tensor-parallel shards: one all-reduce of the local shard each
                all_reduce_grad(p, state.dp_group, divide=d_deg)
    built.axes.reduce_gradients()


def sum_tied(built: StageSet) -> None:
    """Sum the gradients of the tied weights whose copies sit on several pipeline ranks."""
    import torch

    from runtime.mesh import all_reduce_grad

    for pg, p in built.tied:
        if p.grad is None:  # every holder must join the all-reduce
            p.grad = torch.zeros_like(p)
        all_reduce_grad(p, pg)


def unscale(state: RankState, training: Training, grads: list[Any], scale: float) -> bool:
    """Float16: divide the gradients by the loss scale; whether to skip the step (any rank's
    inf skips it everywhere: one decision for the whole job).  False without loss scaling."""
    import torch
    import torch.distributed as dist

    from runtime.training import has_nonfinite

    scaler = training.scaler
    if not scaler.enabled:
        return False
    for g in grads:
        g.div_(scale)
    flag = torch.tensor([1.0 if has_nonfinite(local(g) for g in grads) else 0.0], device=state.job.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    skip = bool(flag.item() > 0)
    scaler.update(skip)
    return skip


def clip(state: RankState, built: StageSet, training: Training, grads: list[Any], skip: bool) -> float | None:
    """The global gradient norm (for ``--clip-grad-norm`` or the log; None otherwise, or when
    the step is skipped), and the gradients clipped to ``--clip-grad-norm``."""
    import torch
    import torch.distributed as dist

    from runtime.mesh import squared_grad_norm
    from runtime.training import clip_coefficient

    opts = state.job.opts
    if not ((opts.clip_grad_norm is not None or state.job.args.log_file) and not skip):
        return None
    # every rank joins the reduction; DTensor gradients (tensor-parallel or FSDP shards) count
    # whole: a collective over their mesh
    part = squared_grad_norm(training.params, skip=built.not_mine_in_norm)
    total = torch.tensor(part, dtype=torch.float64, device=state.job.device)
    dist.all_reduce(total, group=state.pp_group)  # replicas (and tp ranks) hold the same whole gradient
    norm = math.sqrt(float(total))
    if opts.clip_grad_norm is not None:
        coef = clip_coefficient(norm, opts.clip_grad_norm)
        for g in grads:
            g.mul_(coef)
    return norm


def allreduce_mean(grads: list[Any], group: Any, replicas: int) -> None:
    """Average gradients over the data-parallel group, in one flat buffer, after the schedule:
    the path of the plans torch's DDP cannot reduce (:func:`runtime.mesh.gradient_reduction`)."""
    import torch
    import torch.distributed as dist

    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= replicas
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(p: Any) -> Any:
    """A parameter's local part (a DTensor's shard)."""
    return p.to_local() if is_dtensor(p) else p
