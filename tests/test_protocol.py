"""The wire protocol (pipemlx.runtime.protocol), one process: rows built as the module documents them
(``[kind, status, payload width, *fields] + payload``), several ranks' rows gathered by concatenation as
``all_gather`` lays them out, and read back: every field and payload, and every mismatch named word for word.

The reference is the documented layout itself, written out as literal lists; the multi-process tests
(test_faults.py, test_equivalence.py) run the same code over real all-gathers.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from pipemlx.errors import PipelineMismatchError
from pipemlx.runtime.agreement import agreed_offset
from pipemlx.runtime.caches import UNCOUNTED
from pipemlx.runtime.protocol import (
    AGREE,
    DECODE,
    HANDSHAKE,
    PASS,
    TOKENS,
    Field,
    Kind,
    Message,
    Status,
    agreed,
    decode_settings,
    dtype_code,
    gather,
    per_rank,
)

PAIR = Message(Kind.AGREE, (agreed("step"), Field("failed_chunk")), "a test message")


def gathered(*rows: mx.array) -> mx.array:
    """What ``all_gather`` returns for these ranks' 1-D rows: them end to end."""
    return mx.concatenate(list(rows))


def mismatch(message: Message, rows: list[mx.array], world: int | None = None) -> str:
    with pytest.raises(PipelineMismatchError) as error:
        message.read(gathered(*rows), len(rows) if world is None else world, "the place")
    return str(error.value)


def test_a_header_is_kind_status_payload_width_then_the_fields_in_order() -> None:
    assert PAIR.width == 5
    assert PAIR.header({"step": 7}).tolist() == [int(Kind.AGREE), 0, 0, 7, 0]
    assert PAIR.header({"failed_chunk": -1, "step": 2}, Status.CANCEL, 4).tolist() == [0x7E02, 1, 4, 2, -1]
    lazy = mx.array(11) + 1  # a field computed in the same graph (a decode step's token)
    assert PAIR.header({"step": lazy}).tolist() == [0x7E02, 0, 0, 12, 0]
    assert PAIR.header({"failed_chunk": lazy, "step": mx.array([3])}).tolist() == [0x7E02, 0, 0, 3, 12]
    assert DECODE.header({"index": 5, "next_0": mx.array(9), "next_15": 4}).tolist() == (
        [0x7E03, 0, 0, 5] + [0] * 8 + [9] + [0] * 14 + [4]
    )
    assert DECODE.header({"index": mx.array(1), "next_15": mx.array(2)}, Status.END).tolist() == (
        [0x7E03, 4, 0, 1] + [0] * 23 + [2]
    )
    assert DECODE.header({"index": 5, "next_guesses": mx.array(3)}).tolist()[11] == 3
    assert AGREE.header({}).dtype == mx.int32 and AGREE.header({"step": mx.array(2.0)}).dtype == mx.int32
    with pytest.raises(ValueError) as error:
        PAIR.header({"step": 1, "stpe": 2, "chunk": 3})
    assert str(error.value) == "a test message has no field ['chunk', 'stpe']"
    with pytest.raises(ValueError) as twice:
        Message(Kind.AGREE, (Field("step"), Field("status")), "a bad message")
    assert str(twice.value) == (
        "a bad message: a field name is used twice: ['kind', 'status', 'payload', 'step', 'status']"
    )


def test_a_pipelined_tick_reads_rank_0s_pass_and_the_last_ranks_verdict() -> None:
    """PASS: ``[kind, status, width, tick, in_flight, max_tokens, stop_tokens, inputs, in_0..in_16, token,
    accepted, serial]``; rank 0 says which pass it started, the last rank what it decided, both agree on the rest."""
    assert PASS.width == 3 + 4 + 1 + 17 + 3
    first = PASS.row(
        {"tick": 4, "in_flight": 1, "max_tokens": 9, "inputs": 3, "in_0": 7, "in_1": 8, "in_2": 5},
        payload=[mx.zeros((2,))],
    )
    last = PASS.row(
        {"tick": 4, "in_flight": 1, "max_tokens": 9, "token": mx.array(6), "accepted": 2, "serial": 0},
        payload=[mx.array([-0.5, -1.5])],
    )
    assert mx.view(first[: PASS.width], mx.int32).tolist() == [0x7E11, 0, 2, 4, 1, 9, 0, 3, 7, 8, 5] + [0] * 17
    table = PASS.read(gathered(first, last), 2, "the tick")
    assert [table.columns[f"in_{i}"][0] for i in range(table.columns["inputs"][0])] == [7, 8, 5]
    assert (table.last("token"), table.last("accepted"), table.columns["serial"][0]) == (6, 2, 0)
    assert table.payloads[-1] == [-0.5, -1.5] and table.all_ok
    behind = PASS.header({"tick": 4, "in_flight": 2, "max_tokens": 9})
    assert mismatch(PASS, [PASS.header({"tick": 4, "in_flight": 1, "max_tokens": 9}), behind]) == (
        "the place: ranks disagree on in_flight: rank 0: 1, rank 1: 2"
    )


