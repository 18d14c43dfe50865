"""``python -m pipemlx``: the ``pipemlx`` command (see :mod:`pipemlx.cli`)."""

from .cli import main

raise SystemExit(main())
