"""Bad input gets a clear error naming the problem, before anything is sent or queued."""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import run_ranks
from fakes import FakeGroup, sharded_tiny, tokens
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.runtime.caches import quantized_dims
from pipemlx.runtime.prefill import check_kv_quantization
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


@pytest.mark.parametrize(
    "prompt,kwargs,error,words",
    [
        (mx.array([], dtype=mx.int32), {}, ValueError, "the prompt is empty"),
        (mx.array([[1, 2, 3]]), {}, ValueError, r"prompt must be 1-D \(M tokens\), got shape \(1, 3\)"),
        (mx.array([1.0, 2.0]), {}, TypeError, "prompt must hold integer token ids, got dtype mlx.core.float32"),
        ([1, 2, 3], {}, TypeError, "prompt must be an mx.array of token ids, got list"),
        (tokens(9), {"prefill_step_size": 0}, ValueError, "prefill_step_size must be at least 1 or 'auto', got 0"),
        (tokens(9), {"prefill_step_size": -2}, ValueError, "prefill_step_size must be at least 1 or 'auto', got -2"),
        (tokens(9), {"prefill_step_size": 4.0}, TypeError, "prefill_step_size must be an int or 'auto', got float 4.0"),
        (tokens(9), {"step_size": 4}, TypeError, "'step_size', renamed 'prefill_step_size'"),
        (tokens(9), {"progress_callback": None}, TypeError, "'progress_callback', renamed 'prompt_progress_callback'"),
        (tokens(9), {"timeout": 0}, ValueError, "timeout must be a positive number"),
        # MLX's own error came from the first rank to quantize, mid-prefill, and the others stopped with
        # PrefillCancelled; a group size of 0 killed the process (SIGFPE).
        (tokens(9), {"kv_bits": 4, "kv_group_size": 16}, ValueError, "kv_bits=4, kv_group_size=16: .*group size 16"),
        (tokens(9), {"kv_bits": 7}, ValueError, "kv_bits=7, kv_group_size=64: .*number of bits 7"),
        (tokens(9), {"kv_bits": 4, "kv_group_size": 0}, ValueError, "kv_group_size must be a positive int, got 0"),
        # MLX takes group size 32, but the tiny llama's heads are 16 wide: the first rank to quantize failed.
        (
            tokens(9),
            {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0},
            ValueError,
            r"kv_bits=4, kv_group_size=32: kv_group_size must divide the model's head dimension \(16\)",
        ),
    ],
)
def test_bad_prefill_arguments(prompt: Any, kwargs: dict[str, Any], error: type[Exception], words: str) -> None:
    model = sharded_tiny(rank=1, size=2)
    stage = stage_of(model)
    with pytest.raises(error, match=words):
        pipemlx.pipeline_prefill(model, prompt, make_prompt_cache(model), **kwargs)
    assert stage.mode == "immediate" and len(stage.send_queue) == 0 and stage.received == []


@pytest.mark.parametrize("size", [0, -4, 2.5, True])
def test_bad_max_kv_size_is_named_before_anything_runs(size: Any) -> None:
    model = sharded_tiny(rank=0, size=2)
    with pytest.raises(ValueError, match=f"max_kv_size must be a positive int or None, got {size!r}"):
        pipemlx.generate_step(tokens(9), model, max_kv_size=size)
    assert len(stage_of(model).send_queue) == 0


@pytest.mark.parametrize(
    "group_size,words",
    [(16, "group size 16"), (32, r"must divide the model's head dimension \(16\), and 32 does not divide 16")],
)
def test_bad_kv_quantization_is_named_before_anything_runs(group_size: int, words: str) -> None:
    model = sharded_tiny(rank=0, size=2)
    with pytest.raises(
        ValueError, match=f"cannot quantize the KV cache with kv_bits=4, kv_group_size={group_size}: .*{words}"
    ):
        pipemlx.generate_step(tokens(9), model, kv_bits=4, kv_group_size=group_size)
    assert len(stage_of(model).send_queue) == 0


