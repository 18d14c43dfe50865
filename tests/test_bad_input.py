"""Bad input gets a clear error naming the problem, before anything is sent or queued."""

from __future__ import annotations

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
from pipemlx.testing import build_model, tiny_config


@pytest.mark.parametrize(
    "prompt,kwargs,error,words",
    [
        (mx.array([], dtype=mx.int32), {}, ValueError, "the prompt is empty"),
        (mx.array([[1, 2, 3]]), {}, ValueError, r"prompt must be 1-D \(M tokens\), got shape \(1, 3\)"),
        (mx.array([1.0, 2.0]), {}, TypeError, "prompt must hold integer token ids, got dtype mlx.core.float32"),
        ([1, 2, 3], {}, TypeError, "prompt must be an mx.array of token ids, got list"),
        (tokens(9), {"step_size": 0}, ValueError, "step_size must be at least 1, got 0"),
        (tokens(9), {"step_size": -2}, ValueError, "step_size must be at least 1, got -2"),
        (tokens(9), {"step_size": 4.0}, TypeError, "step_size must be an int, got float 4.0"),
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
    stage = pipemlx.stage_of(model)
    with pytest.raises(error, match=words):
        pipemlx.pipeline_prefill(model, prompt, make_prompt_cache(model), **kwargs)
    assert stage.mode == "immediate" and len(stage.send_queue) == 0 and stage.received == []


@pytest.mark.parametrize("size", [0, -4, 2.5, True])
def test_bad_max_kv_size_is_named_before_anything_runs(size: Any) -> None:
    model = sharded_tiny(rank=0, size=2)
    with pytest.raises(ValueError, match=f"max_kv_size must be a positive int or None, got {size!r}"):
        pipemlx.generate_step(tokens(9), model, max_kv_size=size)
    assert len(pipemlx.stage_of(model).send_queue) == 0


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
    assert len(pipemlx.stage_of(model).send_queue) == 0


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
    model = pipemlx.shard_model(build_model(tiny_config(arch)), FakeGroup(rank, 2), split=split)  # type: ignore[arg-type]
    assert pipemlx.stage_of(model).kv_dims == dims
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
        pipemlx.shard_model(model, FakeGroup(0, 2), split=split)  # type: ignore[arg-type]
    assert list(model.layers) == layers_before
    with pytest.raises(pipemlx.NotShardedError):
        pipemlx.stage_of(model)


def test_numpy_split_is_accepted() -> None:
    model = pipemlx.shard_model(build_model(tiny_config("llama")), FakeGroup(1, 2), split=[np.int64(4), np.int64(2)])  # type: ignore[arg-type]
    assert pipemlx.stage_of(model).split == (4, 2)
    assert len(model.layers) == 2


def test_more_ranks_than_layers() -> None:
    model = build_model(tiny_config("llama", num_hidden_layers=2))
    with pytest.raises(ValueError, match="more ranks than layers: 3 ranks cannot share 2 layers"):
        pipemlx.shard_model(model, FakeGroup(0, 3))  # type: ignore[arg-type]
    assert len(model.layers) == 2


def test_sharding_twice_is_refused() -> None:
    model = sharded_tiny()
    with pytest.raises(pipemlx.PipelineError, match="already sharded"):
        pipemlx.shard_model(model, FakeGroup(0, 2))  # type: ignore[arg-type]


def test_bad_input_fails_alike_on_every_real_rank() -> None:
    """On 2 real ranks each bad call raises the same error on both, and a good call still works after."""
    reports = run_ranks(2, "bad_input.py", {}, timeout=60)
    assert reports[0]["errors"] == reports[1]["errors"]
    kinds = ["ValueError", "ValueError", "TypeError", "ValueError", "PipelineMismatchError"]
    assert [e.split(":")[0] for e in reports[0]["errors"]] == kinds
    assert "kv_group_size must divide the model's head dimension (16)" in reports[0]["errors"][3]
    assert "ranks disagree on lend_mlp: rank 0: 1, rank 1: 0" in reports[0]["errors"][4]
    assert reports[0]["tokens_after"] == reports[1]["tokens_after"] == reports[0]["reference"]


def test_a_model_that_cannot_be_probed_keeps_the_plain_check() -> None:
    class Unrunnable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(4, 4), nn.Linear(4, 4)]

        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            raise RuntimeError("this model needs more than token ids")

    assert quantized_dims(Unrunnable()) == ()
    check_kv_quantization(4, 32, ())  # MLX takes it; nothing known to refuse it by
