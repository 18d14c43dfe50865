"""The demo model pipemlx ships: a small llama trained on *Pride and Prejudice*.

It gives ``pipemlx generate``, ``pipemlx bench``, the examples and the tests a
real model and prompt to run without any download; the runtime does not use it.

``MODEL_DIR`` is an mlx-lm model folder (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) that ``mlx_lm.load`` reads like
any downloaded model; ``train.py`` beside it made it (from the text that
``extract_text.py`` recovered). ``DRAFT_DIR`` is its draft model for speculative
decoding: the same recipe with 2 layers and the demo's tokenizer. :func:`default_prompt` is the prompt
``pipemlx generate`` uses when given none; :func:`book_text` the whole novel.
"""

from __future__ import annotations

import gzip
from pathlib import Path

HERE = Path(__file__).parent
MODEL_DIR = HERE / "model"
DRAFT_DIR = HERE / "draft"
PROMPT_FILE = HERE / "prompt.txt"
BOOK_FILE = HERE / "pride_and_prejudice.txt.gz"


def default_prompt() -> str:
    """The demo prompt: the opening of *Pride and Prejudice*'s first chapter."""
    return PROMPT_FILE.read_text(encoding="utf-8")


def book_text() -> str:
    """The whole training text: *Pride and Prejudice* (about 685 000 characters), for long prompts."""
    with gzip.open(BOOK_FILE, "rt", encoding="utf-8") as f:
        return f.read()