def test_rows_carry_integer_or_float_payloads_and_read_back_exactly() -> None:
    ids = PAIR.row({"step": 3}, payload=[mx.array([5, 6]), mx.array([[7]])])
    assert ids.dtype == mx.int32 and ids.tolist() == [0x7E02, 0, 3, 3, 0, 5, 6, 7]
    big = 2**31 - 1  # a fingerprint: exact in the header even beside float32 payloads
    floats = PAIR.row({"step": 3, "failed_chunk": big}, Status.FAILED, [mx.array([0.5, -1.25]), mx.array([2])])
    assert floats.dtype == mx.float32 and floats.size == 8
    assert mx.view(floats[:5], mx.int32).tolist() == [0x7E02, 2, 3, 3, big]
    assert floats[5:].tolist() == [0.5, -1.25, 2.0]
    other = PAIR.row({"step": 3, "failed_chunk": -7}, Status.CHUNK_FAILED, [mx.array([1.0, 2.0, 3.0])])
    table = PAIR.read(gathered(floats, other), 2, "here")
    assert table["step"] == [3, 3] and table["failed_chunk"] == [big, -7] and table["payload"] == [3, 3]
    assert table["kind"] == [0x7E02] * 2 and table.payloads == [[0.5, -1.25, 2.0], [1.0, 2.0, 3.0]]
    assert table.statuses == [Status.FAILED, Status.CHUNK_FAILED] and not table.all_ok
    assert table.ranks_with(Status.CHUNK_FAILED) == (1,) and table.ranks_with(Status.OK, Status.FAILED) == (0,)
    assert table.last("failed_chunk") == -7 and table.message is PAIR
    three = PAIR.read(gathered(*(PAIR.row({"step": 1, "failed_chunk": c}) for c in (5, 6, 7))), 3, "here")
    assert three.last("failed_chunk") == 7  # the last rank's, of any number
    plain = PAIR.read(gathered(PAIR.row({"step": 1}), PAIR.row({"step": 1}, Status.OK)), 2, "here")
    assert plain.all_ok and plain.payloads == [[], []] and plain.ranks_with(Status.CANCEL) == ()
    counted = TOKENS.read(TOKENS.row({"count": 2}, payload=[mx.array([8, 9])]), 1, "x")
    assert counted.payloads == [[8, 9]] and counted["count"] == [2]


def test_every_mismatch_is_named_with_each_ranks_value() -> None:
    one = PAIR.row({"step": 1})
    assert mismatch(PAIR, [one, one[:4]]) == "the place: the ranks sent rows of different sizes: they are out of step"
    assert mismatch(PAIR, [one[:3], one[:3]]) == (
        "the place: the ranks sent rows of different sizes: they are out of step"
    )
    assert mismatch(PAIR, [one, DECODE.header({})[:5], mx.array([1, 0, 0, 1, 0], dtype=mx.int32)]) == (
        "the place: a rank is not in a test message while the others are "
        "(messages by rank: rank 0: agree, rank 1: decode, rank 2: garbage)"
    )
    wide = PAIR.row({"step": 1}, payload=[mx.array([1, 2])])
    assert mismatch(PAIR, [wide, mx.concatenate([one, mx.array([0, 0], dtype=mx.int32)])]) == (
        "the place: ranks disagree on the payload width: rank 0: 2, rank 1: 0"
    )
    short = mx.concatenate([PAIR.header({"step": 1}, payload=2), mx.array([0], dtype=mx.int32)])  # says 2, holds 1
    assert mismatch(PAIR, [short, short]) == "the place: ranks disagree on the payload width: rank 0: 2, rank 1: 2"
    assert mismatch(PAIR, [one, PAIR.row({"step": 1}, 9), PAIR.row({"step": 1}, 7), PAIR.row({"step": 1}, 9)]) == (
        "the place: unknown status [7, 9]"
    )
    assert mismatch(PAIR, [one, PAIR.row({"step": 2})]) == "the place: ranks disagree on step: rank 0: 1, rank 1: 2"
    table = PAIR.read(gathered(one, PAIR.row({"step": 1, "failed_chunk": 4})), 2, "x")  # not agreed: may differ
    assert table["failed_chunk"] == [0, 4]


