"""Reading only a rank's rows of the vocabulary-sized tensors from safetensors files (``head="split"``).

A lazily loaded tensor is read whole when any part of it is evaluated, so slicing the embedding after the load
would hold the whole matrix for a moment. The embedding and the head (plain: ``weight``; quantized: ``weight``,
``scales``, ``biases``) are row-major with the vocabulary first, so a rank's rows ``[V*r/S, V*(r+1)/S)`` are one
contiguous byte range of the file: :func:`read_rows` reads that range alone, and :func:`preread_vocabulary`
attaches the rows to the lazily built model, where :func:`pipemlx.models.vocab_head.split_vocabulary` takes them
in place of slicing.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten  # pyright: ignore[reportUnknownVariableType]

from .safetensors import read_safetensors_header
from .weights import VOCAB_MODULES

PREREAD_ATTRIBUTE = "_pipemlx_vocab_rows"
"""The model attribute holding ``{parameter path: rows read}`` (with ``"rows"``: the range) for split_vocabulary."""
MLX_TYPES: dict[str, mx.Dtype] = {
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U8": mx.uint8,
    "I8": mx.int8,
}


def read_rows(path: str | Path, name: str, rows: range) -> mx.array:
    """Rows ``rows`` of tensor ``name`` in the safetensors file ``path``, reading only their bytes.

    Raises ``KeyError`` when the file has no such tensor, ``ValueError`` for a dtype it cannot read or rows
    outside the tensor.
    """
    header = read_safetensors_header(path)
    entry = header[name]
    dtype = str(entry["dtype"])
    if dtype not in MLX_TYPES:
        raise ValueError(f"{path}: {name} is {dtype}, which pipemlx cannot read by rows")
    shape = [int(d) for d in entry["shape"]]
    if not shape or rows.start < 0 or rows.stop > shape[0] or rows.step != 1:
        raise ValueError(f"{path}: rows {rows.start}..{rows.stop} are outside {name} of shape {shape}")
    per_row = MLX_TYPES[dtype].size
    for d in shape[1:]:
        per_row *= d
    # Read straight into an MLX buffer (its memory, through the buffer protocol): no second copy of the rows.
    buffer = mx.zeros((len(rows) * per_row,), dtype=mx.uint8)
    mx.eval(buffer)  # pyright: ignore[reportUnknownMemberType]
    target = memoryview(cast(Any, buffer)).cast("B")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + length + int(entry["data_offsets"][0]) + rows.start * per_row)
        filled = 0
        while filled < len(target):
            got = f.readinto(target[filled:])
            if not got:
                raise ValueError(f"{path}: {name} ends before row {rows.stop}")
            filled += got
    return mx.reshape(buffer.view(MLX_TYPES[dtype]), (len(rows), *shape[1:]))


def tensor_files(root: Path) -> dict[str, Path]:
    """Every tensor name in the folder's ``*.safetensors`` files, and the file holding it (headers only)."""
    found: dict[str, Path] = {}
    for path in sorted(root.glob("*.safetensors")):
        for name in read_safetensors_header(path):
            found[name] = path
    return found


def preread_vocabulary(model: nn.Module, root: Path, rank: int, world_size: int) -> int:
    """Read this rank's rows of the embedding and the head from the folder ``root`` and attach them to ``model``.

    Each parameter of ``model.embed_tokens`` and ``lm_head`` (as the model names them, which mlx-lm saves
    them as) found in a file with the dtype and shape of the model's lazy parameter is read by rows; the others
    are left to be sliced (read whole). Rows attached already (a rank's folder holding only its rows:
    :func:`pipemlx.models.loading.take_fetched_rows`) are kept. The model's parameters are not touched. Returns
    the bytes read.
    """
    files = tensor_files(root)
    parameters = dict(cast(list[tuple[str, Any]], tree_flatten(model.parameters())))
    kept: dict[str, Any] = dict(getattr(model, PREREAD_ATTRIBUTE, {}))
    read = 0
    for name, value in parameters.items():
        if not isinstance(value, mx.array) or not any(name.startswith(m + ".") for m in VOCAB_MODULES):
            continue
        if name in kept:
            continue
        path = files.get(name)
        if path is None or value.ndim == 0:
            continue
        vocab = int(value.shape[0])
        rows = range(vocab * rank // world_size, vocab * (rank + 1) // world_size)
        try:
            part = read_rows(path, name, rows)
        except (KeyError, ValueError):
            continue
        if part.dtype != value.dtype or tuple(part.shape[1:]) != tuple(value.shape[1:]):
            continue
        mx.eval(part)  # pyright: ignore[reportUnknownMemberType]
        kept[name] = part
        read += part.nbytes
    object.__setattr__(model, PREREAD_ATTRIBUTE, kept)
    return read
