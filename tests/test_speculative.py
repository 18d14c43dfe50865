"""Speculative decoding through the pipeline: the tokens of plain single-process mlx-lm, every rank alike."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from conftest import run_ranks

import pipemlx
from pipemlx.runtime.speculative import AUTO_LIMIT, EXPLORE_EVERY, LEAVE_AFTER, DraftLength
from pipemlx.testing import build_model, tiny_config

CASES: list[dict[str, Any]] = [
    {"name": "lookup", "M": 6, "repeat": 4, "max_tokens": 16, "lookup": 3, "k": 4},
    {"name": "draft-same", "M": 9, "max_tokens": 12, "draft": "same", "k": 3},
    {"name": "draft-other", "M": 9, "max_tokens": 12, "draft": "other", "k": 2},
    {"name": "draft-penalty", "M": 5, "repeat": 3, "max_tokens": 12, "draft": "other", "k": 3, "penalty": 1.3},
    {"name": "break", "M": 9, "max_tokens": 12, "draft": "same", "k": 4, "break_after": {"rank": 0, "after": 2}},
    {"name": "auto", "M": 9, "max_tokens": 14, "draft": "same", "k": "auto"},
    {"name": "stop-mid-pass", "M": 9, "max_tokens": 12, "draft": "same", "k": 4, "stop_at": 2},
    {"name": "rotating", "M": 6, "repeat": 4, "max_tokens": 12, "lookup": 2, "k": 3, "max_kv_size": 16},
    {"name": "sampled", "M": 6, "repeat": 3, "max_tokens": 12, "draft": "same", "k": 3, "temp": 1.0},
    {"name": "seeded", "M": 9, "max_tokens": 16, "draft": "same", "k": 3, "temp": 0.2, "seed": 11},
    {"name": "seeded-end", "M": 7, "max_tokens": 13, "draft": "same", "k": 4, "temp": 0.5, "seed": 3},
    {"name": "mismatch", "M": 5, "max_tokens": 4, "draft": "mismatch", "k": 2},
    {"name": "draft-fails", "M": 9, "max_tokens": 12, "draft": "fails", "k": 2},
    # A stop token without speculation; last, with a timeout: a rank that misses the stop fails the test in seconds.
    {"name": "stop-plain", "M": 9, "max_tokens": 12, "stop_at": 3, "timeout": 30},
]

# speculation="pipelined": a pass started every tick while the later ranks verify the earlier ones. The same
# references (mlx-lm's plain decoding; seeded: its plain sampled decoding with the seed), the same launches.
PIPELINED: list[dict[str, Any]] = [
    {"name": "p-lookup", "M": 6, "repeat": 4, "max_tokens": 16, "lookup": 3, "k": 4},
    {"name": "p-draft-same", "M": 9, "max_tokens": 10, "draft": "same", "k": 4},  # max_tokens inside a pass
    {"name": "p-draft-other", "M": 9, "max_tokens": 12, "draft": "other", "k": 2, "share": True},
    {"name": "p-auto", "M": 6, "repeat": 4, "max_tokens": 14, "lookup": 2, "k": "auto", "mode": "auto"},
    # Guesses that never hold: num_draft_tokens="auto" leaves the ticks for the serial steps, the tokens exact.
    {"name": "p-auto-leaves", "M": 9, "max_tokens": 24, "draft": "other", "k": "auto"},
    {"name": "p-auto-leaves-seeded", "M": 9, "max_tokens": 24, "draft": "other", "k": "auto", "temp": 0.6, "seed": 5},
    {"name": "p-seeded", "M": 9, "max_tokens": 16, "draft": "same", "k": 3, "temp": 0.7, "seed": 11},
    {"name": "p-seeded-other", "M": 7, "max_tokens": 13, "draft": "other", "k": 4, "temp": 0.5, "seed": 3},
    {"name": "p-stop-mid-pass", "M": 9, "max_tokens": 12, "draft": "same", "k": 4, "stop_at": 2},
    {"name": "p-break", "M": 9, "max_tokens": 12, "draft": "same", "k": 4, "break_after": {"rank": 0, "after": 2}},
    {
        "name": "p-cancel",
        "M": 6,
        "repeat": 4,
        "max_tokens": 16,
        "lookup": 3,
        "k": 3,
        "cancel_after": {"rank": 1, "after": 5},
    },
    {"name": "p-draft-fails", "M": 9, "max_tokens": 12, "draft": "fails", "k": 2},
    # Last: rank 1 dies in the middle of a request; every other rank raises a typed error within the timeout.
    {
        "name": "p-kill",
        "M": 9,
        "max_tokens": 40,
        "draft": "same",
        "k": 3,
        "kill": {"rank": 1, "after": 6},
        "timeout": 20,
    },
]
PIPELINED = [{"mode": "pipelined", **case} for case in PIPELINED]

QUANTIZED: list[dict[str, Any]] = [
    {"name": "draft-kv-bits", "M": 40, "max_tokens": 10, "draft": "same", "k": 4, "kv_bits": 8},
    {"name": "lookup-kv-bits", "M": 7, "repeat": 3, "max_tokens": 10, "lookup": 2, "k": 3, "kv_bits": 4},
    {
        "name": "p-lookup-kv-bits",
        "M": 7,
        "repeat": 3,
        "max_tokens": 10,
        "lookup": 2,
        "k": 3,
        "kv_bits": 4,
        "mode": "pipelined",
    },
]
HEAD_DIM_32 = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize(
    "arch,world_size,config,cases",
    [("llama", 2, {}, CASES + PIPELINED), ("qwen3", 3, {}, CASES + PIPELINED), ("llama", 2, HEAD_DIM_32, QUANTIZED)],
    ids=["llama-2", "qwen3-3", "quantized-kv-2"],
)
def test_speculative_decoding_matches_plain_mlx_lm(
    arch: str, world_size: int, config: dict[str, Any], cases: list[dict[str, Any]]
) -> None:
    spec = {"arch": arch, "config": config, "cases": cases}
    reports = run_ranks(world_size, "speculative.py", spec, timeout=150)
    for i, case in enumerate(cases):
        if case.get("kill"):
            check_killed(case, reports, i)
            continue
        rows = [r["results"][i] for r in reports]
        name = case["name"]
        if case.get("mode") in ("pipelined", "auto"):
            check_pipelined(case, rows)
            continue
        if case.get("draft") == "mismatch":  # rank 0 guesses with another draft: every rank says so, at once
            assert all("ranks disagree on speculation" in r.get("error", "") for r in rows), rows
            continue
        if case.get("draft") == "fails":  # the last rank's draft raises mid-decode: every rank stops in that step
            last = world_size - 1
            assert rows[last]["error"] == "RuntimeError: the draft model failed", rows
            assert all(r["stop"][0] == "failed" and r["stop_ranks"] == [last] for r in rows), rows
            assert len({r["stop"][1] for r in rows}) == 1, rows
            continue
        # Every rank decided the same tokens, holds the same cache, and ended for the same reason.
        assert len({(r["offset"], str(r["stop"])) for r in rows}) == 1, (name, rows)
        # Rotating caches cannot be cut back: speculation turns itself off on every rank, the tokens stay exact.
        rotating = any(r["rotating"] for r in rows)  # (tiny llama makes its own caches: mlx-lm ignores max_kv_size)
        guessing = bool(case.get("draft") or case.get("lookup")) and not rotating
        assert [r["speculating"] for r in rows] == [guessing] * world_size, (name, rows)
        if case.get("break_after"):
            # Rank 0's consumer stopped after 2 tokens: every rank ended after the same pass.
            assert rows[0]["tokens"] == rows[0]["reference"][:2], rows
            ended = rows[0]["stop"]
            assert ended[0] == "cancelled" and ended[1] >= 2, rows
            for row in rows[1:]:
                assert row["tokens"] == row["reference"][: ended[1]], rows
            # What the caches hold after the prompt, the same on every rank, rank 0's unseen tokens included.
            assert all(r["decided"] == r["reference"][: ended[1]] for r in rows), rows
            continue
        if "seed" in case:
            # Seeded sampling: the draws, tokens, log-probabilities and confirmed guesses of mlx-lm's
            # speculative_generate_step with the same draft and seed (the last rank draws; every rank yields alike).
            spec = rows[-1]["spec_tokens"]
            assert 0 < sum(rows[-1]["spec_from_draft"]) < len(spec), (name, rows[-1])  # guesses held, and failed
            for row in rows:
                assert row["tokens"] == spec and row["from_draft"] == row["spec_from_draft"], (name, row)
                assert row["stop"] == ["length", case["max_tokens"]], (name, row)
                assert row["offset"] == row["prompt"] + case["max_tokens"], (name, row)
            assert rows[-1]["drift"] < 1e-4, (name, rows[-1])
            # The documented rule (docs/api.md, generate_step): a rank before the last calls its sampler on the
            # verification rows only, with what the last rank's sampler got there; the draft's draws (one row
            # each) are the last rank's alone, as only it runs the proposer.
            last = rows[-1]["sampler_calls"]
            for row in rows[:-1]:
                mine = row["sampler_calls"]
                assert 0 < len(mine) < len(last), (name, mine, last)
                rest = iter(last)
                assert all(call in rest for call in mine), (name, mine, last)  # in order, the same inputs
                drafts = list(last)
                for call in mine:
                    drafts.remove(call)
                assert drafts and all(rows_ == 1 for rows_, _ in drafts), (name, drafts)
            continue
        if case.get("temp"):
            assert len({tuple(r["tokens"]) for r in rows}) == 1, (name, rows)
            continue
        if (
            "stop_at" in case
        ):  # the stop token (among a pass's confirmed guesses, or plain): nothing after it is yielded
            assert all("error" not in r for r in rows), (name, rows)
            expected = row0 = rows[0]["reference"]
            expected = row0[: row0.index(rows[0]["stop_tokens"][0]) + 1]
            assert all(r["tokens"] == expected and r["stop"] == ["stop", len(expected)] for r in rows), rows
            assert all(r["offset"] == r["prompt"] + len(expected) for r in rows), rows
            continue
        for row in rows:
            assert row["tokens"] == row["reference"] == row["decided"], (name, row)
            if not case.get("max_kv_size"):  # the prompt and every yielded token are in the cache, no rejected guess
                assert row["offset"] == row["prompt"] + case["max_tokens"], (name, row)
        if case.get("max_kv_size"):
            continue
        proposed, accepted = rows[0]["guesses"]
        assert proposed > 0, (name, rows[0])
        if case.get("draft") == "same":  # the model guessing for itself: every guess is right
            assert accepted == proposed, (name, rows[0])


def check_pipelined(case: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """One ``speculation="pipelined"`` case: every rank yields plain decoding's tokens (and, where shared, its
    log-probabilities), holds them in its caches and ends for the same reason at the same token."""
    name, world_size = case["name"], len(rows)
    if case.get("draft") == "fails":  # rank 0 proposes in pipelined speculation: its draft fails, every rank stops
        assert rows[0]["error"] == "RuntimeError: the draft model failed", rows
        assert all(r["stop"][0] == "failed" and r["stop_ranks"] == [0] for r in rows), rows
        assert len({r["stop"][1] for r in rows}) == 1, rows
        return
    assert all("error" not in r for r in rows), (name, rows)
    assert len({(r["offset"], str(r["stop"]), tuple(r["decided"])) for r in rows}) == 1, (name, rows)
    assert [r["speculating"] for r in rows] == [True] * world_size, (name, rows)
    # Still ticking at the end, except where "auto" left them (guesses that never hold: after 8 verified passes).
    assert len({r["pipelined"] for r in rows}) == 1, (name, rows)
    if case["k"] != "auto":
        assert rows[0]["pipelined"], (name, rows)
    # "p-auto-leaves*": whether rank 0 leaves the ticks depends on the tick times it measured (its rule is tested
    # with given times in test_auto_pipelined_length_leaves_where_guesses_fail); either way every rank agrees (above)
    # and the tokens are exact (below).
    for row in rows:  # the prompt and every decided token are in the caches, no guess of a dropped pass
        assert row["offset"] == row["prompt"] + len(row["decided"]), (name, row)
    stopper = case.get("break_after") or case.get("cancel_after")
    if stopper:  # one rank stopped after `after` tokens: every rank ended after the same pass, as cancelled
        ended = rows[0]["stop"]
        assert ended[0] == "cancelled" and ended[1] >= stopper["after"], rows
        assert all(r["stop_ranks"] == [stopper["rank"]] for r in rows), rows
        assert all(r["decided"] == r["reference"][: ended[1]] for r in rows), rows
        mine = rows[stopper["rank"]]["tokens"]
        assert mine == rows[0]["reference"][: stopper["after"] if case.get("break_after") else ended[1]], rows
        return
    if "stop_at" in case:  # a stop token among a pass's confirmed guesses: nothing after it is yielded
        row0 = rows[0]["reference"]
        expected = row0[: row0.index(rows[0]["stop_tokens"][0]) + 1]
        assert all(r["tokens"] == expected and r["stop"] == ["stop", len(expected)] for r in rows), rows
        return
    expected = rows[0]["plain_tokens"] if "seed" in case else rows[0]["reference"]
    for row in rows:
        assert row["tokens"] == expected == row["decided"], (name, row)
        assert row["stop"] == ["length", case["max_tokens"]], (name, row)
        if "seed" in case or case.get("share"):  # every rank yields mlx-lm's log-probabilities
            assert row["drift"] < 1e-4, (name, row)
    proposed, confirmed = rows[0]["guesses"]
    assert proposed > 0, (name, rows[0])
    if case.get("draft") == "same" and "temp" not in case:  # the model guessing for itself: every guess holds
        assert confirmed == proposed, (name, rows[0])


def check_killed(case: dict[str, Any], reports: list[dict[str, Any]], i: int) -> None:
    """A rank left in the middle of a pipelined request: every other rank raised a typed error (a lost peer or
    a timeout) naming what it waited for, not a hang."""
    dead = case["kill"]["rank"]
    assert reports[dead].get("killed") and len(reports[dead]["results"]) == i, reports[dead]
    for rank, report in enumerate(reports):
        if rank == dead:
            continue
        error = report["results"][i].get("error", "")
        assert error.startswith(("PeerLostError", "PipelineTimeoutError")), (rank, report["results"][i])


def test_auto_pipelined_length_leaves_where_guesses_fail() -> None:
    """``num_draft_tokens="auto"`` in pipelined speculation: many guesses while they hold, none and then leaving
    for the serial steps (``None``) once ``LEAVE_AFTER`` passes said they never hold; a fixed count stays."""
    good, bad = DraftLength("auto"), DraftLength("auto")
    assert good.next_pipelined(2, 0) == bad.next_pipelined(2, 0) == 2  # nothing measured yet
    for verified in range(LEAVE_AFTER):
        k = good.next_pipelined(2, verified)
        assert k is not None
        good.record_tick(k, 0.010 + 0.001 * k, 0.001)
        good.record_guesses(k, k)
        k = bad.next_pipelined(2, verified)
        assert k is not None  # never before LEAVE_AFTER verified passes
        bad.record_tick(k, 0.010 + 0.002 * k, 0.003)
        bad.record_guesses(k, 0)
    assert good.next_pipelined(2, LEAVE_AFTER) == AUTO_LIMIT
    assert bad.next_pipelined(2, LEAVE_AFTER) is None
    assert DraftLength(3).next_pipelined(2, 100) == 3


def test_auto_draft_length_follows_the_acceptance_rate() -> None:
    """``num_draft_tokens="auto"``: more guesses while they hold, none when they never do (then one guess again
    every ``EXPLORE_EVERY`` plain passes), and guesses again once they hold."""
    always = DraftLength("auto")
    never = DraftLength("auto")
    assert always.next() == never.next() == 2  # nothing measured yet
    always.record(0, 0, 0.010)  # the first pass guesses nothing
    never.record(0, 0, 0.010)
    for _ in range(6):
        k = always.next()
        always.record(k, k, 0.010 + 0.001 * k)
        k = never.next()
        never.record(k, 0, 0.010 + 0.002 * k)
    assert always.next() == AUTO_LIMIT and never.next() == 0
    chosen = [never.next()]
    while chosen[-1] == 0 and len(chosen) <= EXPLORE_EVERY + 1:
        never.record(0, 0, 0.010)
        chosen.append(never.next())
    assert chosen[-1] == 1 and len(chosen) <= EXPLORE_EVERY + 1  # one guess, to notice when guessing pays again
    for _ in range(20):
        k = never.next()
        never.record(k, k, 0.010 + 0.002 * k)  # it does now
    assert never.next() >= 2
    assert DraftLength(3).next() == 3


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_draft_tokens": 0, "prompt_lookup": 2}, "num_draft_tokens must be a positive int or 'auto'"),
        ({"prompt_lookup": 0}, "prompt_lookup must be a positive int"),
        ({"prompt_lookup": 2, "draft_model": "model"}, "draft_model or prompt_lookup, not both"),
        ({"draft_model": "model", "num_draft_tokens": "many"}, "num_draft_tokens must be a positive int or 'auto'"),
        ({"prompt_lookup": 2, "num_draft_tokens": 17}, r"num_draft_tokens must be at most 16 \(guesses in one step\)"),
        ({"prompt_lookup": 2, "speculation": "fast"}, r"speculation must be one of \['serial', 'pipelined', 'auto'\]"),
        ({"prompt_lookup": 2, "speculation": "pipelined"}, "speculation='pipelined' needs more than one rank"),
    ],
)
def test_bad_speculation_arguments_are_named_before_anything_is_sent(kwargs: dict[str, Any], message: str) -> None:
    config = tiny_config("llama")
    model = pipemlx.shard_model(build_model(config), mx.distributed.init())  # one rank
    if kwargs.get("draft_model") == "model":
        kwargs = {**kwargs, "draft_model": build_model(config)}
    with pytest.raises(ValueError, match=message):
        pipemlx.generate_step(mx.array([1, 2, 3]), model, **kwargs)
