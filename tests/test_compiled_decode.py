"""The compiled decode step of a rank's layers (``BatchGenerator(compiled_decode=True)``), in one process.

Reference: mlx-lm's own ``BatchKVCache`` and the layers run eagerly over it (its ``make_mask``), after the same
operations the batch does to its caches: decode steps (past a room of 256 positions), a row joining (``merge`` +
``extend``, and :func:`pipemlx.runtime.batch.fill_rows` into a dead row), rows leaving (``filter``), a row handed
back (``extract``). The generator's tokens against mlx-lm's ``BatchGenerator``, at S=2 and S=3, are in
tests/test_batch.py (the engine scenario's ``compiled`` runs).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

import pipemlx
from pipemlx.runtime.batch import fill_rows
from pipemlx.runtime.batch.compiled import ROOM_STEP, CompiledDecode, room_mask
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def sharded(arch: str) -> Any:
    return pipemlx.shard_model(build_model(tiny_config(arch)), mx.distributed.init())


def row_caches(model: Any, decode: CompiledDecode, length: int, seed: int) -> list[Any]:
    """One request's per-layer caches holding ``length`` positions of random hidden states, run eagerly."""
    caches = make_prompt_cache(model)
    hidden = mx.random.normal((1, length, stage_of(model).info.hidden_size), key=mx.random.key(seed))
    mask = create_attention_mask(hidden, caches[0])
    for call, cache in zip(decode.calls, caches):
        hidden = call(hidden, mask, cache)
    mx.eval([c.state for c in caches])
    return caches


def merged(rows: list[list[Any]]) -> list[Any]:
    return [rows[0][layer].merge([row[layer] for row in rows]) for layer in range(len(rows[0]))]


def eager_step(decode: CompiledDecode, hidden: mx.array, caches: list[Any]) -> mx.array:
    mask = caches[0].make_mask(1)
    for call, cache in zip(decode.calls, caches):
        hidden = call(hidden, mask, cache)
    return hidden


def assert_same(ours: list[Any], theirs: list[Any]) -> None:
    """The same positions, offsets, left padding and keys and values in them (past ``_idx``: never read)."""
    for a, b in zip(ours, theirs, strict=True):
        assert a._idx == b._idx and a.offset.tolist() == b.offset.tolist()
        assert a.left_padding.tolist() == b.left_padding.tolist()
        assert a.keys.shape[2] % ROOM_STEP == 0 or a.keys.shape[2] == b.keys.shape[2]
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert mx.allclose(x[..., : a._idx, :], y[..., : b._idx, :], atol=1e-5).item()


def test_the_room_mask_is_mlx_lm_batch_mask_widened() -> None:
    """Over the first ``_idx + 1`` positions the mask is mlx-lm's ``BatchKVCache.make_mask(1)`` for the next
    position (left padding masked), and every position past them is masked."""
    rows = [KVCache() for _ in range(3)]
    for row, length in zip(rows, (3, 7, 5)):
        row.update_and_fetch(mx.ones((1, 2, length, 4)), mx.ones((1, 2, length, 4)))
    batch = BatchKVCache.merge(rows)
    theirs = batch.make_mask(1)  # as the model builds it, before the layers write the new position
    at = batch._idx  # where the step writes it
    ours = room_mask(batch.left_padding, mx.array([at]), ROOM_STEP)
    assert ours.shape == (3, 1, 1, ROOM_STEP) and theirs.shape[-1] == at + 1
    assert ours[..., : at + 1].tolist() == mx.broadcast_to(theirs, (3, 1, 1, at + 1)).tolist()
    assert not ours[..., : at + 1].all().item()  # the left padding is masked
    assert not ours[..., at + 1 :].any().item()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_compiled_steps_leave_the_caches_mlx_lm_leaves_through_joins_filters_and_extracts(arch: str) -> None:
    """Steps, compiled over copies of the batch caches and eager over mlx-lm's, past a room boundary, with a row
    joining by ``extend``, one leaving by ``filter``, one joining into a dead row by ``fill_rows``, and one
    extracted: the outputs agree (1e-4), the caches hold the same, and the compiled one was traced once per
    (rows, room)."""
    model = sharded(arch)
    decode = CompiledDecode.of(model, stage_of(model))
    assert decode is not None and decode.traces == 1  # the probe's trace
    width = stage_of(model).info.hidden_size
    rows = [row_caches(model, decode, n, seed) for n, seed in ((250, 1), (243, 2))]
    ours, theirs = merged(copy.deepcopy(rows)), merged(rows)
    step = 0

    def steps(count: int) -> None:
        nonlocal step
        for _ in range(count):
            hidden = mx.random.normal((ours[0].offset.shape[0], 1, width), key=mx.random.key(100 + step))
            assert decode.holds(ours)
            with mx.stream(stage_of(model).compute_stream):  # the generator's (and the probe's) stream
                got = decode.step(hidden, ours)
            want = eager_step(decode, hidden, theirs)
            assert mx.allclose(got, want, atol=1e-4).item(), step
            step += 1
        assert_same(ours, theirs)

    steps(10)  # _idx 250 -> 260: the room grows from 256 to 512
    joining = row_caches(model, decode, 30, 3)
    for batch, cache in ((ours, copy.deepcopy(joining)), (theirs, joining)):
        for layer, extra in zip(batch, merged([cache])):
            layer.extend(extra)
    steps(3)
    for batch in (ours, theirs):
        for layer in batch:
            layer.filter([1, 2])  # row 0 leaves
    steps(3)
    filling = row_caches(model, decode, 12, 4)
    fill_rows(ours, 2, [0], [copy.deepcopy(filling)])  # a request joins into row 0 (as if it were dead)
    fill_rows(theirs, 2, [0], [filling])
    steps(2)
    for a, b in zip([c.extract(1) for c in ours], [c.extract(1) for c in theirs], strict=True):
        assert a.offset == b.offset and mx.allclose(a.keys, b.keys, atol=1e-5).item()
    assert decode.steps == step and decode.traces == len(decode.shapes) <= 5, (decode.traces, decode.shapes)


def test_caches_the_compiled_step_cannot_hold_are_left_eager() -> None:
    """Rotating caches (``max_kv_size``), an empty batch cache, and a family whose layers it does not replay:
    no compiled step (the generator decodes them eagerly, never failing)."""
    model = sharded("qwen3")
    decode = CompiledDecode.of(model, stage_of(model))
    assert decode is not None
    rotating = [make_prompt_cache(model, max_kv_size=16) for _ in range(2)]
    for row in rotating:
        for cache in row:
            cache.update_and_fetch(mx.ones((1, 2, 3, 16)), mx.ones((1, 2, 3, 16)))
    assert not decode.holds(merged(rotating))
    assert not decode.holds(merged([make_prompt_cache(model)]))  # nothing held yet: keys None
    assert CompiledDecode.of(sharded("gemma3_text"), stage_of(sharded("gemma3_text"))) is None


def test_compiled_decode_must_be_a_bool() -> None:
    model = sharded("qwen3")
    with pytest.raises(ValueError, match="compiled_decode must be a bool"):
        pipemlx.BatchGenerator(model, prefill_step_size=8, compiled_decode="yes")  # pyright: ignore[reportArgumentType]
    assert pipemlx.BatchGenerator(model, prefill_step_size=8).compiled_decode is None
