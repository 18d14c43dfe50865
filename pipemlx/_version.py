"""The version of pipemlx, in a module of its own so every layer can read it."""

__version__ = "0.2.0"
