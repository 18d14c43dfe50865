#!/usr/bin/env bash
# The tests CI does not run (marked `slow`: serve under MPI, bench against mlx-lm, the doctor across hosts, the
# middle-rank and shrink recoveries, the ten-kill soak, ...), after everything tests/run.sh installs and checks.
# Run before every release: `bash tests/run_slow.sh` (pytest arguments pass through). tests/README.md lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash tests/run.sh -m slow -p no:cacheprovider "$@"
