"""``--check``: train the unsplit model in rank 0's process on the same data, and compare.

Every rank keeps, per step, the per-tensor norms of the gradients its optimizer steps on, and
the whole gradients of the steps :func:`check_grad_steps` names (:func:`runtime.step_update.update`);
it sends them and its final parameters to rank 0 (:func:`runtime.results_rank.rank_results`).
Rank 0 then trains the reference (:func:`runtime.training.train_reference`) and
:func:`add_check` compares losses, gradients and parameters within :func:`tolerance`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from runtime.rank_state import Job


def check_grad_steps(first_step: int, steps: int) -> tuple[int, ...]:
    """The steps whose whole gradients ``--check`` keeps and compares: the first this run trains
    (the same weights in both runs: what the split, the schedule and the reductions compute)
    and the last; the other steps compare per-tensor gradient norms (memory: two copies of the
    gradients on CPU, not one per step)."""
    return tuple(sorted({first_step, steps - 1}))


def tolerance(args: argparse.Namespace, dtype: str) -> float:
    """``--tolerance``, or the default for ``dtype``."""
    from runtime.training import DEFAULT_TOLERANCES

    return float(args.tolerance) if args.tolerance is not None else DEFAULT_TOLERANCES[dtype]


def add_check(job: Job, gathered: list[Any], losses: list[float | None], report: Any) -> tuple[Any, str | None]:
    """``report`` with the check and its notes; the failure message when it failed (else None)."""
    from runtime.report import check_failed_message, check_report
    from runtime.training import compare, grad_tolerance

    args, opts, steps = job.args, job.opts, job.args.steps
    first_step = gathered[0]["first_step"]
    tol = tolerance(args, opts.dtype)
    reference = reference_run(job, first_step)
    params, check_norms, check_grads = _pipelined(gathered)
    got_losses = [x if x is not None else float("nan") for x in losses]
    if first_step:  # resumed: the reference trained every step from the seed's weights
        reference = dataclasses.replace(reference, losses=reference.losses[first_step:])
        report.notes.append(
            f"check after --resume: the unsplit reference trains all {steps} steps from the seed's initial "
            f"weights and is compared at steps {first_step}..{steps - 1} and at the end; it holds when the "
            "checkpoint came from a run with the same --seed, data, learning-rate schedule and batch"
            + (
                f"; {opts.optimizer}'s noise allowance counts steps 0..{first_step - 1} too, where the reference's "
                "gradients say which elements were noise, and every step's gradients are compared by their norms "
                "(the resumed run's first step already runs on weights the optimizer's move on noise set apart)"
                if reference.noise is not None
                else ""
            )
        )
    cmp = compare(got_losses, params, reference, grads=check_grads, grad_norms=check_norms, tolerance=tol)
    grad_tol = grad_tolerance(tol, opts.dtype)
    passed = cmp.passed(tol, grad_tolerance=grad_tol)
    check = check_report(
        passed=passed,
        tolerance=tol,
        grad_tolerance=grad_tol,
        max_loss_rel_diff=cmp.max_loss_rel_diff,
        max_param_rel_diff=cmp.max_param_rel_diff,
        worst_param=cmp.worst_param,
        params_compared=cmp.params_compared,
        losses_pipelined=got_losses,
        losses_reference=reference.losses,
        max_grad_rel_diff=cmp.max_grad_rel_diff,
        worst_grad=cmp.worst_grad,
        categories=cmp.categories,
    )
    report = report.model_copy(update={"check": check})
    if opts.mixed:
        report.notes.append(
            f"check in {opts.dtype}: the reference runs the unsplit model under the same autocast; "
            f"tolerance {tol:g} (16-bit rounding of the same operations, grouped differently), {grad_tol:g} for "
            "gradients (a weight whose 16-bit cast tipped changes the gradients of every layer it feeds)"
        )
    if reference.noise is not None:
        report.notes.append(
            f"check with {opts.optimizer}: it divides each update by the root of the squared-gradient average, "
            "so a parameter element whose true gradient is zero (an attention key bias) moves by up to about lr "
            "per step on rounding noise alone, differently in two runs that sum the same terms in another "
            "order; the check compares the gradients themselves, and allows a parameter element the move "
            f"{opts.optimizer} can make on noise where its gradient is rounding noise (and that move scaled by "
            "its gradients' relative disagreement elsewhere); the check's categories name the tensors that "
            "needed it"
        )
    return report, (check_failed_message(check) if not passed else None)


def reference_run(job: Job, first_step: int) -> Any:
    """The unsplit model, rebuilt from the entry point with the same seed, trained in this
    process on the same data, steps, batch and optimizer (:func:`runtime.training.train_reference`).

    After ``--resume`` (``first_step`` > 0) it still trains from step 0, not from the
    checkpoint: a reference that loaded the checkpoint would read the same saved values as the
    resumed run, so a save that wrote wrong values (a tensor-parallel shard gathered in the wrong
    order, a lost optimizer moment) would pass.  Trained from the seed, it checks the save, the
    resharding and the load with the steps; with Adam or AdamW the parameters' noise allowance
    then counts the steps before the checkpoint as well
    (:attr:`runtime.training.ReferenceResult.noise_before`)."""
    import torch

    from profiler.loading import load_entrypoint
    from runtime.data import DataSource
    from runtime.training import train_reference

    args, plan, opts, steps = job.args, job.plan, job.opts, job.args.steps
    torch.manual_seed(args.seed)
    ref_entry = load_entrypoint(args.model)
    return train_reference(
        ref_entry.model,
        ref_entry.example_inputs,
        ref_entry.loss,
        keywords=ref_entry.keywords,
        seed_hooks=job.split.seed_hooks,
        steps=steps,
        global_batch_size=plan.global_batch_size,
        microbatch_size=plan.microbatch_size,
        replicas=plan.data_parallel_degree,
        optimizer=opts.optimizer,
        lr=opts.lr,
        seed=args.seed,
        device=job.device,
        source=DataSource.of(ref_entry, global_batch_size=plan.global_batch_size, steps=steps, seed=args.seed),
        options=opts,
        grad_steps=check_grad_steps(first_step, steps),
        first_step=first_step,
    )


def _pipelined(
    gathered: list[Any],
) -> tuple[dict[str, Any], dict[int, dict[str, float]], dict[int, dict[str, Any]]]:
    """The pipelined run's final parameters, per-step gradient norms and kept gradients, by the
    model's names, from the ranks that sent them (replica 0, tensor-parallel rank 0)."""
    params: dict[str, Any] = {}
    check_norms: dict[int, dict[str, float]] = {}
    check_grads: dict[int, dict[str, Any]] = {}
    for g in gathered:
        if g["params"]:
            params.update(g["params"])
            for step, norms in g["check_norms"].items():
                check_norms.setdefault(step, {}).update(norms)
            for step, grads in g["check_grads"].items():
                check_grads.setdefault(step, {}).update(grads)
    return params, check_norms, check_grads
