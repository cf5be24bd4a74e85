"""The service's version (part of the cache key: a new planner re-solves)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def service_version() -> str:
    try:
        return version("pipeplan")
    except PackageNotFoundError:  # running from a checkout
        return "0+checkout"
