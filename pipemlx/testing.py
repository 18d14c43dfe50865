"""Tiny random-weight mlx-lm models, built from a config: for tests and benchmarks, not the runtime.

Nothing in the runtime (``shard_model``, ``pipeline_prefill``, ...) uses this module; the
tests, ``benchmarks/`` and the architecture checks do (``tiny_config(arch)`` for each
architecture pipemlx supports).

No model hub is needed. Weights are drawn from a seeded generator, so every
process that builds the same config with the same seed holds the same model.
2-D weights are scaled up (normal x 0.15) so that greedy decoding of a random
model does not collapse onto one repeated token.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten  # pyright: ignore[reportUnknownVariableType]

TINY_DIMENSIONS: Mapping[str, int] = MappingProxyType(
    {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
)
"""The dimensions most tiny configs share; a config lists only what differs."""


def _configs() -> dict[str, dict[str, Any]]:
    configs: dict[str, dict[str, Any]] = {
        "llama": {
            "model_type": "llama",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 6,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        "qwen3": {
            "model_type": "qwen3",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 6,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        },
        # Families added for the architecture matrix (tests/test_architectures.py).
        "llama_swa": {  # llama with sliding-window layers: layer_types, fa_idx/swa_idx
            "model_type": "llama",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 6,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        },
        "mistral": {
            "model_type": "mistral",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 5,
            "intermediate_size": 160,
            "num_attention_heads": 8,
            "head_dim": 8,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
        "qwen2": {
            "model_type": "qwen2",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 5,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        "qwen3_moe": {
            "model_type": "qwen3_moe",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "moe_intermediate_size": 32,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 4096,
            "norm_topk_prob": True,
        },
        "gemma2": {
            "model_type": "gemma2",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 16,
        },
        "gemma3_text": {  # sliding window 4 and a global layer every 3: rotating caches matter
            "model_type": "gemma3_text",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 6,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 16,
            "sliding_window": 4,
            "sliding_window_pattern": 3,
        },
        "gemma3": {  # the multimodal wrapper (text only here) around gemma3_text: layers under language_model
            "model_type": "gemma3",
            "vocab_size": 256,
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 64,
                "num_hidden_layers": 5,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "rms_norm_eps": 1e-6,
                "query_pre_attn_scalar": 16,
                "sliding_window": 3,
                "sliding_window_pattern": 2,
            },
        },
        "phi3": {
            "model_type": "phi3",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096,
        },
        "gpt_oss": {  # alternating sliding (window 4) and full attention, attention sinks, MoE
            "model_type": "gpt_oss",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 6,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "sliding_window": 4,
            "rms_norm_eps": 1e-5,
            "rope_theta": 150000,
        },
        "deepseek_v3": {  # multi-head latent attention, a dense first layer, routed + shared experts
            "model_type": "deepseek_v3",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "moe_intermediate_size": 32,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "rms_norm_eps": 1e-6,
        },
        "qwen3_next": {  # gated-delta linear attention (ArraysCache) with a full-attention layer every 2
            "model_type": "qwen3_next",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [],
            "moe_intermediate_size": 32,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 4096,
            "full_attention_interval": 2,
            "tie_word_embeddings": False,
        },
        "lfm2": {  # short convolutions (ArraysCache) and attention layers
            "model_type": "lfm2",
            "hidden_size": 64,
            "num_hidden_layers": 5,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": 64,
            "block_ff_dim": 128,
            "block_multiple_of": 32,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "vocab_size": 256,
            "layer_types": ["conv", "full_attention", "conv", "conv", "full_attention"],
        },
        "falcon_h1": {  # Mamba-2 and attention in every layer: CacheList(ArraysCache, KVCache)
            "model_type": "falcon_h1",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "mamba_d_conv": 4,
            "mamba_d_head": 16,
            "mamba_d_ssm": 64,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_n_heads": 4,
            "mamba_chunk_size": 16,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
        },
        "nemotron_h": {  # Mamba, attention and MLP blocks; the MLP blocks hold no cache
            "model_type": "nemotron_h",
            **TINY_DIMENSIONS,
            "max_position_embeddings": 4096,
            "head_dim": 16,
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": ["M", "-", "*", "M", "-", "*"],
        },
        # Families registered with no adjustments (a plain layer list; the mask from cache[0]).
        "mixtral": {  # sparse MoE in every layer
            "model_type": "mixtral",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-5,
        },
        "gemma": {
            "model_type": "gemma",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
        },
        "phi": {  # partial rotary, parallel attention and MLP, LayerNorm
            "model_type": "phi",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "num_key_value_heads": 4,
            "partial_rotary_factor": 0.5,
            "layer_norm_eps": 1e-5,
        },
        "starcoder2": {
            "model_type": "starcoder2",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "norm_epsilon": 1e-5,
            "tie_word_embeddings": True,
        },
        "olmo2": {
            "model_type": "olmo2",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        "granite": {  # embedding, attention, residual and logit multipliers
            "model_type": "granite",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-5,
            "logits_scaling": 2.0,
            "attention_multiplier": 0.25,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "max_position_embeddings": 4096,
            "attention_bias": False,
            "mlp_bias": False,
            "rope_theta": 10000.0,
        },
        "qwen2_moe": {  # routed experts plus a gated shared expert
            "model_type": "qwen2_moe",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "rms_norm_eps": 1e-6,
        },
        "deepseek": {  # v1: a dense first layer, then routed + shared experts
            "model_type": "deepseek",
            **TINY_DIMENSIONS,
            "num_hidden_layers": 4,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "rms_norm_eps": 1e-6,
        },
    }
    configs["deepseek_v2"] = {  # multi-head latent attention (as deepseek_v3's), group-limited routing, PipelineMixin
        **configs["deepseek_v3"],
        "model_type": "deepseek_v2",
        "topk_method": "group_limited_greedy",
        "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 2048},
    }
    # nemotron-h of Mamba and attention blocks only: this one pipelines.
    configs["nemotron_h_mamba_attention"] = {
        **configs["nemotron_h"],
        "hybrid_override_pattern": ["M", "*", "M", "M", "*", "M"],
    }
    return configs


BASE_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType(_configs())
WEIGHT_SCALE = 0.15


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """A small config for mlx-lm architecture ``arch``, with ``overrides`` applied."""
    if arch not in BASE_CONFIGS:
        raise ValueError(f"no tiny config for {arch!r}; known: {sorted(BASE_CONFIGS)}")
    # A deep copy: some ModelArgs (gemma3's) write into nested dicts of their config.
    return copy.deepcopy({**BASE_CONFIGS[arch], **overrides})


def model_classes(config: Mapping[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's ``Model`` and ``ModelArgs`` classes for ``config['model_type']`` (``mistral`` is llama's)."""
    from mlx_lm.utils import MODEL_REMAPPING  # pyright: ignore[reportUnknownVariableType]

    model_type = str(config["model_type"])
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    return module.Model, module.ModelArgs


