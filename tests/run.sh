#!/usr/bin/env bash
# The project's test command: installs everything the tests need, then runs them.
# Usage: bash tests/run.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
exec python -m pytest -q "$@"
