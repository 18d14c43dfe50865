"""``python -m pipemlx``: the ``pipemlx`` command (see :mod:`pipemlx.cli`)."""

from .cli import run

run()
