#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need (redis-server from
# Debian, the rest into .venv: the project with its test extra, which brings SeaweedFS, and the
# compiled copy helper), then runs the linters (ruff), the type checker (mypy --strict), the
# layering contracts (import-linter, .importlinter) and pytest. When tests of a real vLLM engine
# are selected, pytest prepares vLLM's own environment first if it is not ready (tests/conftest.py:
# before the first test, with a status line and its own time bound). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# Real servers for the tier tests: redis-server from Debian (SeaweedFS's `weed` comes from
# PyPI with the test extra); tmux, the real terminal `kvtier top`'s test draws in.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v tmux >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server tmux
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports
.venv/bin/pytest "$@"
