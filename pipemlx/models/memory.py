"""A model's :class:`~pipemlx.schedule.memory_model.MemoryModel` from its config (what each layer caches).

What each decoder layer caches is read from the config, per architecture
family, as mlx-lm's model classes decide it (their ``make_cache``):

- attention layers cache ``num_key_value_heads x head_dim`` keys and values
  per position; ``layer_types`` (``full_attention`` / ``sliding_attention``),
  gemma-3's ``sliding_window_pattern`` and gpt-oss's alternation choose the
  sliding-window layers (``sliding_window`` positions);
- deepseek-v3's (and kimi-k2's) multi-head latent attention caches
  ``kv_lora_rank + qk_rope_head_dim`` per position; deepseek-v2's caches the
  decompressed keys (``qk_nope_head_dim + qk_rope_head_dim``) and values
  (``v_head_dim``) of every head;
- qwen3-next's linear-attention layers (all but every
  ``full_attention_interval``-th), lfm2's convolution layers and the Mamba
  layers of nemotron-h and falcon-h1 hold a constant state.

``tests/test_memory_model.py`` checks these against the bytes mlx-lm's
caches really hold for every tiny model of :mod:`pipemlx.testing`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, cast

from ..schedule.memory_model import Activations, LayerCache, MemoryModel
from ..schedule.memory_split import ModelBytes
from .safetensors import (
    SAFETENSORS_ITEM_BYTES,
    model_bytes_from_headers,
    read_dir_config,
    read_dir_headers,
)

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
CONFIG_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _int(config: dict[str, Any], *names: str, default: int = 0) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` merged over the top level (multimodal wrappers)."""
    inner = config.get("text_config")
    return {**config, **cast(dict[str, Any], inner)} if isinstance(inner, dict) else dict(config)


APPROXIMATE_PEAK = {
    "gpt_oss": "attention sinks and expert routing",
    "deepseek_v2": "latent attention decompressed per head",
    "deepseek_v3": "latent attention decompressed per head",
    "kimi_k2": "latent attention decompressed per head",
    "falcon_h1": "the Mamba scan",
    "nemotron_h": "the Mamba scan",
}
"""Families whose chunk peak has more than the dense attention model counts (see docs/planning.md)."""


FULL_ATTENTION = frozenset(
    {"mistral", "llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2", "mixtral"}
    | {"phi", "starcoder2", "olmo2", "granite", "qwen2_moe", "deepseek"}
)
"""Families whose every layer caches ``num_key_value_heads x head_dim`` keys and values (no note needed)."""


def layer_caches(config: dict[str, Any]) -> tuple[tuple[LayerCache, ...], tuple[str, ...]]:
    """What each decoder layer caches, and notes on what is approximate."""
    caches, notes = _layer_caches(text_config(config))
    model_type = str(text_config(config).get("model_type", ""))
    if model_type in APPROXIMATE_PEAK:
        notes = (
            *notes,
            f"{model_type}: the chunk peak leaves out {APPROXIMATE_PEAK[model_type]} (up to 2x more); leave headroom",
        )
    return caches, notes