@pytest.mark.parametrize(
    "field,values,shown",
    [
        (
            "dtype",
            [dtype_code(mx.bfloat16), dtype_code(mx.float32)],
            "rank 0: mlx.core.bfloat16, rank 1: mlx.core.float32",
        ),
        ("dtype", [dtype_code(mx.float16), dtype_code(mx.int8)], "rank 0: mlx.core.float16, rank 1: unknown"),
        ("dtype", [dtype_code(mx.float64), 5], "rank 0: mlx.core.float64, rank 1: unknown"),
        ("prefill_step_size", [0, 512], "rank 0: auto, rank 1: 512"),
        (
            "decode_settings",
            [0, 4],
            "rank 0: none (pipeline_prefill), rank 1: share_logprobs=True with a sampler or logits processors",
        ),
        ("decode_settings", [1, 5], "rank 0: share_logprobs=False, rank 1: 5"),
        ("decode_settings", [-1, 2], "rank 0: -1, rank 1: share_logprobs=True"),
        ("cache_offset", [4, 5], "rank 0: 4, rank 1: 5"),
        ("num_tokens", [4, 5], "rank 0: 4, rank 1: 5"),
    ],
)
def test_the_handshake_shows_its_fields_in_words(field: str, values: list[int], shown: str) -> None:
    rows = [HANDSHAKE.header({field: v}) for v in values]
    assert mismatch(HANDSHAKE, rows) == f"the place: ranks disagree on {field}: {shown}"


def test_a_rank_that_cannot_count_its_cache_agrees_with_any_offset() -> None:
    rows = [HANDSHAKE.header({"cache_offset": v}) for v in (UNCOUNTED, 6, UNCOUNTED, 6)]
    table = HANDSHAKE.read(gathered(*rows), 4, "x")
    assert table["cache_offset"] == [-1, 6, -1, 6] and agreed_offset(table) == 6
    uncounted = HANDSHAKE.read(gathered(*rows[::2]), 2, "x")
    assert agreed_offset(uncounted) == 0
    assert agreed_offset(HANDSHAKE.read(gathered(HANDSHAKE.header({"cache_offset": 3})), 1, "x")) == 3
    with pytest.raises(
        PipelineMismatchError, match="disagree on cache_offset: rank 0: uncounted, rank 1: 6, rank 2: 5"
    ):
        HANDSHAKE.read(gathered(*rows[:2], HANDSHAKE.header({"cache_offset": 5})), 3, "x")


def test_small_helpers_number_and_name_what_the_handshake_sends() -> None:
    assert [dtype_code(d) for d in (mx.float16, mx.bfloat16, mx.float32, mx.float64, mx.int32, None)] == [
        1,
        2,
        3,
        4,
        0,
        0,
    ]
    assert [decode_settings(s, p) for s in (False, True) for p in (False, True)] == [1, 3, 2, 4]
    assert per_rank(["a", 2]) == "rank 0: a, rank 1: 2" and per_rank([]) == ""


def test_an_exchange_in_a_group_of_one_reads_its_own_row() -> None:
    group = mx.distributed.init()
    row = PAIR.header({"step": 4})
    assert gather(row, group) is row
    table = PAIR.exchange(
        group, mx.default_stream(mx.default_device()), {"step": 4}, status=Status.END, timeout=10.0, where="w", who="me"
    )
    assert table["step"] == [4] and table.statuses == [Status.END] and table["failed_chunk"] == [0]


