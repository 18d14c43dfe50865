"""The demo model pipemlx ships: a small llama trained on *Pride and Prejudice*.

``MODEL_DIR`` is an mlx-lm model folder (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) that ``mlx_lm.load`` reads like
any downloaded model; ``train.py`` beside it made it. ``DEFAULT_PROMPT`` is the
prompt ``pipemlx generate`` uses when given none.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
MODEL_DIR = HERE / "model"
PROMPT_FILE = HERE / "prompt.txt"


def default_prompt() -> str:
    """The demo prompt: the opening of *Pride and Prejudice*'s first chapter."""
    return PROMPT_FILE.read_text(encoding="utf-8")
