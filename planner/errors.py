"""Domain exceptions.  Every message names the offending value and the fix."""

from __future__ import annotations

from typing import Any


class PipeplanError(ValueError):
    """Base class of every error pipeplan raises on bad input or an impossible request."""


class InputError(PipeplanError):
    """A profile, cluster, training setup or plan that does not validate.

    ``errors`` holds one ``{"loc": "layers[3].forward_ms", "msg": ..., "input": ...}``
    entry per problem, for machines (the API returns them as a 422 body).
    """

    def __init__(self, message: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []


class InfeasibleError(PipeplanError):
    """No plan fits the devices' memory.  ``details`` carries the numbers behind the message."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


class SearchCutShortError(InfeasibleError):
    """The search found no plan but proved nothing either: its time ran out (its wall-clock net,
    on a loaded machine) before every configuration was examined.  ``details["bound_ms"]``
    bounds every plan it left open (a caller combining searches keeps it as that part's bound);
    the fix is a longer time limit, not more memory."""


class PlanMismatchError(PipeplanError):
    """A plan that does not match the model it is applied to."""
