"""What ``--check``'s comparison (:func:`runtime.check_compare.compare`) returns: one
:class:`Category` per kind of figure compared and the :class:`Comparison` that holds them and
says whether the run passed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Category:
    """One kind of figure ``--check`` compares: how, how many, the largest difference, where."""

    name: str
    #: how a difference is measured, in words
    measure: str
    compared: int
    max_diff: float
    #: the tensor (and step) of the largest difference
    worst: str = ""
    #: the tensors in it, for the categories that are exceptions (near-zero gradients, the
    #: Adam noise allowance); empty for the others
    tensors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Comparison:
    max_loss_rel_diff: float
    max_param_rel_diff: float
    worst_param: str
    params_compared: int
    missing: list[str]
    #: the largest gradient difference (:data:`GRAD_FLOOR`), over every compared step
    max_grad_rel_diff: float = 0.0
    worst_grad: str = ""
    categories: list[Category] = field(default_factory=list)

    def passed(self, tolerance: float, *, grad_tolerance: float | None = None) -> bool:
        """Losses and parameters within ``tolerance``, gradients within ``grad_tolerance``
        (default: ``tolerance``; see :func:`grad_tolerance`)."""
        grad_tol = tolerance if grad_tolerance is None else grad_tolerance
        return self.max_loss_rel_diff <= tolerance and self.max_param_rel_diff <= tolerance and self.max_grad_rel_diff <= grad_tol