@pytest.mark.parametrize(
    "arch,rank,split,dims",
    [
        ("llama", 0, None, (16,)),
        ("deepseek_v3", 1, None, (8, 32)),  # latent keys 32 wide, rope values 8
        ("lfm2", 0, [1, 4], (16,)),  # rank 0 holds a convolution only: the attention layers' width still counts
        ("falcon_h1", 0, None, ()),  # a CacheList per layer, which mlx-lm never quantizes
    ],
)
def test_every_rank_knows_the_whole_models_kv_widths(
    arch: str, rank: int, split: list[int] | None, dims: tuple[int, ...]
) -> None:
    """So that a kv_group_size that fits no rank's heads is refused on every rank, whatever layers it holds."""
    model = pipemlx.shard_model(build_model(tiny_config(arch)), FakeGroup(rank, 2), lend="none", split=split)  # type: ignore[arg-type]
    assert stage_of(model).info.kv_dims == dims
    if dims:
        with pytest.raises(ValueError, match=f"does not divide {min(dims)}"):
            pipemlx.pipeline_prefill(model, tokens(9), make_prompt_cache(model), kv_bits=4, kv_group_size=128)


def test_cache_of_the_wrong_length_is_named() -> None:
    model = sharded_tiny(rank=0, size=2)
    full = make_prompt_cache(build_model(tiny_config("llama")))
    with pytest.raises(ValueError, match=r"one entry per local layer \(3 on rank 0/2 \(layers 0..2 of 6\)\)"):
        pipemlx.pipeline_prefill(model, tokens(9), full)


@pytest.mark.parametrize(
    "split,error,words",
    [
        ([2, 2, 2], ValueError, "has 3 entries but the group has 2 ranks"),
        ([6, 0], ValueError, "gives a rank no layers"),
        ([4, 4], ValueError, "adds up to 8 layers but the model has 6"),
    ],
)
def test_bad_split_leaves_the_model_untouched(split: list[int], error: type[Exception], words: str) -> None:
    model = build_model(tiny_config("llama"))
    layers_before = list(model.layers)
    with pytest.raises(error, match=words):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none", split=split)  # type: ignore[arg-type]
    assert list(model.layers) == layers_before
    with pytest.raises(pipemlx.NotShardedError):
        stage_of(model)


def test_numpy_split_is_accepted() -> None:
    model = pipemlx.shard_model(
        build_model(tiny_config("llama")), FakeGroup(1, 2), lend="none", split=[np.int64(4), np.int64(2)]
    )  # type: ignore[arg-type]
    assert stage_of(model).info.split == (4, 2)
    assert len(model.layers) == 2


def test_more_ranks_than_layers() -> None:
    model = build_model(tiny_config("llama", num_hidden_layers=2))
    with pytest.raises(ValueError, match="more ranks than layers: 3 ranks cannot share 2 layers"):
        pipemlx.shard_model(model, FakeGroup(0, 3), lend="none")  # type: ignore[arg-type]
    assert len(model.layers) == 2


def test_sharding_twice_is_refused() -> None:
    model = sharded_tiny()
    with pytest.raises(pipemlx.PipelineError, match="already sharded"):
        pipemlx.shard_model(model, FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]


