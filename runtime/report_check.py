"""The run report's ``--check`` verdict (torch-free): the :class:`planner.schema.CheckReport` of a
comparison (:func:`check_report`), its lines in the printed report and the error message of a
failed check."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from planner.schema import CheckCategory, CheckReport


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def check_report(
    *,
    passed: bool,
    tolerance: float,
    max_loss_rel_diff: float,
    max_param_rel_diff: float,
    worst_param: str,
    params_compared: int,
    losses_pipelined: Sequence[float | None],
    losses_reference: Sequence[float | None],
    max_grad_rel_diff: float | None = None,
    worst_grad: str = "",
    categories: Sequence[Any] = (),
    grad_tolerance: float | None = None,
) -> CheckReport:
    """The ``--check`` verdict as the report holds it (non-finite figures become ``None``);
    ``categories``: :class:`runtime.training.Category` (or anything with its fields)."""
    return CheckReport(
        passed=passed,
        tolerance=tolerance,
        max_loss_rel_diff=_finite(max_loss_rel_diff),
        max_param_rel_diff=_finite(max_param_rel_diff),
        worst_param=worst_param,
        params_compared=params_compared,
        losses_pipelined=[_finite(x) for x in losses_pipelined],
        losses_reference=[_finite(x) for x in losses_reference],
        max_grad_rel_diff=_finite(max_grad_rel_diff) if max_grad_rel_diff is not None else None,
        worst_grad=worst_grad,
        grad_tolerance=grad_tolerance,
        categories=[
            CheckCategory(
                name=c.name, measure=c.measure, compared=c.compared, max_diff=_finite(c.max_diff), worst=c.worst,
                tensors=list(c.tensors),
            )
            for c in categories
        ],
    )


def check_failed_message(check: CheckReport) -> str:
    """The one ``error:`` line of a failed ``--check``: the largest difference in losses,
    gradients and parameters (worst tensors), the tolerance, and what to do."""
    loss, grad, param = ("n/a" if x is None else f"{x:.3g}" for x in
                         (check.max_loss_rel_diff, check.max_grad_rel_diff, check.max_param_rel_diff))  # fmt: skip
    grads = f"{grad} (gradients, worst {check.worst_grad or '-'}), " if check.categories else ""
    grad_tol = f" ({check.grad_tolerance:g} for gradients)" if check.grad_tolerance not in (None, check.tolerance) else ""
    return (
        f"--check failed: the pipelined run differs from the unsplit model by {loss} (losses), {grads}"
        f"{param} (parameters, worst {check.worst_param}), more than the tolerance {check.tolerance:g}{grad_tol}: the "
        "split, the schedule or a reduction computes something else (the report's check lists each category), "
        "or, if the difference is rounding, give a larger --tolerance"
    )


#: how many tensors of an exceptional check category the printed report names
CATEGORY_NAMES_SHOWN = 4


def check_category_lines(check: CheckReport) -> list[str]:
    """One indented line per category of a ``--check`` verdict: what was compared, how many,
    the largest difference and where (the tensors of an exceptional category, the first few)."""
    out = []
    for cat in check.categories:
        where = f" at {cat.worst}" if cat.worst else ""
        line = f"  {cat.name}: {cat.compared} compared, max {_fmt(cat.max_diff, '.2e')}{where} ({cat.measure})"
        if cat.tensors:
            shown = ", ".join(cat.tensors[:CATEGORY_NAMES_SHOWN])
            more = len(cat.tensors) - CATEGORY_NAMES_SHOWN
            line += f"; tensors: {shown}" + (f" and {more} more" if more > 0 else "")
        out.append(line)
    return out
