#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need into .venv, then runs
# the linters (ruff), the type checker (mypy --strict) and pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