def test_bad_input_fails_alike_on_every_real_rank() -> None:
    """On 2 real ranks each bad call raises the same error on both, and a good call still works after."""
    reports = run_ranks(2, "bad_input.py", {}, timeout=60)
    assert reports[0]["errors"] == reports[1]["errors"]
    kinds = ["ValueError", "ValueError", "TypeError", "ValueError", *["PipelineMismatchError"] * 3]
    assert [e.split(":")[0] for e in reports[0]["errors"]] == kinds
    assert "kv_group_size must divide the model's head dimension (16)" in reports[0]["errors"][3]
    assert "ranks disagree on lend_mlp: rank 0: 1, rank 1: 0" in reports[0]["errors"][4]
    assert "ranks disagree on lend_heads: rank 0: 1, rank 1: 0" in reports[0]["errors"][5]
    sampler_on_one = "ranks disagree on decode_settings: rank 0: share_logprobs=False, rank 1: share_logprobs=False "
    assert sampler_on_one + "with a sampler or logits processors" in reports[0]["errors"][6], reports[0]["errors"]
    assert reports[0]["tokens_after"] == reports[1]["tokens_after"] == reports[0]["reference"]
    # kv_bits with a sliding-window layer on rank 1 only: pipeline_prefill, generate_step and stream_generate
    # raise the same ValueError on both ranks before anything is sent, and the next request works.
    rotating = [r["rotating"] for r in reports]
    assert rotating[0]["errors"][:3] == rotating[1]["errors"][:3]
    for error in rotating[0]["errors"][:3]:
        assert re.match("ValueError: " + ROTATING_REFUSED, error), error
    assert rotating[0]["tokens_after"] == rotating[1]["tokens_after"] == rotating[0]["reference"]
    # A given cache with rotating caches on rank 1 only: refused at the handshake, rank 0 told who refused.
    assert rotating[1]["errors"][3].startswith("ValueError: cannot quantize the KV cache with kv_bits=4: the cache")
    assert rotating[0]["errors"][3].startswith("PrefillCancelled: prefill stopped on rank 0/2"), rotating[0]
    assert "at the handshake: rank(s) [1] raised an error" in rotating[0]["errors"][3]
    assert rotating[0]["given_cache_after"] == rotating[1]["given_cache_after"]


def test_a_model_that_cannot_be_probed_keeps_the_plain_check() -> None:
    class Unrunnable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(4, 4), nn.Linear(4, 4)]

        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            raise RuntimeError("this model needs more than token ids")

    assert quantized_dims(Unrunnable()) == ()
    check_kv_quantization(4, 32, ())  # MLX takes it; nothing known to refuse it by


# head_dim 64, which kv_group_size 64 fits; only layer 5 (rank 1's, of 2) keeps a sliding-window cache.
WIDE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
ONE_SLIDING = {**WIDE, "sliding_window": 4, "layer_types": ["full_attention"] * 5 + ["sliding_attention"]}
ROTATING_REFUSED = (
    r"cannot quantize the KV cache with kv_bits=4: layer 5 of 6 keeps a RotatingKVCache \(a sliding window\), "
    r"which mlx-lm cannot quantize either \(RotatingKVCache.to_quantized raises NotImplementedError"
)


def _word_tokenizer(path: Any) -> Any:
    from mlx_lm.utils import load_tokenizer  # pyright: ignore[reportUnknownVariableType]

    from pipemlx.testing import write_tokenizer

    write_tokenizer(path, 256)
    return load_tokenizer(path)  # pyright: ignore[reportUnknownVariableType]


@pytest.mark.parametrize("rank", [0, 1])  # rank 0 holds no sliding layer, and must refuse all the same
@pytest.mark.parametrize("call", ["pipeline_prefill", "generate_step", "stream_generate"])
def test_kv_bits_with_a_sliding_window_layer_is_refused_on_every_rank(rank: int, call: str, tmp_path: Any) -> None:
    """mlx-lm's RotatingKVCache cannot be quantized: it failed mid-prefill, on the ranks holding one only.

    Refused even for a prompt of 3 tokens that never reaches quantized_kv_start (the default 5000).
    """
    model = pipemlx.shard_model(build_model(tiny_config("llama", **ONE_SLIDING)), FakeGroup(rank, 2), lend="none")  # type: ignore[arg-type]
    stage = stage_of(model)
    prompt = tokens(3)
    with pytest.raises(ValueError, match=ROTATING_REFUSED):
        if call == "pipeline_prefill":
            pipemlx.pipeline_prefill(model, prompt, make_prompt_cache(model), kv_bits=4)
        elif call == "generate_step":
            pipemlx.generate_step(prompt, model, kv_bits=4)
        else:
            pipemlx.stream_generate(model, _word_tokenizer(tmp_path), prompt, kv_bits=4)
    assert stage.mode == "immediate" and len(stage.send_queue) == 0 and stage.received == []
    assert stage.info.unquantizable == ((5, "RotatingKVCache"),)
    # without kv_bits the same model decodes as mlx-lm does (one real rank: the whole model)
    whole = pipemlx.shard_model(build_model(tiny_config("llama", **ONE_SLIDING)), mx.distributed.init())
    assert_decodes_as_mlx_lm(whole, tiny_config("llama", **ONE_SLIDING), tokens(9), {})


