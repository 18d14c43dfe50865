"""Streamed text is always valid: rank 0's :class:`Reply` over real tokens of random Unicode text (no server).

The demo model's tokenizer is byte-level with a 1,024-token vocabulary, so accented letters, CJK and emoji
are split into several byte tokens: every character of more than one byte crosses a token boundary. A
:class:`Reply` is fed the tokens one by one, as rank 0's loop feeds it, with stop strings cut from the same
text (so they match across token boundaries, inside and around multi-byte characters). What it streams must
never take anything back (every piece extends the text before it: no piece ends inside a character, which
would show U+FFFD and then change), and its pieces must join to mlx-lm's detokenizer on the full token list,
cut where generation stops. It is checked with the demo's detokenizer (mlx-lm's ``BPEStreamingDetokenizer``),
mlx-lm's ``NaiveStreamingDetokenizer``, and a plain ``decode`` of the tokens so far (which shows unfinished
characters as U+FFFD: the server holds those back whatever detokenizer the tokenizer brings).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import PROFILE
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, NaiveStreamingDetokenizer, TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from pipemlx.demo import MODEL_DIR
from pipemlx.serve.book import Event, Reply, Ticket
from pipemlx.serve.requests import Request


@cache
def tokenizer() -> TokenizerWrapper:
    return load_tokenizer(MODEL_DIR)


class PlainDecode:
    """A detokenizer that decodes every token so far: an unfinished character shows as U+FFFD."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped
        self.tokens: list[int] = []

    def add_token(self, token: int) -> None:
        self.tokens.append(token)

    def finalize(self) -> None:
        pass

    @property
    def text(self) -> str:
        return str(self.wrapped.decode(self.tokens))


DETOKENIZERS: dict[str, Callable[[Any], Any]] = {
    "bpe": lambda t: BPEStreamingDetokenizer(t._tokenizer),  # pyright: ignore[reportPrivateUsage]
    "naive": lambda t: NaiveStreamingDetokenizer(t._tokenizer),  # pyright: ignore[reportPrivateUsage]
    "plain": lambda t: PlainDecode(t._tokenizer),  # pyright: ignore[reportPrivateUsage]
}


@dataclass
class FakeTokenizer:
    """What :class:`Reply` reads from the tokenizer: a fresh detokenizer and the end-of-sequence ids."""

    detokenizer: Any
    eos_token_ids: tuple[int, ...] = ()


def stream(tokens: list[int], stops: tuple[str, ...], detokenizer: Any) -> tuple[list[str], bool]:
    """Feed ``tokens`` to a Reply as rank 0's loop does; return the streamed pieces and whether a stop ended it."""
    pieces: list[str] = []
    job = Ticket(
        Request(1, [1], len(tokens), stop=stops),
        "completion",
        0,
        asyncio.new_event_loop(),
        asyncio.Queue(),
        stream=True,
    )

    def emit(event: Event) -> None:
        if event.kind == "text":
            pieces.append(event.text)

    job.emit = emit  # the HTTP side's queue is not needed here
    reply = Reply(job, FakeTokenizer(detokenizer))
    stopped = False
    for token in tokens:
        if reply.token(token):
            stopped = True
            break
    tail = reply.finish()
    if tail:
        pieces.append(tail)
    job.loop.close()
    return pieces, stopped


def expected_text(tokens: list[int], stops: tuple[str, ...], make: Callable[[], Any]) -> str:
    """mlx-lm's detokenizer on the full token list, cut at the first stop string seen after some token."""
    seen = make()
    for token in tokens:
        seen.add_token(token)
        found = [i for i in (seen.text.find(s) for s in stops) if i >= 0]
        if found:
            return str(seen.text[: min(found)])
    full = make()
    for token in tokens:
        full.add_token(token)
    full.finalize()
    # A stop string that only the finalized text shows (the detokenizer held back its last character, a
    # trailing space say, until the end) still ends the answer before it, as OpenAI's stop does.
    found = [i for i in (str(full.text).find(s) for s in stops) if i >= 0]
    return str(full.text)[: min(found)] if found else str(full.text)


UNICODE = st.characters(codec="utf-8", exclude_characters="\ufffd", exclude_categories=["Cs", "Cc"])
TEXT = st.text(UNICODE, min_size=1, max_size=24) | st.sampled_from(
    ["café naïve", "日本語のテキスト", "a😀b🎉c", "Ωμέγα – ñ"]
)


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, tuple[str, ...]]:
    """Some Unicode text and up to three stop strings, most cut from the text itself."""
    text = draw(TEXT)
    stops: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + draw(st.integers(1, 3))])
        else:
            stops.append(draw(st.text(UNICODE, min_size=1, max_size=3)))
    return text, tuple(stops)


@pytest.mark.parametrize("kind", list(DETOKENIZERS))
@settings(max_examples=1000 if PROFILE == "thorough" else 80, deadline=None)
@given(case=cases())
def test_streamed_text_never_ends_inside_a_character_and_equals_mlx_lm(
    kind: str, case: tuple[str, tuple[str, ...]]
) -> None:
    text, stops = case
    wrapper = tokenizer()
    tokens = list(wrapper.encode(text, add_special_tokens=False))
    pieces, stopped = stream(tokens, stops, DETOKENIZERS[kind](wrapper))
    expected = expected_text(tokens, stops, lambda: DETOKENIZERS[kind](wrapper))  # mlx-lm's detokenizer, whole
    so_far = ""
    for piece in pieces:
        so_far += piece
        # Nothing streamed is taken back: each prefix sent is a prefix of what mlx-lm's detokenizer gives in the end.
        assert expected.startswith(so_far), (so_far, expected, text, stops)
        assert "\ufffd" not in piece, (pieces, text)  # the text holds none: a piece ended inside a character
    whole = "".join(pieces)
    assert whole == expected, (whole, expected, text, stops)
    assert not stopped or any(s in text for s in stops)  # only a stop string in the text ends it early


def test_a_split_emoji_is_sent_whole() -> None:
    """The four bytes of an emoji come as four tokens: nothing is sent until the last one."""
    wrapper = tokenizer()
    tokens = list(wrapper.encode("ok 😀!", add_special_tokens=False))
    pieces, _ = stream(tokens, (), PlainDecode(wrapper._tokenizer))  # pyright: ignore[reportPrivateUsage]
    assert "".join(pieces) == "ok 😀!"
    assert all("\ufffd" not in p for p in pieces), pieces