def build_model(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """The mlx-lm ``Model`` for ``config`` with seeded random weights, evaluated."""
    model_class, args_class = model_classes(config)
    # Weights the loop below keeps (biases, norms, state-space constants) come
    # from the modules' own initialisers: seed them too, or processes differ.
    mx.random.seed(seed)
    model: nn.Module = model_class(args_class.from_dict(config))
    key = mx.random.key(seed)
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # pyright: ignore[reportAssignmentType]
    keys = mx.random.split(key, len(params))
    drawn = [
        (name, (mx.random.normal(p.shape, key=keys[i]) * WEIGHT_SCALE).astype(p.dtype) if p.ndim >= 2 else p)
        for i, (name, p) in enumerate(params)
    ]
    model.update(tree_unflatten(drawn))  # pyright: ignore[reportArgumentType, reportUnknownMemberType]
    mx.eval(model.parameters())  # pyright: ignore[reportUnknownMemberType]
    return model


def write_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) over ``vocab_size`` ids.

    Words ``t0`` ... ``t{n-1}`` are the ids; mlx-lm's ``load_tokenizer`` reads it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # pyright: ignore[reportMissingTypeStubs]

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))  # pyright: ignore[reportUnknownMemberType]
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # pyright: ignore[reportUnknownMemberType, reportAttributeAccessIssue]
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # pyright: ignore[reportUnknownMemberType, reportAttributeAccessIssue]
    tokenizer.save(str(root / "tokenizer.json"))  # pyright: ignore[reportUnknownMemberType]
    (root / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<unk>"})
    )


def save_model_dir(
    model: nn.Module,
    config: Mapping[str, Any],
    path: str | Path,
    *,
    shards: int = 1,
    index: bool = True,
) -> Path:
    """Save ``model`` as an mlx-lm model directory: ``config.json``, weights, tokenizer files.

    The weights go in ``shards`` safetensors files (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors``), with ``model.safetensors.index.json``
    when ``index``. mlx-lm's ``load``/``load_model`` and
    :func:`pipemlx.load_sharded` read it.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    weights: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # pyright: ignore[reportAssignmentType]
    if not 1 <= shards <= len(weights):
        raise ValueError(f"shards must be between 1 and the number of weights ({len(weights)}), got {shards}")
    per_file = -(-len(weights) // shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = dict(weights[i * per_file : (i + 1) * per_file])
        mx.save_safetensors(str(root / name), part, metadata={"format": "mlx"})  # pyright: ignore[reportUnknownMemberType]
        weight_map.update({k: name for k in part})
    if index:
        total = sum(w.nbytes for _, w in weights)
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1)
        )
    (root / "config.json").write_text(json.dumps(dict(config), indent=1))
    write_tokenizer(root, int(config.get("vocab_size", 256)))
    return root
