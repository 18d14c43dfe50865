"""load_sharded: load an mlx-lm model directory holding only this rank's part of the model in memory."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import mlx.nn as nn
from mlx_lm.utils import load_model, load_tokenizer  # pyright: ignore[reportUnknownVariableType]

from ..errors import renamed
from ..schedule.memory_model import HeadPolicy
from .sharding import DEFAULT_TIMEOUT, LendSpec, MemorySpec, SplitSpec, shard_model


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`Path` after checking it looks like an mlx-lm model directory."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} is not a directory; load_sharded needs a local mlx-lm model directory "
            "(config.json, model*.safetensors, tokenizer files)"
        )
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json; it is not an mlx-lm model directory")
    if not any(root.glob("model*.safetensors")):
        raise FileNotFoundError(f"{root} has no model*.safetensors weight files")
    return root


@renamed(step_size="prefill_step_size", lend_mlp="lend", lend_heads="lend")
def load_sharded(
    path: str | os.PathLike[str],
    group: Any,
    *,
    split: SplitSpec = None,
    memory: MemorySpec = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    model_config: dict[str, Any] | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    speeds: Sequence[float] | None = None,
    context: int | None = None,
    kv_bits: int | None = None,
    prefill_step_size: int | Literal["auto"] = "auto",
    head: HeadPolicy = "all",
    allow_unregistered: bool = False,
    lend: LendSpec = "auto",
) -> tuple[nn.Module, Any]:
    """Load the mlx-lm model directory ``path`` as this rank's pipeline stage; return ``(model, tokenizer)``.

    A collective, like :func:`pipemlx.shard_model`: call it on every rank of ``group`` with the same arguments. The model is
    built by mlx-lm's own ``load_model`` with lazy weights (so ``sanitize``,
    quantization and the weight checks are mlx-lm's), then
    :func:`pipemlx.shard_model` cuts it to this rank's layers and evaluates
    only the weights the rank keeps: its layers, the final norm and output
    head (every rank computes the logits while decoding), and the input
    embedding on rank 0, or on every rank when the output head is the
    embedding (tied). Weights of other ranks' layers are never read from disk.
    ``split``, ``memory``, ``timeout``, ``speeds``, ``context``, ``kv_bits``,
    ``prefill_step_size``, ``head``, ``allow_unregistered`` and ``lend`` are :func:`pipemlx.shard_model`'s
    (``split="memory"`` plans from the byte sizes of the layers as built). The tokenizer is mlx-lm's
    ``load_tokenizer``'s (``tokenizer_config`` passes extra settings to it); ``model_config`` overrides entries of
    ``config.json``. Weight files may be one or many, with or without ``model.safetensors.index.json``.

    Raises ``FileNotFoundError`` when ``path`` is not a model directory, and
    what :func:`pipemlx.shard_model` raises for a bad split or a model it cannot
    pipeline.
    """
    root = check_model_dir(path)
    loaded: Any = load_model(root, lazy=True, model_config=model_config, trust_remote_code=trust_remote_code)  # pyright: ignore[reportUnknownVariableType]
    model: nn.Module = loaded[0]
    config: dict[str, Any] = loaded[1]
    shard_model(
        model,
        group,
        split=split,
        memory=memory,
        timeout=timeout,
        speeds=speeds,
        context=context,
        kv_bits=kv_bits,
        prefill_step_size=prefill_step_size,
        head=head,
        allow_unregistered=allow_unregistered,
        lend=lend,
    )
    tokenizer: Any = load_tokenizer(root, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer
