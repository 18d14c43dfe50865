"""The parts of pipemlx serve that need no server: request checking, stop strings, the prefix cache, the broadcast."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler

from pipemlx.errors import PipelineMismatchError
from pipemlx.runtime.protocol import SERVE, TOKENS
from pipemlx.serve.broadcast import (
    RANK_FIELDS,
    REQUEST,
    Channel,
    Insert,
    Ops,
    checksum,
    decode_ops,
    encode_ops,
    read_header,
)
from pipemlx.serve.loop import share_entries
from pipemlx.serve.openai_api import ApiError, StopText, parse_chat, parse_completion
from pipemlx.serve.prefix_cache import PrefixCache, PrefixReuse, common_prefix
from pipemlx.serve.requests import Request, RequestResult, SamplingParams, from_json, to_json

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    "body,param,words",
    [
        ([], None, "must be a JSON object"),
        ({}, "messages", "'messages' is a required property"),
        ({"messages": "hi"}, "messages", "non-empty list"),
        ({"messages": [{"role": "king", "content": "x"}]}, "messages[0].role", "must be one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string or a list of text parts"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "only text"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "at least 1"),
        ({"messages": MESSAGES, "max_completion_tokens": 2.5}, "max_completion_tokens", "whole number"),
        ({"messages": MESSAGES, "temperature": -1}, "temperature", "from 0 to 2"),
        ({"messages": MESSAGES, "top_p": 0}, "top_p", "(0, 1]"),
        ({"messages": MESSAGES, "seed": "x"}, "seed", "whole number"),
        ({"messages": MESSAGES, "stop": ["a", ""]}, "stop", "non-empty strings"),
        ({"messages": MESSAGES, "stop": ["a"] * 5}, "stop", "up to 4"),
        ({"messages": MESSAGES, "n": 2}, "n", "only n=1"),
        ({"messages": MESSAGES, "stream": "yes"}, "stream", "true or false"),
        ({"messages": MESSAGES, "model": 7}, "model", "must be a string"),
    ],
)
def test_bad_chat_requests_name_the_field(body: Any, param: str | None, words: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat(body)
    error = caught.value
    assert error.status == 400 and error.param == param and words in error.message
    assert error.body() == {
        "error": {"message": error.message, "type": "invalid_request_error", "param": param, "code": None}
    }


def test_good_requests_are_read_fully() -> None:
    chat = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": -1,
            "stop": "x",
        }
    )
    assert chat.messages == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": ""}]
    sampling = chat.sampling
    assert (chat.stream, chat.include_usage, chat.max_tokens, sampling.temperature, sampling.top_p) == (
        True,
        True,
        7,
        0.5,
        0.9,
    )
    assert sampling.seed == (1 << 31) - 1 and chat.stop == ("x",)
    read = parse_completion({"prompt": "x", "min_p": 0.1, "top_k": 5}).sampling
    assert (read.min_p, read.top_k) == (0.1, 5)
    for field, bad in (("min_p", 2), ("min_p", "a"), ("top_k", -1), ("top_k", 1.5)):
        with pytest.raises(ApiError) as caught:
            parse_completion({"prompt": "x", field: bad})
        assert caught.value.status == 400 and caught.value.param == field
    assert parse_completion({"prompt": ["text"]}).prompt == "text"
    assert parse_completion({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    for bad in ({"prompt": ""}, {"prompt": [1, "a"]}, {"prompt": ["a", "b"]}, {}):
        with pytest.raises(ApiError):
            parse_completion(bad)


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"presence_penalty": 3}, "presence_penalty", "from -2 to 2"),
        ({"frequency_penalty": "a"}, "frequency_penalty", "from -2 to 2"),
        ({"repetition_penalty": -1}, "repetition_penalty", "from 0 to 10"),
        ({"repetition_context_size": 0}, "repetition_context_size", "at least 1"),
        ({"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    ],
)
def test_bad_penalties_are_refused_and_good_ones_read(body: dict[str, Any], param: str, words: str) -> None:
    """A penalty the server would ignore or mlx-lm would refuse is a 400 naming it, never a silent default."""
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": MESSAGES, **body})
    assert caught.value.status == 400 and caught.value.param == param and words in str(caught.value)
    read = parse_completion({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {}})
    assert (read.sampling.presence_penalty, read.sampling.frequency_penalty) == (0.5, -1.0)
    insert = Insert(Request(1, [5], 4, read.sampling))
    received = decode_ops(encode_ops(Ops(inserts=[insert]))).inserts[0].request.sampling
    assert received == read.sampling  # what every rank gets
    assert parse_completion({"prompt": "x"}).sampling.processors() is None


@pytest.mark.parametrize(
    "body,param",
    [({"logprobs": 0}, "logprobs"), ({"echo": True}, "echo")],
)
def test_completion_options_that_change_the_answer_are_refused(body: dict[str, Any], param: str) -> None:
    """logprobs 0 still asks for the chosen tokens' log probabilities, echo for the prompt in the text: a 400,
    not an answer silently without them."""
    with pytest.raises(ApiError) as caught:
        parse_completion({"prompt": "x", **body})
    assert caught.value.status == 400 and caught.value.param == param
    assert parse_completion({"prompt": "x", "logprobs": None, "echo": False}).prompt == "x"
    assert parse_chat({"messages": MESSAGES, "logprobs": False, "top_logprobs": 0}).messages == MESSAGES


def test_draft_is_a_boolean_that_defaults_to_true() -> None:
    """``draft: false`` opts a request out of speculative decoding; anything but a boolean is a 400 naming it."""
    assert parse_completion({"prompt": "x"}).sampling.draft
    assert parse_chat({"messages": MESSAGES, "draft": True}).sampling.draft
    assert not parse_completion({"prompt": "x", "draft": False}).sampling.draft
    assert parse_completion({"prompt": "x", "draft": None}).sampling.draft  # null: unset
    for bad in (0, "false"):
        with pytest.raises(ApiError) as caught:
            parse_chat({"messages": MESSAGES, "draft": bad})
        assert caught.value.status == 400 and caught.value.param == "draft"


def released(text: str, stops: list[str], cuts: list[int]) -> tuple[list[str], str, bool]:
    """Feed ``text`` to a StopText growing to each cut, then finish; return the pieces, all, and stopped."""
    stop_text = StopText(stops)
    pieces: list[str] = []
    for cut in sorted(cuts) + [len(text)]:
        pieces.append(stop_text.update(text[:cut]))
    pieces.append(stop_text.finish(text))
    return pieces, "".join(pieces), stop_text.stopped


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet='ab"c ', max_size=30),
    stops=st.lists(st.text(alphabet='ab"c', min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_text_releases_exactly_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    points = sorted(c for c in cuts if c <= len(text))
    _, whole, stopped = released(text, stops, points)
    # Generation ends at the first text seen that holds a stop string: what a longer stop starting earlier
    # would have needed is never generated (text '"a' with stops 'a' and '"aa' stops after '"').
    expected, expect_stop = text, False
    for point in [*points, len(text)]:
        found = [i for i in (text[:point].find(s) for s in stops) if i >= 0]
        if found:
            expected, expect_stop = text[: min(found)], True
            break
    assert whole == expected
    assert stopped == expect_stop


def test_stop_text_holds_back_a_possible_stop() -> None:
    stop_text = StopText(["END"])
    assert stop_text.update("abc E") == "abc "
    assert stop_text.update("abc EN") == ""
    assert stop_text.update("abc ENd") == "ENd"
    assert stop_text.update("abc ENd END more") == " " and stop_text.stopped
    assert stop_text.text_of("abc ENd END more") == "abc ENd "


def kv(tokens: int, layers: int = 2, seed: int = 0) -> list[Any]:
    """Real mlx-lm KV caches holding ``tokens`` positions (values tell the positions apart)."""
    caches: list[Any] = []
    for layer in range(layers):
        cache = KVCache()
        values = mx.arange(tokens, dtype=mx.float32).reshape(1, 1, tokens, 1) + 1000 * layer + seed
        cache.update_and_fetch(values, values)
        caches.append(cache)
    return caches


def test_prefix_cache_takes_extends_copies_and_evicts() -> None:
    cache = PrefixCache(budget_tokens=20)
    assert cache.plan([1, 2, 3]) == PrefixReuse()
    assert cache.store([1, 2, 3, 4, 5], kv(5))
    # A request extending the entry takes it over (no copy) and keeps one token to compute.
    plan = cache.plan([1, 2, 3, 4, 5, 6, 7])
    assert plan == PrefixReuse(entry=1, reuse=5, copy=False)
    taken = cache.checkout(plan, lambda: kv(0))
    assert taken[0].offset == 5 and not cache.entries
    # The same prompt again: everything but its last token is reused, from a trimmed copy.
    assert cache.store([1, 2, 3, 4, 5, 6, 7, 8], kv(8))
    plan = cache.plan([1, 2, 3, 4, 5, 6, 7])
    assert plan == PrefixReuse(entry=2, reuse=6, copy=True)
    copied = cache.checkout(plan, lambda: kv(0))
    assert copied[0].offset == 6 and cache.entries[2].cache[0].offset == 8
    keys = copied[0].state[0][..., :6, :]
    assert keys.reshape(-1).tolist() == [0, 1, 2, 3, 4, 5]
    # A diverging request shares only the common part.
    assert cache.plan([1, 2, 9, 9]) == PrefixReuse(entry=2, reuse=2, copy=True)
    # Storing what an entry already holds keeps the entry; a longer one replaces the entries it extends.
    assert not cache.store([1, 2, 3], kv(3))
    assert cache.store([1, 2, 3, 4, 5, 6, 7, 8, 9], kv(9)) and list(cache.entries) == [3]
    # The budget (in tokens) evicts the least recently used; an entry over the budget is not kept.
    assert cache.store([7] * 12, kv(12, seed=7))
    assert list(cache.entries) == [4] and cache.tokens == 12
    assert not cache.store([8] * 21, kv(21))
    assert PrefixCache(0).store([1], kv(1)) is False


def test_an_entry_one_token_longer_than_the_reuse_is_cut_by_that_token() -> None:
    """The same prompt again: the entry holds it whole, the request reuses all but its last token (one to compute)."""
    cache = PrefixCache(budget_tokens=20)
    assert cache.store([1, 2, 3, 4, 5], kv(5))
    plan = cache.plan([1, 2, 3, 4, 5])
    assert plan == PrefixReuse(entry=1, reuse=4, copy=True)
    copied = cache.checkout(plan, lambda: kv(0))
    assert [c.offset for c in copied] == [4, 4] and cache.entries[1].cache[0].offset == 5
    assert copied[1].state[0][..., :4, :].reshape(-1).tolist() == [1000, 1001, 1002, 1003]


def test_the_prefix_cache_picks_the_longest_shared_prefix_of_the_partition_and_counts_hits() -> None:
    """Written out by hand: which entry a prompt reuses, how much of it, and the hit and miss counts the health
    endpoint reports; a cache that cannot cut entries back reuses only entries the prompt extends."""
    assert [common_prefix(a, b) for a, b in (([1, 2], [3, 4]), ([1, 2, 3], [1, 2]), ([], [1]), ([4, 5], [4, 6]))] == [
        0,
        2,
        0,
        1,
    ]
    cache = PrefixCache(budget_tokens=40)
    assert cache.plan([1, 2, 3]) == PrefixReuse() and (cache.hits, cache.misses) == (0, 1)
    assert cache.store([1, 2, 3, 4], kv(4), partition="other")  # another partition's entry, seen first
    assert cache.store([1, 2, 8, 8, 8], kv(5))
    assert cache.store([1, 2, 3, 9], kv(4))
    assert cache.plan([1, 9, 9]) == PrefixReuse(entry=2, reuse=1, copy=True)  # one token shared is reused
    assert cache.plan([1, 2, 3, 4, 5]) == PrefixReuse(entry=3, reuse=3, copy=True)  # "other"'s 4 are not this one's
    assert cache.plan([1, 2, 3, 4, 5], partition="other") == PrefixReuse(entry=1, reuse=4, copy=False)
    assert cache.plan([1, 2, 7]) == PrefixReuse(entry=2, reuse=2, copy=True)  # a tie: the least recently used
    assert cache.plan([5, 6]) == PrefixReuse() and (cache.hits, cache.misses) == (4, 2)
    assert not cache.store([1, 2, 8], kv(3))  # held by this partition's entry 2, after "other"'s entry 1
    assert PrefixCache(5).store([1, 2, 3, 4, 5], kv(5))  # exactly the budget: kept
    lru = PrefixCache(8)
    assert lru.store([1, 1, 1, 1], kv(4)) and lru.store([2, 2, 2, 2], kv(4)) and list(lru.entries) == [1, 2]  # 8 of 8
    assert not lru.store([1, 1], kv(2))  # held by entry 1, which becomes the most recently used
    assert lru.store([3, 3, 3], kv(3)) and list(lru.entries) == [1, 3]  # the least recently used (2) goes
    exact = PrefixCache(budget_tokens=40, cut_back=False)
    assert exact.store([9, 9, 9, 9], kv(4)) and exact.store([1, 2, 3, 4, 5, 6], kv(6))
    assert exact.plan([1, 2, 3, 4]) == PrefixReuse()  # the entry cannot be cut back to 4 tokens
    assert exact.plan([1, 2, 3, 4, 5, 6]) == PrefixReuse()  # nor to all but the prompt's last token
    assert exact.plan([1, 2, 3, 4, 5, 6, 7]) == PrefixReuse(entry=2, reuse=6, copy=False)  # extended: taken whole
    assert exact.plan([3]) == PrefixReuse() and (exact.hits, exact.misses) == (1, 3)


def test_a_missing_entry_starts_from_an_empty_cache() -> None:
    cache = PrefixCache(10)
    fresh = cache.checkout(PrefixReuse(entry=99, reuse=3, copy=False), lambda: kv(0))
    assert fresh[0].offset == 0  # the ranks' prefill check then reports the disagreement


def test_the_broadcast_reads_rank_zeros_fields_and_every_ranks_own() -> None:
    assert checksum([1, 2, 3]) != checksum([1, 3, 2]) and checksum([]) == 0
    channel = Channel(mx.distributed.init())  # a group of one: the gathered rows are this rank's row
    header = channel.exchange({"op": REQUEST, "seq": 5, "pause_ms": 250}, {"pid": 42}, 5.0, "test")
    assert header.op == REQUEST and header.fields["seq"] == 5 and header.fields["pause_ms"] == 250
    assert header.slots == [{**dict.fromkeys(RANK_FIELDS, 0), "pid": 42}]
    assert "pid" not in header.fields and header.fields["checksum"] == 0
    assert channel.tokens([3, 1, 4], 3, 5.0, "test") == [3, 1, 4]
    with pytest.raises(ValueError, match="not fields of the request broadcast"):
        channel.exchange({"pid": 1}, {}, 5.0, "test")  # a rank's own field is not rank 0's to send
    # Two ranks' rows as the all-gather returns them: rank 0's fields come from its row, each slot from its own.
    rows = mx.concatenate(
        [SERVE.header({"op": REQUEST, "seq": 9, "pid": 10}), SERVE.header({"seq": 77, "pid": 11, "last_seq": 8})]
    )
    two = read_header(rows, 2)
    assert two.op == REQUEST and two.fields["seq"] == 9
    assert [s["pid"] for s in two.slots] == [10, 11] and two.slots[1]["last_seq"] == 8


@pytest.mark.parametrize(
    "garbled",
    [
        [SERVE.header({"op": REQUEST}), TOKENS.header({"count": 0})],  # a rank in another phase
        [SERVE.header({"op": 99}), SERVE.header({})],  # an operation no rank sends
        [SERVE.header({"op": REQUEST}), mx.array([12345] * SERVE.width, dtype=mx.int32)],  # garbage
        [SERVE.header({"op": REQUEST}), SERVE.header({})[:-1]],  # rows of different sizes
    ],
    ids=["another-phase", "unknown-op", "garbage", "cut-short"],
)
def test_a_garbled_broadcast_raises_a_mismatch(garbled: list[mx.array]) -> None:
    with pytest.raises(PipelineMismatchError):
        read_header(mx.concatenate(garbled), 2)


# --- batching (--decode-concurrency above 1) -------------------------------------------------------------------------

sampling_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.75, 1.0, 1.875]),  # float32 values: sent as their bits
    top_p=st.sampled_from([1.0, 0.5, 0.25]),
    seed=st.none() | st.integers(0, (1 << 31) - 1),
    repetition_penalty=st.sampled_from([0.0, 1.25, 1.5]),
    repetition_context_size=st.integers(1, 64),
    presence_penalty=st.sampled_from([0.0, -0.5, 2.0]),
    presence_context_size=st.integers(1, 64),
    frequency_penalty=st.sampled_from([0.0, 0.75, -2.0]),
    frequency_context_size=st.integers(1, 64),
    draft=st.booleans(),
)
requests_strategy = st.builds(
    Request,
    id=st.integers(1, 10_000),
    tokens=st.lists(st.integers(0, 50_000), min_size=1, max_size=20),
    max_tokens=st.integers(1, 4096),
    sampling=sampling_strategy,
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=4).map(tuple),
    drawn=st.integers(0, 100),
)
inserts_strategy = st.lists(
    st.builds(
        Insert,
        request=requests_strategy,
        plan=st.builds(PrefixReuse, st.integers(-1, 50), st.integers(0, 30), st.booleans()),
    ),
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(removes=st.lists(st.integers(1, 10_000), max_size=6), inserts=inserts_strategy)
def test_batch_operations_survive_the_broadcast(removes: list[int], inserts: list[Insert]) -> None:
    ops = Ops(removes, inserts)
    values = encode_ops(ops)
    assert all(-(1 << 31) <= v < (1 << 31) for v in values)  # int32 on the wire
    assert decode_ops(values) == ops
    if values:
        with pytest.raises(PipelineMismatchError, match="arrived damaged"):
            decode_ops(values[:-1] if inserts else [*values, 7])


@settings(max_examples=100, deadline=None)
@given(request=requests_strategy, outcome=st.sampled_from(["stop", "length", "cancelled", "failed"]))
def test_requests_and_results_survive_the_link(request: Request, outcome: str) -> None:
    """The link's JSON form of a request and a result reads back equal; a field of the wrong type is refused."""
    assert from_json(Request, to_json(request)) == request
    result = RequestResult(outcome, 1, 2, 3, None if outcome != "failed" else "ValueError: x", 4, 5)  # pyright: ignore[reportArgumentType]
    assert from_json(RequestResult, to_json(result)) == result
    for field, bad in (("id", "x"), ("tokens", [1, "a"]), ("max_tokens", True), ("sampling", {"top_p": "1"})):
        with pytest.raises(ValueError, match=field):
            from_json(Request, {**to_json(request), field: bad})
    with pytest.raises(ValueError, match="outcome"):
        from_json(RequestResult, {**to_json(result), "outcome": "won"})


def test_inserts_of_one_step_sharing_an_entry_copy_it() -> None:
    def insert(request_id: int, entry: int, copy: bool) -> Insert:
        return Insert(Request(request_id, [1, 2, 3], 4), PrefixReuse(entry, 2, copy))

    shared = share_entries([insert(1, 5, False), insert(2, 5, False), insert(3, 6, False), insert(4, -1, False)])
    assert [i.plan.copy for i in shared] == [True, True, False, False]
    assert [i.plan.entry for i in shared] == [5, 5, 6, -1] and [i.request.id for i in shared] == [1, 2, 3, 4]


@pytest.mark.parametrize("top_p,min_p,top_k", [(1.0, 0.0, 0), (0.8, 0.0, 0), (1.0, 0.3, 0), (1.0, 0.0, 3)])
def test_a_request_sampler_draws_what_a_seeded_solo_run_draws(top_p: float, min_p: float, top_k: int) -> None:
    logprobs = mx.log(mx.softmax(mx.array([[0.3, 1.2, -0.4, 0.9, 0.0, 2.1]]), axis=-1))
    params = SamplingParams(0.8, top_p, min_p, top_k)
    sampler = params.keyed_sampler(1234)
    assert sampler is not None and SamplingParams(0.0, top_p, min_p, top_k).keyed_sampler(1234) is None
    ours = [int(sampler(logprobs).item()) for _ in range(40)]
    mx.random.seed(1234)
    solo = make_sampler(0.8, top_p=top_p, min_p=min_p, top_k=top_k)
    assert params.sampler() is not None
    mx.random.seed(1234)
    assert ours == [int(solo(logprobs).item()) for _ in range(40)]
    assert len(set(ours)) > 1  # the draws are random, not one token


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.mark.parametrize(
    "origins,origin,allowed",
    [
        ((), "http://localhost:3000", None),  # the default: no CORS header at all
        (("http://localhost:3000",), "http://localhost:3000", "http://localhost:3000"),
        (("https://a.example", "http://localhost:3000"), "http://localhost:3000", "http://localhost:3000"),
        (("http://localhost:3000",), "http://localhost:3001", None),
        (("*",), "https://anywhere.example", "*"),
    ],
)
def test_cors_headers_only_for_the_given_origins(origins: tuple[str, ...], origin: str, allowed: str | None) -> None:
    pytest.importorskip("starlette", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")
    from starlette.testclient import TestClient

    from pipemlx.serve.app import Api
    from pipemlx.serve.book import Book
    from pipemlx.serve.settings import HttpLimits, ServeSettings

    settings = ServeSettings(model_id="m", http=HttpLimits(api_key="key", cors_origins=origins))
    api = Api(Book(settings, None), None, settings, None)  # no request reaches a rank
    client = TestClient(api.app())
    preflight = client.options("/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT})
    assert preflight.headers.get("access-control-allow-origin") == allowed
    assert preflight.status_code == (200 if allowed else 405 if not origins else 400)  # a preflight carries no key
    answer = client.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer key"})
    assert answer.status_code == 200 and answer.headers.get("access-control-allow-origin") == allowed
    refused = client.get("/v1/models", headers={"Origin": origin})
    assert refused.status_code == 401 and refused.headers.get("access-control-allow-origin") == allowed


@pytest.mark.parametrize(
    "origin", ["http://localhost:3000/", "localhost:3000", "https://a.example/app", "HTTP://A.EXAMPLE"]
)
def test_a_cors_origin_that_no_browser_sends_is_refused(capsys: pytest.CaptureFixture[str], origin: str) -> None:
    from pipemlx import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--allowed-origins", origin])
    assert exit_.value.code == 2
    assert "--allowed-origins: expected * or an origin as browsers send it" in capsys.readouterr().err


def test_cors_origins_reach_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("starlette", reason="pipemlx serve needs the serve extra (pip install -e '.[serve]')")
    import pipemlx.serve
    from pipemlx import cli

    seen: list[tuple[str, ...]] = []
    monkeypatch.setattr(pipemlx.serve, "run_rank", lambda options: seen.append(options.settings.http.cors_origins) or 0)
    assert cli.main(["serve", "--ranks", "1"]) == 0
    assert cli.main(["serve", "--ranks", "1", "--allowed-origins", "*,http://localhost:3000"]) == 0
    assert seen == [(), ("*", "http://localhost:3000")]


def test_stop_text_is_linear_in_the_answer_with_long_stop_strings() -> None:
    """Four stop strings of 200,000 characters and an answer growing to 30,000 characters a few at a time: the
    work per update follows what is new, not the answer or the stops (quadratic before: 79 ms an update at 30k
    characters with 1M-character stops, minutes here)."""
    stops = [c * 200_000 for c in "wxyz"]
    stop_text = StopText(stops)
    text = ""
    started = time.perf_counter()
    sent: list[str] = []
    for i in range(3000):
        text += f"t{i % 10}w x "[: 5 + i % 3]
        sent.append(stop_text.update(text))
    took = time.perf_counter() - started
    assert "".join(sent) + stop_text.finish(text) == text and not stop_text.stopped
    assert took < 5.0, f"{took:.1f} s for 3,000 updates"
