"""Header-only model folders: config.json and a safetensors header with no tensor data, for planning big models.

``pipemlx split`` reads only the headers, so a 70B model can be planned from a folder of a few kilobytes.
``llama_3_1_70b(path, bits)`` writes Llama-3.1-70B-Instruct's config.json values (below, as published with the
model) and the tensor list mlx-lm's llama holds for it: bfloat16, or quantized like the mlx-community
checkpoints (uint32-packed weights, bfloat16 scales and biases per group of 64).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

LLAMA_3_1_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _linear(name: str, out_features: int, in_features: int, bits: int | None) -> dict[str, tuple[str, list[int]]]:
    if bits is None:
        return {f"{name}.weight": ("BF16", [out_features, in_features])}
    return {
        f"{name}.weight": ("U32", [out_features, in_features * bits // 32]),
        f"{name}.scales": ("BF16", [out_features, in_features // 64]),
        f"{name}.biases": ("BF16", [out_features, in_features // 64]),
    }


def llama_3_1_70b(path: str | Path, bits: int | None = 4) -> Path:
    """Write the header-only folder; ``bits=None`` for bfloat16 weights."""
    c = LLAMA_3_1_70B
    h, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    tensors: dict[str, tuple[str, list[int]]] = {}
    tensors.update(_linear("model.embed_tokens", c["vocab_size"], h, bits))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, out_f, in_f in (
            ("self_attn.q_proj", h, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, h),
            ("mlp.gate_proj", inter, h),
            ("mlp.up_proj", inter, h),
            ("mlp.down_proj", h, inter),
        ):
            tensors.update(_linear(f"{p}.{name}", out_f, in_f, bits))
        tensors[f"{p}.input_layernorm.weight"] = ("BF16", [h])
        tensors[f"{p}.post_attention_layernorm.weight"] = ("BF16", [h])
    tensors["model.norm.weight"] = ("BF16", [h])
    tensors.update(_linear("lm_head", c["vocab_size"], h, bits))
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = {"BF16": 2, "U32": 4}[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)  # the header only: no data
    config = dict(c)
    if bits is not None:
        config["quantization"] = {"group_size": 64, "bits": bits}
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return root
