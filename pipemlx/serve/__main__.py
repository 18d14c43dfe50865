"""A serving rank started by a process that serves (``python -m pipemlx.serve``, options in the environment)."""

import sys

from . import run_rank
from .settings import rank_options_from_environment

try:
    OPTIONS = rank_options_from_environment()
except ValueError as exc:
    print(f"pipemlx serve: error: {exc}", file=sys.stderr)
    sys.exit(2)
sys.exit(run_rank(OPTIONS))
