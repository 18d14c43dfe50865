"""The output head shared by vocabulary among the ranks (greedy decodes): rows, logits and the token picked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from fakes import FakeGroup

from pipemlx.errors import PipelineError
from pipemlx.models.loading import head_of_folder
from pipemlx.models.sharding import shard_model
from pipemlx.models.vocab_head import SplitEmbedding, SplitHead, resolve_head, row_range, vocab_shard
from pipemlx.runtime.sampling import VocabShard, pick_tokens
from pipemlx.runtime.stage import StageInfo, stage_of
from pipemlx.testing import build_model, tiny_config


def stage_at(rank: int, world_size: int, model: Any) -> StageInfo:
    """What :func:`vocab_shard` reads of a stage: its place, and the activations' width and dtype."""
    return info(rank, world_size, int(model.model.norm.weight.shape[0]))


def info(rank: int, world_size: int, hidden_size: int) -> StageInfo:
    return StageInfo(rank, world_size, (), range(0), 0, None, hidden_size, mx.float32)


def shards(model: Any, world_size: int) -> list[VocabShard]:
    found = [vocab_shard(model, stage_at(rank, world_size, model)) for rank in range(world_size)]
    assert all(s is not None for s in found)
    return cast(list[VocabShard], found)


@pytest.mark.parametrize(
    "arch,overrides,quantized",
    [
        ("qwen2", {"tie_word_embeddings": False}, False),
        ("qwen2", {"tie_word_embeddings": True}, False),
        ("llama", {"tie_word_embeddings": False}, True),
        ("qwen3", {"tie_word_embeddings": True}, True),
        ("gemma", {}, False),
    ],
)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rows_cover_the_vocabulary_once_and_give_the_whole_heads_logits(
    arch: str, overrides: dict[str, Any], quantized: bool, world_size: int
) -> None:
    model: Any = build_model(tiny_config(arch, **overrides), seed=3)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    found = shards(model, world_size)
    vocab = tiny_config(arch, **overrides)["vocab_size"]
    assert [r for s in found for r in s.rows] == list(range(vocab))
    hidden = mx.random.normal((3, found[0].hidden_size), key=mx.random.key(1))
    whole = found[0].full(hidden)
    assert whole.shape == (3, vocab)
    parts = mx.concatenate([s.project(hidden) for s in found], axis=-1)
    assert mx.array_equal(parts, whole).item()  # row by row the same computation: equal, not close


def test_the_head_is_the_models_head() -> None:
    """``full`` of the final hidden state is what the model's forward returns (tied and untied)."""
    for tied in (False, True):
        model: Any = build_model(tiny_config("qwen2", tie_word_embeddings=tied), seed=2)
        (shard, _) = shards(model, 2)
        inputs = mx.array([[3, 5, 7]])
        hidden = shard.hidden(model, inputs, [None] * len(model.layers))
        assert mx.array_equal(shard.full(hidden), model(inputs)).item()


def test_best_pairs_pick_mlx_lms_greedy_tokens() -> None:
    """Each shard's best pairs, through the real all-gather of a one-rank group, pick the token mlx-lm's own
    forward pass gives the largest logit, for every position of a real prompt."""
    model: Any = build_model(tiny_config("llama"), seed=4)
    found = shards(model, 3)
    inputs = mx.array([[3, 17, 5, 201, 9, 44]])
    hidden = found[0].hidden(model, inputs, [None] * len(model.layers)).reshape(-1, found[0].hidden_size)
    mx.eval(hidden)
    group = mx.distributed.init()  # one rank: its all-gather of the last rank's rows is those rows
    assert group.size() == 1
    with mx.stream(mx.new_thread_unsafe_stream(mx.default_device())):  # as the stage's: the wait's thread runs it
        best = [cast(list[float], s.pairs(hidden, group, 10.0, str).reshape(-1).tolist()) for s in found]
    expected = mx.argmax(model(inputs)[0], axis=-1).tolist()  # mlx-lm's logits, the whole head in one process
    assert len(set(expected)) > 1, expected  # the tokens differ: a wrong shard's pick would show
    assert pick_tokens(best) == expected


def test_pick_tokens_takes_the_largest_and_the_lowest_id_on_ties() -> None:
    # Two rows, three ranks: [largest, id] per row.
    best = [[1.0, 5, 2.0, 1], [3.0, 40, 2.0, 30], [3.0, 70, 1.5, 60]]
    assert pick_tokens(best) == [40, 1]
    assert pick_tokens([[float("nan"), 4], [float("nan"), 9]]) == [4]


def test_heads_that_are_not_plain_are_not_shared() -> None:
    for arch in ("gemma2", "granite", "falcon_h1"):  # soft-capped or scaled logits
        model: Any = build_model(tiny_config(arch), seed=0)
        assert vocab_shard(model, info(0, 2, 8)) is None, arch


# --- head="split": each rank holds only its rows (tests/test_vocab_split.py runs it against mlx-lm) -----------


def test_a_split_is_refused_where_the_logits_are_not_the_plain_head() -> None:
    """gemma2 soft-caps its logits: no rank could give them from its rows. Refused before anything changes."""
    model: Any = build_model(tiny_config("gemma2"), seed=1)
    layers = list(model.layers)
    with pytest.raises(PipelineError, match="head='split'"):
        shard_model(model, cast(Any, FakeGroup(0, 2)), head="split", lend="none")
    assert [id(x) for x in model.layers] == [id(x) for x in layers]
    with pytest.raises(ValueError, match="'all', 'last' or 'split'"):
        shard_model(build_model(tiny_config("llama")), cast(Any, FakeGroup(0, 2)), head="both")  # type: ignore[arg-type]