def test_kv_bits_with_max_kv_size_is_refused_when_it_makes_rotating_caches() -> None:
    """qwen2 makes no caches of its own: max_kv_size gives every layer a RotatingKVCache (llama's make_cache ignores it)."""
    model = pipemlx.shard_model(build_model(tiny_config("qwen2", hidden_size=256)), FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"kv_bits=4: max_kv_size=64 gives every layer a RotatingKVCache, which mlx-lm"
    ):
        pipemlx.generate_step(tokens(9), model, kv_bits=4, max_kv_size=64)
    assert len(stage_of(model).send_queue) == 0
    # Either alone is accepted, and decodes as mlx-lm does: the caches rotate (max_kv_size 8 < 20 positions),
    # or are quantized from the start. One real rank holds the whole model.
    qwen2 = tiny_config("qwen2", hidden_size=256)
    one = pipemlx.shard_model(build_model(qwen2), mx.distributed.init())
    prompt = tokens(14)
    assert_decodes_as_mlx_lm(one, qwen2, prompt, {"max_kv_size": 8})
    assert_decodes_as_mlx_lm(one, qwen2, prompt, {"kv_bits": 4, "quantized_kv_start": 0})
    llama = pipemlx.shard_model(build_model(tiny_config("llama", **WIDE)), FakeGroup(0, 2), lend="none")  # type: ignore[arg-type]
    assert stage_of(llama).info.unquantizable_bounded == ()
    # llama makes its own caches (mlx-lm ignores max_kv_size for it): both together decode as mlx-lm's
    whole = pipemlx.shard_model(build_model(tiny_config("llama", **WIDE)), mx.distributed.init())
    assert_decodes_as_mlx_lm(whole, tiny_config("llama", **WIDE), prompt, {"kv_bits": 4, "max_kv_size": 8,
                                                                          "quantized_kv_start": 0})  # fmt: skip


def assert_decodes_as_mlx_lm(model: Any, config: dict[str, Any], prompt: mx.array, kwargs: dict[str, Any]) -> None:
    """pipemlx.generate_step with ``kwargs`` yields single-process mlx-lm's tokens and logprobs on the same weights."""
    from mlx_lm.generate import generate_step

    got = list(pipemlx.generate_step(prompt, model, max_tokens=6, prefill_step_size=4, **kwargs))
    expected = list(generate_step(prompt, build_model(config), max_tokens=6, prefill_step_size=4, **kwargs))
    assert [int(t) for t, _ in got] == [int(t) for t, _ in expected], kwargs
    assert len({int(t) for t, _ in expected}) > 1, expected  # a model that repeats one token would show nothing
    for (_, lp), (_, ref) in zip(got, expected):
        assert lp is not None and mx.allclose(lp, ref, atol=1e-4).item(), kwargs


def test_kv_bits_on_a_given_rotating_cache_is_refused_at_the_handshake() -> None:
    """A cache list made with max_kv_size: refused at the handshake, before any chunk; the next request works."""
    model = pipemlx.shard_model(build_model(tiny_config("qwen2", hidden_size=256)), mx.distributed.init())  # one rank
    prompt = tokens(12)
    cache = make_prompt_cache(model, max_kv_size=64)
    with pytest.raises(ValueError, match=r"the cache given on rank 0/1 .* holds a RotatingKVCache for layers 0, 1, 2"):
        pipemlx.pipeline_prefill(model, prompt, cache, prefill_step_size=4, kv_bits=4, quantized_kv_start=0)
    assert [c.offset for c in cache] == [0] * 5
    with pytest.raises(ValueError, match="the cache given on rank 0/1"):
        rotating = make_prompt_cache(model, max_kv_size=64)
        next(pipemlx.generate_step(prompt, model, prompt_cache=rotating, kv_bits=4, prefill_step_size=4))
    step = {"prefill_step_size": 4}  # (not "auto": its calibration is not what this test is about)
    expected = [t for t, _ in pipemlx.generate_step(prompt, model, max_tokens=3, **step)]
    assert [t for t, _ in pipemlx.generate_step(prompt, model, prompt_cache=cache, max_tokens=3, **step)] == expected
