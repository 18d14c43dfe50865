"""send_mode: scoped, restored on exception, nested, flushed or discarded on exit."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import run_ranks
from fakes import sharded_tiny, tokens
from mlx_lm.models.cache import make_prompt_cache

import pipemlx
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, tiny_config


def queue_one_send(model: object) -> None:
    """Rank 0 of 2 in queue mode, as the prefill executor drives it: one forward pass queues its output."""
    with stage_of(model).executing_plan():  # type: ignore[arg-type]
        model(tokens(5)[None], cache=make_prompt_cache(model))  # type: ignore[operator]


def test_a_forward_pass_in_queue_mode_outside_the_executor_is_refused() -> None:
    """Queue mode cannot produce wrong logits: the model refuses, and nothing stays queued."""
    model = sharded_tiny()
    stage = stage_of(model)
    with pytest.raises(pipemlx.PipelineError, match="outside pipemlx.pipeline_prefill"):
        with pipemlx.send_mode(model, "queue"):
            model(tokens(5)[None], cache=make_prompt_cache(model))
    assert stage.mode == "immediate" and len(stage.send_queue) == 0


def test_immediate_is_the_mode_outside_any_block() -> None:
    model = sharded_tiny()
    assert stage_of(model).mode == "immediate"


def test_exception_restores_mode_and_discards_queued_sends() -> None:
    model = sharded_tiny()
    stage = stage_of(model)
    with pytest.raises(RuntimeError, match="boom"):
        with pipemlx.send_mode(model, "queue") as queue:
            queue_one_send(model)
            assert len(queue) == 1 and queue.pending[0].peer == 1
            raise RuntimeError("boom")
    assert stage.mode == "immediate"
    assert len(stage.send_queue) == 0


def test_nested_blocks_restore_the_outer_mode() -> None:
    model = sharded_tiny()
    stage = stage_of(model)
    with pytest.raises(KeyError):
        with pipemlx.send_mode(model, "queue"):
            with pytest.raises(ValueError):
                with pipemlx.send_mode(model, "queue"):
                    assert stage.mode == "queue"
                    queue_one_send(model)
                    raise ValueError("inner")
            assert stage.mode == "queue"
            assert len(stage.send_queue) == 0  # the inner block's exit discarded its send
            raise KeyError("outer")
    assert stage.mode == "immediate"


def test_unknown_mode_is_a_value_error_and_changes_nothing() -> None:
    model = sharded_tiny()
    with pytest.raises(ValueError, match="unknown send mode 'later'"):
        with pipemlx.send_mode(model, "later"):  # type: ignore[arg-type]
            pass
    assert stage_of(model).mode == "immediate"


def test_unsharded_model_is_a_clear_error() -> None:
    model = build_model(tiny_config("llama"))
    with pytest.raises(pipemlx.NotShardedError, match="not sharded: call pipemlx.shard_model"):
        with pipemlx.send_mode(model, "queue"):
            pass
    with pytest.raises(pipemlx.NotShardedError):
        pipemlx.pipeline_prefill(model, mx.array([1, 2, 3]), make_prompt_cache(model))


def test_normal_exit_issues_queued_sends_in_order() -> None:
    """Two real ranks: rank 0 queues two sends and leaves the block; rank 1 receives both, in order."""
    reports = run_ranks(2, "send_mode_flush.py", {}, timeout=60)
    rank0, rank1 = reports
    assert rank0["queued_inside"] == 2
    assert rank0["queued_after"] == 0 and rank0["in_flight_after"] == 0
    assert rank0["mode_after"] == "immediate"
    assert rank1["received"] == rank0["sent"]