@pytest.mark.parametrize("arch,quantized", [("qwen2", False), ("llama", True)])
@pytest.mark.parametrize("rank", [0, 2])
def test_a_split_rank_keeps_copies_of_its_rows_only(arch: str, quantized: bool, rank: int) -> None:
    """Rank ``rank`` of 3 keeps exactly rows ``[V*r/3, V*(r+1)/3)`` of the embedding (and of an untied head);
    in pipemlx's own passes its head gives zeros, never read, and rank 0's embedding zeros in a calibration's
    timing pass (mlx-lm's forward passes sum and gather across the group: tests/test_vocab_split.py)."""
    whole: Any = build_model(tiny_config(arch), seed=2)
    model: Any = build_model(tiny_config(arch), seed=2)
    if quantized:
        nn.quantize(whole, group_size=32, bits=4)
        nn.quantize(model, group_size=32, bits=4)
    shard_model(model, cast(Any, FakeGroup(rank, 3)), head="split", lend="none")
    vocab = tiny_config(arch)["vocab_size"]
    rows = row_range(vocab, rank, 3)
    pairs = [(model.model.embed_tokens, whole.model.embed_tokens)]
    if "lm_head" in whole:
        pairs.append((model.lm_head, whole.lm_head))
    for split, original in pairs:
        assert isinstance(split, (SplitEmbedding, SplitHead))
        for name in ("weight", "scales", "biases"):
            if name in original:
                assert mx.array_equal(split.part[name], original[name][rows.start : rows.stop]).item(), name
    head = model.lm_head if "lm_head" in whole else model.model.embed_tokens.as_linear
    stage = stage_of(model)
    with stage.without_broadcast():  # pipemlx's own steps read no logits here (they project .part): zeros
        logits = head(mx.zeros((1, 2, tiny_config(arch)["hidden_size"])))
        assert logits.shape == (1, 2, vocab) and not mx.any(logits).item()
    if rank == 0:
        with stage.detached():  # calibration times the layers on zeros: no embeddings needed
            assert model.model.embed_tokens(mx.array([[1, 2]])).shape == (1, 2, tiny_config(arch)["hidden_size"])


# --- head="auto" (the default): a split vocabulary where the model allows it, decided from its classes ---------


@pytest.mark.parametrize(
    "arch,world_size,expected",
    [
        ("qwen2", 2, "split"),  # tied, plain head
        ("llama", 3, "split"),  # untied, plain head
        ("qwen2", 1, "all"),  # one rank holds every row
        ("gemma2", 2, "all"),  # soft-capped logits: no rank could give them from its rows
        ("granite", 2, "all"),  # scaled logits
    ],
)
def test_auto_resolves_to_split_where_the_vocabulary_can_be_split(arch: str, world_size: int, expected: str) -> None:
    model: Any = build_model(tiny_config(arch), seed=0)
    assert resolve_head("auto", model, world_size) == expected
    for given in ("all", "last", "split"):  # an explicit head is kept (shard_model refuses a split that cannot be)
        assert resolve_head(given, model, world_size) == given  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head must be 'auto', 'all', 'last' or 'split', got 'both'"):
        resolve_head("both", model, world_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch,expected", [("qwen2", "split"), ("llama", "split"), ("gemma2", "all")])
def test_shard_model_s_default_head_is_the_resolved_one(arch: str, expected: str) -> None:
    """No ``head`` given: a plain-head model's rank holds its rows of the vocabulary, another keeps the whole head
    (no error); the stage says which was applied."""
    model: Any = build_model(tiny_config(arch), seed=3)
    shard_model(model, cast(Any, FakeGroup(1, 2)), lend="none")
    assert stage_of(model).info.head == expected
    assert isinstance(model.model.embed_tokens, SplitEmbedding) is (expected == "split")
    if expected == "split":
        vocab = tiny_config(arch)["vocab_size"]
        assert model.model.embed_tokens.part.weight.shape[0] == len(row_range(vocab, 1, 2))


def test_a_folder_s_head_is_resolved_from_its_config_alone(tmp_path: Path) -> None:
    """``load_sharded`` resolves ``"auto"`` before reading any weight (a remote rank before fetching): from the
    classes mlx-lm builds from ``config.json``, with no weight file in the folder."""
    for arch, expected in (("qwen2", "split"), ("gemma2", "all")):
        folder = tmp_path / arch
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(tiny_config(arch)))
        assert head_of_folder("auto", folder, 2) == expected
        assert head_of_folder("auto", folder, 1) == "all"
        assert head_of_folder("last", folder, 2) == "last"
    with pytest.raises(ValueError, match="got 'both'"):
        head_of_folder("both", tmp_path / "qwen2", 2)  # type: ignore[arg-type]


def test_the_head_flag_defaults_to_auto() -> None:
    """``--head`` (generate, serve, split) follows the API's default; an unknown value is argparse's error."""
    import argparse

    from pipemlx.cli.common import add_head_flag

    parser = argparse.ArgumentParser()
    add_head_flag(parser)
    assert parser.parse_args([]).head == "auto"
    assert parser.parse_args(["--head", "all"]).head == "all"
    with pytest.raises(SystemExit):
        parser.parse_args(["--head", "both"])
