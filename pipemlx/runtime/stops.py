"""Stop sequences: the token ids, alone or in sequences, that end a decode, and where a stream of tokens stands in them.

One matcher serves both decodes, :func:`pipemlx.generate_step` and :class:`pipemlx.BatchGenerator`, so both stop at
the same tokens: a stream stops at the token that completes one of its sequences, whatever came before it (sequences
may overlap), as mlx-lm's ``StopSequences`` automaton stops its ``BatchGenerator``. A :class:`StopSet` is the
sequences, checked and compared by the ranks (:meth:`StopSet.fingerprint`); a :class:`StopMatcher` is one stream's
position in them, which a decode step with guesses may also look ahead from (:meth:`StopMatcher.first_stop`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

from mlx_lm.generate import StopSequences

from ..schedule.batch_plan import fingerprint

Stops = StopSequences | Iterable[int | Sequence[int]]
"""What ``BatchGenerator.insert`` takes per request: mlx-lm's ``StopSequences``, or token ids and sequences of them
(an int is a sequence of one)."""


class StopSet:
    """A set of stop sequences, each of one token or more; iterating it gives them as tuples of token ids."""

    def __init__(self, sequences: Iterable[tuple[int, ...]] = ()) -> None:
        self.sequences = frozenset(sequences)
        self.longest = max((len(s) for s in self.sequences), default=1)
        by_last: dict[int, list[tuple[int, ...]]] = {}
        for sequence in self.sequences:
            by_last.setdefault(sequence[-1], []).append(sequence)
        self._by_last = by_last  # a token can end only the sequences that end with it

    @classmethod
    def of(cls, entries: Iterable[int | Sequence[int]], name: str = "stop_tokens") -> StopSet:
        """Token ids and sequences of them (an int is a sequence of one); an empty sequence raises ``ValueError``
        naming the argument ``name`` (on every rank alike, before anything is sent)."""
        sequences: list[tuple[int, ...]] = []
        for entry in entries:
            sequence = (int(entry),) if isinstance(entry, int) else tuple(int(t) for t in entry)
            if not sequence:
                raise ValueError(f"{name} holds an empty sequence; every stop sequence needs at least one token")
            sequences.append(sequence)
        return cls(sequences)

    @classmethod
    def given(cls, stops: Stops, name: str = "stop_sequences") -> StopSet:
        """:meth:`of`, or the sequences of mlx-lm's ``StopSequences`` (which skips empty ones)."""
        if isinstance(stops, StopSequences):
            return cls(_mlx_lm_sequences(stops))
        return cls.of(stops, name)

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self.sequences)

    def __or__(self, other: StopSet) -> StopSet:
        return StopSet(self.sequences | other.sequences)

    def ends(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` (the latest ones) end with one of the sequences."""
        if not tokens:
            return False
        n = len(tokens)
        return any(len(s) <= n and tuple(tokens[n - len(s) :]) == s for s in self._by_last.get(tokens[-1], ()))

    def matcher(self) -> StopMatcher:
        """A stream's position before its first token."""
        return StopMatcher(self)

    def fingerprint(self) -> int:
        """The sequences as one number the ranks compare: each sequence's tokens + 1, then 0, in sorted order."""
        return fingerprint(t for s in sorted(self.sequences) for t in (*(x + 1 for x in s), 0))


class StopMatcher:
    """Where one stream of tokens stands in a :class:`StopSet`: its latest tokens, as many as the longest sequence."""

    def __init__(self, stops: StopSet) -> None:
        self.stops = stops
        self.recent: list[int] = []
        self.stopped = False  # the latest token completed a sequence

    def advance(self, token: int) -> bool:
        """Take the stream's next token; whether it completes a stop sequence (as mlx-lm's matcher's ``advance``)."""
        self.recent.append(token)
        del self.recent[: -self.stops.longest]
        self.stopped = self.stops.ends(self.recent)
        return self.stopped

    def first_stop(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, were they the stream's next ones, are taken up to and including the first that
        completes a stop sequence (all of them when none does); the matcher stays where it is."""
        recent = list(self.recent)
        for i, token in enumerate(tokens):
            recent.append(token)
            if self.stops.ends(recent):
                return i + 1
        return len(tokens)


def _mlx_lm_sequences(stops: StopSequences) -> set[tuple[int, ...]]:
    """The sequences of mlx-lm's automaton, read back from its trie: a node where a sequence ends names it in its
    ``__match__`` entry (a node where none ends may name one that ends there too, a suffix of its path)."""
    found: set[tuple[int, ...]] = set()
    nodes = [cast(dict[Any, Any], cast(Any, stops)._root)]
    while nodes:
        node = nodes.pop()
        match = node.get("__match__")
        if match is not None:
            found.add(tuple(int(t) for t in match[0]))
        nodes.extend(child for key, child in node.items() if key not in ("__fail__", "__match__"))
    return found