class Planned:
    """What a handshake compares of a plan (a PrefillPlan, or an auto-step request)."""

    num_tokens = 37
    step_size = 8

    def fingerprint(self) -> int:
        return 2**31 - 5


def test_a_handshake_and_an_agreement_in_a_group_of_one_send_this_ranks_values() -> None:
    """One rank holding the whole model: every value the handshake sends reads back as given, the layer range is
    the whole model (contiguous), and an agreement point carries its step and failed chunk."""
    import pipemlx
    from pipemlx.runtime.agreement import agree_on_step, handshake
    from pipemlx.runtime.stage import stage_of
    from pipemlx.testing import build_model, tiny_config

    config = tiny_config("llama")
    model = pipemlx.shard_model(build_model(config, seed=2), mx.distributed.init())
    stage = stage_of(model)
    table = handshake(stage, Planned(), Status.OK, 10.0, 11, 3, 12, decode_settings(True, False), 13)
    layers = config["num_hidden_layers"]
    assert {name: values[0] for name, values in table.columns.items()} == {
        "kind": int(Kind.HANDSHAKE),
        "status": 0,
        "payload": 0,
        "calibration": 11,
        "prior": 12,
        "num_tokens": 37,
        "prefill_step_size": 8,
        "plan_fingerprint": 2**31 - 5,
        "total_layers": layers,
        "hidden_size": config["hidden_size"],
        "dtype": dtype_code(mx.float32),
        "decode_settings": 2,
        "lend_mlp": 0,
        "lend_heads": 0,
        "cache_offset": 3,
        "speculation": 13,
        "layer_start": 0,
        "layer_stop": layers,
    }
    closed = agree_on_step(stage, 4, Status.CHUNK_FAILED, 10.0, failed_chunk=2)
    assert (closed["step"], closed["failed_chunk"], closed.statuses) == ([4], [2], [Status.CHUNK_FAILED])
    assert agree_on_step(stage, 5, Status.OK, 10.0)["failed_chunk"] == [-1]
    plain = handshake(stage, Planned(), Status.CANCEL, 10.0)  # what the optional fields default to
    names = ("calibration", "prior", "decode_settings", "cache_offset", "speculation")
    assert [plain[name] for name in names] == [[0]] * 5 and plain.statuses == [Status.CANCEL]


@pytest.mark.parametrize(
    "ranges,message",
    [
        ([(0, 2), (2, 4)], None),
        ([(0, 2), (3, 4)], "rank 0: 0..1, rank 1: 3..3"),
        ([(1, 2), (2, 4)], "rank 0: 1..1, rank 1: 2..3"),
        ([(0, 2), (2, 3)], "rank 0: 0..1, rank 1: 2..2"),
        ([(0, 1), (1, 2), (2, 4)], None),
        ([(0, 1), (2, 3), (3, 4)], "rank 0: 0..0, rank 1: 2..2, rank 2: 3..3"),
    ],
)
def test_the_handshake_names_layer_ranges_that_do_not_split_the_model(
    monkeypatch: pytest.MonkeyPatch, ranges: list[tuple[int, int]], message: str | None
) -> None:
    """Every rank's layer range as the handshake gathers them (the rows of several ranks of a 4-layer model, made
    here): they must follow each other from layer 0 to the last, else every rank raises naming each range."""
    import pipemlx
    from pipemlx.runtime import agreement
    from pipemlx.runtime.stage import stage_of
    from pipemlx.testing import build_model, tiny_config

    rows = [HANDSHAKE.header({"total_layers": 4, "layer_start": a, "layer_stop": b}) for a, b in ranges]

    class Gathered:
        def exchange(self, *args: object, **kwargs: object) -> object:
            return HANDSHAKE.read(gathered(*rows), len(rows), "the handshake")

    monkeypatch.setattr(agreement, "HANDSHAKE", Gathered())
    model = pipemlx.shard_model(build_model(tiny_config("llama"), seed=2), mx.distributed.init())
    if message is None:
        agreement.handshake(stage_of(model), Planned(), Status.OK, 10.0)
        return
    with pytest.raises(PipelineMismatchError) as error:
        agreement.handshake(stage_of(model), Planned(), Status.OK, 10.0)
    assert str(error.value) == f"layer ranges do not split 4 layers contiguously: {message}"
