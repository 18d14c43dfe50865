"""Quantized KV caches (kv_bits, kv_group_size, quantized_kv_start) through pipeline_prefill and decode.

The tokens must equal single-device mlx-lm's generate_step with the same
settings. quantized_kv_start is small enough that the caches turn quantized
during the prefill (after some chunks, or from the first), or only during
decoding, and never for the last case.
"""

from __future__ import annotations

from conftest import run_ranks

RUNS = [
    {"M": 23, "step": 4, "kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 6},  # after chunk 2 of 6
    {"M": 18, "step": 5, "kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0},  # from the first chunk
    {"M": 5, "step": 4, "kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 6},  # only while decoding
    {"M": 9, "step": 4, "kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 500},  # never
]
MAX_TOKENS = 6


def test_quantized_kv_cache_matches_single_device() -> None:
    spec = {
        "arch": "llama",
        "config": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},  # head_dim 64
        "seed": 4,
        "max_tokens": MAX_TOKENS,
        "runs": RUNS,
    }
    reports = run_ranks(2, "kv_quant.py", spec, timeout=240)
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        for run, expected in zip(report["runs"], RUNS):
            where = f"rank {report['rank']}: {run}"
            assert run["tokens"] == run["ref_tokens"], where
            assert len(run["tokens"]) == MAX_TOKENS, where
            assert run["logprob_diff"] <= 1e-4, where
            assert run["after_decode"] == run["ref_after_decode"], where
            quantized_by_prefill = expected["M"] - 1 >= expected["quantized_kv_start"]
            assert set(run["after_prefill"]) == {"QuantizedKVCache" if quantized_by_prefill else "KVCache"}, where
            ends_quantized = expected["M"] - 1 + MAX_TOKENS > expected["quantized_kv_start"]
            assert set(run["after_decode"]) == {"QuantizedKVCache" if ends_quantized else "KVCache"}, where
    assert reports[0]["runs"][0]["tokens"] != reports[0]["runs"][0]["tokens"][:1] * MAX_TOKENS
