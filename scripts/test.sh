#!/usr/bin/env bash
# The project's test command: lint, type-check, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff"
ruff check .
echo "== mypy (strict for planner/ and api/)"
mypy planner api pipeplan
echo "== pytest"
python -m pytest -q --durations=20 "$@"