def _layer_caches(c: dict[str, Any]) -> tuple[tuple[LayerCache, ...], tuple[str, ...]]:
    model_type = str(c.get("model_type", ""))
    n = _int(c, "num_hidden_layers", "n_layer", "num_layers") or len(c.get("hybrid_override_pattern") or [])
    if n < 1:
        raise ValueError("the config gives no num_hidden_layers")
    heads = _int(c, "num_attention_heads", "n_head")
    kv_heads = _int(c, "num_key_value_heads", default=heads)
    hidden = _int(c, "hidden_size", "n_embd", "d_model")
    head_dim = _int(c, "head_dim", default=hidden // heads if heads else 0)
    window = _int(c, "sliding_window", default=0) or None
    notes: list[str] = []
    attention = LayerCache("full", kv_heads, head_dim, head_dim)
    sliding = LayerCache("sliding", kv_heads, head_dim, head_dim, window)

    if model_type in ("deepseek_v3", "kimi_k2"):
        latent = LayerCache("full", 1, _int(c, "kv_lora_rank"), _int(c, "qk_rope_head_dim"))
        return (latent,) * n, ()
    if model_type == "deepseek_v2":  # mlx-lm's v2 caches per-head keys and values, not the latent
        key = _int(c, "qk_nope_head_dim") + _int(c, "qk_rope_head_dim")
        return (LayerCache("full", heads, key, _int(c, "v_head_dim")),) * n, ()
    if model_type == "qwen3_next":
        interval = _int(c, "full_attention_interval", default=4)
        nk, nv = _int(c, "linear_num_key_heads"), _int(c, "linear_num_value_heads")
        dk, dv = _int(c, "linear_key_head_dim"), _int(c, "linear_value_head_dim")
        conv = (_int(c, "linear_conv_kernel_dim", default=4) - 1) * (2 * nk * dk + nv * dv)
        state = LayerCache("none", state_bytes=-(conv + nv * dv * dk))  # elements; bytes set below
        return tuple(attention if (i + 1) % interval == 0 else state for i in range(n)), ()
    if model_type == "lfm2":
        types = cast(list[str], c.get("layer_types") or [])
        conv = LayerCache("none", state_bytes=-((_int(c, "conv_L_cache", default=3) - 1) * hidden))
        return tuple(attention if t == "full_attention" else conv for t in types[:n]), ()
    if model_type in ("nemotron_h", "falcon_h1"):
        if model_type == "nemotron_h":
            mheads, mdim = _int(c, "mamba_num_heads"), _int(c, "mamba_head_dim")
            groups, state_size, kernel = (
                _int(c, "n_groups", default=1),
                _int(c, "ssm_state_size"),
                _int(c, "conv_kernel"),
            )
        else:
            mheads, mdim = _int(c, "mamba_n_heads"), _int(c, "mamba_d_head")
            groups, state_size, kernel = (
                _int(c, "mamba_n_groups", default=1),
                _int(c, "mamba_d_state"),
                _int(c, "mamba_d_conv", default=4),
            )
        inner = _int(c, "mamba_d_ssm", default=mheads * mdim) if model_type == "falcon_h1" else mheads * mdim
        elements = (kernel - 1) * (inner + 2 * groups * state_size) + mheads * mdim * state_size
        if model_type == "falcon_h1":
            return (LayerCache("full", kv_heads, head_dim, head_dim, state_bytes=-elements),) * n, ()
        pattern = cast(list[str], c.get("hybrid_override_pattern") or [])
        kinds = {"M": LayerCache("none", state_bytes=-elements), "*": attention, "-": LayerCache("none")}
        return tuple(kinds.get(p, attention) for p in pattern[:n]), ()
    if model_type == "gemma3_text" or (model_type == "gemma3" and "sliding_window_pattern" in c):
        pattern = _int(c, "sliding_window_pattern", default=6)
        return tuple(attention if i % pattern == pattern - 1 else sliding for i in range(n)), ()
    types = c.get("layer_types")
    if model_type == "gpt_oss" and not types:
        types = ["sliding_attention", "full_attention"] * (n // 2 + 1)
    if isinstance(types, list) and window:
        listed = cast(list[str], types)
        return tuple(sliding if t == "sliding_attention" else attention for t in listed[:n]), ()
    if model_type in FULL_ATTENTION:
        return (attention,) * n, ()
    notes.append(
        f"{model_type or 'this model'}: every layer counted as full attention ({kv_heads} KV heads x {head_dim})"
    )
    return (attention,) * n, tuple(notes)


def memory_model_from_config(config: dict[str, Any], model_bytes: ModelBytes, dtype_bytes: int) -> MemoryModel:
    """The memory model of a config whose parameter bytes are ``model_bytes``; activations of ``dtype_bytes``."""
    caches, notes = layer_caches(config)
    # State sizes were counted in elements (negative): they take the activation dtype.
    caches = tuple(
        LayerCache(x.kind, x.kv_heads, x.k_dim, x.v_dim, x.window, -x.state_bytes * dtype_bytes)
        if x.state_bytes < 0
        else x
        for x in caches
    )
    c = text_config(config)
    hidden = _int(c, "hidden_size", "n_embd", "d_model")
    heads = _int(c, "num_attention_heads", "n_head", default=1)
    intermediate = _int(c, "intermediate_size", "block_ff_dim", "moe_intermediate_size", default=4 * hidden)
    activations = Activations(hidden, intermediate, heads, dtype_bytes)
    max_context = _int(c, "max_position_embeddings", "max_sequence_length", "n_positions") or None
    return MemoryModel(model_bytes, caches, activations, max_context, notes)


def activation_dtype_bytes(headers: dict[str, dict[str, Any]], config: dict[str, Any]) -> int:
    """Bytes per activation element: the float dtype holding most parameters (scales of a quantized model).

    ``headers`` are the safetensors header entries of every tensor (name -> dtype, shape, data_offsets).
    """
    counts: Counter[str] = Counter()
    for entry in headers.values():
        dtype = str(entry.get("dtype"))
        if dtype in FLOAT_DTYPES:
            size = 1
            for d in entry.get("shape", []):
                size *= int(d)
            counts[dtype] += size
    if counts:
        return SAFETENSORS_ITEM_BYTES[counts.most_common(1)[0][0]]
    named = text_config(config).get("torch_dtype") or text_config(config).get("dtype")
    return CONFIG_DTYPES.get(str(named), 2)


def memory_model_from_headers(headers: dict[str, dict[str, Any]], config: dict[str, Any], where: str) -> MemoryModel:
    """The memory model of a model given its config and every tensor's safetensors header entry.

    ``where`` names the model in errors. What :func:`memory_model_from_dir` and a Hub repo's
    (:func:`pipemlx.models.hub.memory_model_of`) plans come from.
    """
    model_bytes = model_bytes_from_headers(headers, config, where)
    return memory_model_from_config(config, model_bytes, activation_dtype_bytes(headers, config))


def memory_model_from_dir(path: str | Path) -> MemoryModel:
    """The memory model of an mlx-lm model directory: safetensors headers and config.json, no tensor read."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a model directory")
    return memory_model_from_headers(read_dir_headers(root), read_dir_config(root), str(root))
