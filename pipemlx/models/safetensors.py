"""A model folder's parameter bytes from its safetensors headers (no tensor data is read).

What ``pipemlx split`` (:mod:`pipemlx.cli.split`) plans from: per-layer and
fixed bytes of an mlx-lm model folder, as a
:class:`~pipemlx.schedule.memory_split.ModelBytes`.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..schedule.memory_split import ModelBytes

LAYER_NAME = re.compile(r"^(.*?)(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
EMBEDDING_NAME = re.compile(r"(?:^|\.)(?:embed_tokens|embeddings?|wte|tok_embeddings|word_embeddings)\.")
HEAD_NAME = re.compile(r"(?:^|\.)(?:lm_head|output)\.")
SAFETENSORS_ITEM_BYTES: MappingProxyType[str, int] = MappingProxyType(
    {
        "BOOL": 1,
        "U8": 1,
        "I8": 1,
        "F8_E4M3": 1,
        "F8_E5M2": 1,
        "U16": 2,
        "I16": 2,
        "F16": 2,
        "BF16": 2,
        "U32": 4,
        "I32": 4,
        "F32": 4,
        "U64": 8,
        "I64": 8,
        "F64": 8,
    }
)
MAX_HEADER_BYTES = 100 * 2**20


def read_header_bytes(path: str | Path) -> bytes:
    """The raw JSON header of the safetensors file ``path`` (checked for a plausible length); no tensor is read."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path} is not a safetensors file: header length {length} is implausible")
        return f.read(length)


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets); no tensor is read."""
    text = read_header_bytes(path)
    try:
        header: dict[str, Any] = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON") from exc
    header.pop("__metadata__", None)
    return header


def _tensor_bytes(name: str, entry: dict[str, Any]) -> int:
    offsets = entry.get("data_offsets")
    if isinstance(offsets, list) and len(offsets) == 2:  # pyright: ignore[reportUnknownArgumentType]
        return int(offsets[1]) - int(offsets[0])  # pyright: ignore[reportUnknownArgumentType]
    count = 1
    for d in entry["shape"]:
        count *= int(d)
    return count * SAFETENSORS_ITEM_BYTES[entry["dtype"]]


def _num_layers(config: dict[str, Any]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            value = source.get(key)
            if isinstance(value, int):
                return value
    return None


def model_bytes_from_dir(path: str | Path) -> ModelBytes:
    """Per-layer and fixed parameter bytes of an mlx-lm model directory, from its safetensors headers.

    Reads ``config.json`` for the layer count and every ``model*.safetensors``
    header (as mlx-lm's loader globs them); no tensor data is read. See
    :func:`model_bytes_from_headers` for how tensors are attributed.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a model directory")
    return model_bytes_from_headers(read_dir_headers(root), read_dir_config(root), str(root))


def read_dir_headers(root: Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry (dtype, shape, data_offsets) across ``root``'s ``model*.safetensors`` files."""
    files = sorted(root.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors files in {root}")
    headers: dict[str, dict[str, Any]] = {}
    for file in files:
        headers.update(read_safetensors_header(file))
    return headers


def read_dir_config(root: Path) -> dict[str, Any]:
    """``root/config.json`` as a dict (empty when the folder has none)."""
    config_path = root / "config.json"
    return json.loads(config_path.read_text()) if config_path.exists() else {}


def model_bytes_from_headers(headers: dict[str, dict[str, Any]], config: dict[str, Any], where: str) -> ModelBytes:
    """Per-layer and fixed parameter bytes from safetensors header entries (tensor name -> dtype, shape, offsets).

    A tensor belongs to layer ``i`` when its name has ``layers.i.`` (or ``h.i.``,
    ``blocks.i.``) under the prefix holding the decoder layers; layers past the
    config's count (multi-token-prediction heads that mlx-lm drops) are not
    counted. The head is tied when no ``lm_head``/``output`` tensor exists.
    ``where`` names the model in errors (a folder, or a Hub repo id).
    """
    sizes = {name: _tensor_bytes(name, entry) for name, entry in headers.items()}
    per_prefix: dict[str, dict[int, int]] = {}
    outside: dict[str, int] = {}
    for name, size in sizes.items():
        match = LAYER_NAME.match(name)
        if match is None:
            outside[name] = size
            continue
        layers = per_prefix.setdefault(match.group(1), {})
        index = int(match.group(2))
        layers[index] = layers.get(index, 0) + size
    if not per_prefix:
        raise ValueError(f"no decoder layer weights (names with 'layers.N.') in the safetensors files of {where}")
    prefix = max(per_prefix, key=lambda p: len(per_prefix[p]))
    decoder = per_prefix.pop(prefix)
    count = _num_layers(config) or max(decoder) + 1
    missing = sorted(set(range(count)) - set(decoder))
    if missing:
        raise ValueError(f"{where}: the safetensors files hold no weights for layers {missing} of {count}")
    for other in per_prefix.values():  # other stacks of layers (a vision tower, ...): fixed weights
        outside[f"<other layers {len(other)}>"] = sum(other.values())
    embedding = sum(s for n, s in outside.items() if EMBEDDING_NAME.search(n))
    head = sum(s for n, s in outside.items() if not EMBEDDING_NAME.search(n))
    tied = not any(HEAD_NAME.search(n) for n in outside)
    return ModelBytes(tuple(decoder[i] for i in range(count)), embedding, head, tied)


def decoder_prefix(names: Iterable[str]) -> str | None:
    """The prefix under which the decoder layers' tensors are named (``model`` in ``model.layers.3.mlp``).

    The prefix holding the most numbered layers, as :func:`model_bytes_from_headers` decides; ``None`` when no
    name has ``layers.N.``.
    """
    per_prefix: dict[str, set[int]] = {}
    for name in names:
        match = LAYER_NAME.match(name)
        if match is not None:
            per_prefix.setdefault(match.group(1), set()).add(int(match.group(2)))
    return max(per_prefix, key=lambda p: len(per_prefix[p])) if per_prefix else None
