#!/usr/bin/env bash
# The project's test command: lint, type-check, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff"
ruff check .
echo "== mypy (strict for planner/ and api/)"
mypy planner api pipeplan
echo "== pytest"
# two workers (pytest-xdist): the planner's tests are single-threaded and the runtime's gloo jobs
# wait on each other much of the time, so two share a 2-core machine well (about 15 min against
# 21-26 in one process); `bash scripts/test.sh -n 0` runs in one process, `-n 4` on four workers.
# The tests marked `nightly` are left out (pyproject's addopts): `bash scripts/test.sh -m nightly`
# runs them alone, `-m "nightly or not nightly"` everything (docs/design/development.md)
python -m pytest -q -n 2 --durations=20 "$@"
