"""The wire protocol: every message the ranks exchange to agree with each other, declared once.

Each message is one all-gather of one row per rank. A row is a header of named
integer fields followed by an optional payload of floats (log-probabilities,
sampled tokens, the shared output head's best logits):

``[kind, status, payload width, *fields] + payload``

:class:`Message` declares a message's kind and fields; it builds a rank's row
(lazily, so a decode step's token can be a field computed in the same graph),
and reads the gathered rows back into a :class:`Table`, checking that every
rank sent the same kind of message with the same payload width, that every
status is known, and that the fields marked ``agreed`` hold one value on every
rank. Every rank holds the same rows, so every rank raises the same
:class:`PipelineMismatchError`, naming the field and each rank's value.

The header travels as ``int32``; in a message with a payload it is reinterpreted
as ``float32`` bits beside the payload (and back when read), so every field is
exact whatever its size and one collective carries the whole message.

Adding a field to a message is one edit: a :class:`Field` in its declaration
below. The rank that fills it passes the value by name; every rank reads it by
name from the :class:`Table`; ``agreed=True`` makes the ranks compare it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import cast

import mlx.core as mx

from ..errors import PipelineMismatchError
from .caches import UNCOUNTED
from .waits import wait_for


class Kind(IntEnum):
    """What a message is: the first field of every row, so a rank in another phase shows as a mismatch."""

    HANDSHAKE = 0x7E01
    AGREE = 0x7E02
    DECODE = 0x7E03
    TICK = 0x7E04
    SERVE = 0x7E05
    TOKENS = 0x7E06
    CALIBRATE = 0x7E07
    MEMORY = 0x7E08
    GUESSES = 0x7E09
    PASS = 0x7E11


class Status(IntEnum):
    """A rank's word on whether to go on, in every message."""

    OK = 0
    CANCEL = 1  # the rank's consumer stopped, or its should_cancel said yes
    FAILED = 2  # a callback raised on the rank
    CHUNK_FAILED = 3  # the model raised on the rank: it stood in for its layers (runtime/failure.py)
    END = 4  # the rank wants no more tokens (max_tokens reached, or a stop token yielded)


PREFIX = ("kind", "status", "payload")  # the fields every row begins with


def _plain(value: int) -> object:
    return value


@dataclass(frozen=True)
class Field:
    """One named integer of a message's header."""

    name: str
    agreed: bool = False  # every rank must send the same value, except unknown (a rank that cannot know it)
    unknown: int | None = None
    show: Callable[[int], object] = _plain  # turns a value into what an error message shows


def agreed(name: str, *, unknown: int | None = None, show: Callable[[int], object] = _plain) -> Field:
    """A :class:`Field` every rank must send alike."""
    return Field(name, True, unknown, show)


@dataclass(frozen=True)
class Table:
    """A gathered message, every rank's row: ``table["name"]`` is that field's values, indexed by rank."""

    message: Message
    columns: Mapping[str, list[int]]
    payloads: list[list[float]]

    def __getitem__(self, name: str) -> list[int]:
        return self.columns[name]

    @property
    def statuses(self) -> list[Status]:
        return [Status(s) for s in self.columns["status"]]

    def ranks_with(self, *statuses: Status) -> tuple[int, ...]:
        """The ranks whose status is one of ``statuses``."""
        return tuple(r for r, s in enumerate(self.statuses) if s in statuses)

    @property
    def all_ok(self) -> bool:
        return all(s == Status.OK for s in self.statuses)

    def last(self, name: str) -> int:
        """The last rank's value of ``name`` (what the rank that samples says)."""
        return self.columns[name][-1]


@dataclass(frozen=True)
class Message:
    """One kind of message: its :class:`Kind`, its header's fields (after :data:`PREFIX`), and what it is called."""

    kind: Kind
    fields: tuple[Field, ...]
    name: str
    _index: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [*PREFIX, *(f.name for f in self.fields)]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a field name is used twice: {names}")
        object.__setattr__(self, "_index", {n: i for i, n in enumerate(names)})

    @property
    def width(self) -> int:
        """Header integers per row."""
        return len(PREFIX) + len(self.fields)

    def header(self, values: Mapping[str, int | mx.array], status: int = Status.OK, payload: int = 0) -> mx.array:
        """This rank's header, ``int32``: ``values`` by field name (0 where left out); a value may be a lazy scalar."""
        unknown = set(values) - set(self._index)
        if unknown:
            raise ValueError(f"{self.name} has no field {sorted(unknown)}")
        numbers = [0] * self.width
        numbers[0], numbers[1], numbers[2] = int(self.kind), int(status), payload
        lazy: dict[int, mx.array] = {}
        for name, value in values.items():
            if isinstance(value, mx.array):
                lazy[self._index[name]] = value
            else:
                numbers[self._index[name]] = int(value)
        header = mx.array(numbers, dtype=mx.int32)
        if not lazy:
            return header
        parts: list[mx.array] = []
        start = 0
        for i in sorted(lazy):  # the constants between the lazy values as whole arrays
            if i > start:
                parts.append(mx.array(numbers[start:i], dtype=mx.int32))
            parts.append(mx.reshape(lazy[i], (1,)).astype(mx.int32))
            start = i + 1
        if start < len(numbers):
            parts.append(mx.array(numbers[start:], dtype=mx.int32))
        return mx.concatenate(parts)

    def row(
        self, values: Mapping[str, int | mx.array], status: int = Status.OK, payload: Sequence[mx.array] = ()
    ) -> mx.array:
        """This rank's row, lazily: the header, then ``payload`` flattened (``int32`` if every part holds integers,
        else ``float32``)."""
        width = sum(p.size for p in payload)
        header = self.header(values, status, width)
        if not payload:
            return header
        if all(mx.issubdtype(p.dtype, mx.integer) for p in payload):  # ids: int32 beside the header
            return mx.concatenate([header, *(mx.reshape(p, (-1,)).astype(mx.int32) for p in payload)])
        body = [mx.reshape(p, (-1,)).astype(mx.float32) for p in payload]
        return mx.concatenate([mx.view(header, mx.float32), *body])

    def read(self, gathered: mx.array, world_size: int, where: str) -> Table:
        """The :class:`Table` of an evaluated all-gather of rows; raises :class:`PipelineMismatchError` (see module)
        whose message names the message ``where`` (``"the handshake"``) alike on every rank."""
        flat = mx.reshape(gathered, (world_size, -1)) if gathered.size % world_size == 0 else None
        if flat is None or flat.shape[1] < self.width:
            raise PipelineMismatchError(f"{where}: the ranks sent rows of different sizes: they are out of step")
        header = flat[:, : self.width]
        heads = cast(list[list[int]], (header if flat.dtype == mx.int32 else mx.view(header, mx.int32)).tolist())
        payloads = cast(list[list[float]], flat[:, self.width :].tolist())
        columns = {name: [row[i] for row in heads] for name, i in self._index.items()}
        kinds = columns["kind"]
        if any(k != self.kind for k in kinds):
            shown = [Kind(k).name.lower() if k in Kind._value2member_map_ else "garbage" for k in kinds]
            raise PipelineMismatchError(
                f"{where}: a rank is not in {self.name} while the others are (messages by rank: {per_rank(shown)})"
            )
        if len(set(columns["payload"])) > 1 or any(len(p) != columns["payload"][0] for p in payloads):
            raise PipelineMismatchError(f"{where}: ranks disagree on the payload width: {per_rank(columns['payload'])}")
        statuses = [s for s in columns["status"] if s not in Status._value2member_map_]
        if statuses:
            raise PipelineMismatchError(f"{where}: unknown status {sorted(set(statuses))}")
        for f in self.fields:
            if f.agreed and len({v for v in columns[f.name] if v != f.unknown}) > 1:
                raise PipelineMismatchError(
                    f"{where}: ranks disagree on {f.name}: {per_rank([f.show(v) for v in columns[f.name]])}"
                )
        return Table(self, columns, payloads)

    def exchange(
        self,
        group: mx.distributed.Group,
        stream: mx.Stream,
        values: Mapping[str, int],
        *,
        status: int = Status.OK,
        timeout: float | None,
        where: str,
        who: str,
    ) -> Table:
        """Gather every rank's header (no payload) and read it: a bounded wait (:func:`~.waits.wait_for`) whose
        error names ``who`` is waiting (``rank 1/2 (layers ...)``) ``where``."""
        with mx.stream(stream):
            gathered = gather(self.header(values, status), group)
        wait_for(gathered, timeout, lambda: f"{who} in {where}")
        return self.read(gathered, group.size(), where)


def gather(row: mx.array, group: mx.distributed.Group) -> mx.array:
    """Every rank's ``row``, lazily: an all-gather (a group of one: the row itself)."""
    return mx.distributed.all_gather(row, group=group) if group.size() > 1 else row


def per_rank(values: Sequence[object]) -> str:
    """``rank 0: a, rank 1: b`` for error messages."""
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


DTYPES = (mx.float16, mx.bfloat16, mx.float32, mx.float64)
"""Activation dtypes as the handshake's ``dtype`` field numbers them (from 1; 0: another dtype)."""
DECODE_SETTINGS = (
    "none (pipeline_prefill)",
    "share_logprobs=False",
    "share_logprobs=True",
    "share_logprobs=False with a sampler or logits processors",
    "share_logprobs=True with a sampler or logits processors",
)
"""What the handshake's ``decode_settings`` values mean: what the decode after the prefill will exchange (a sampler
or logits processors: the last rank's logits, every step, for every rank's own processors and sampler)."""


def decode_settings(share_logprobs: bool, processing: bool) -> int:
    """The handshake's ``decode_settings`` of a decode: an index into :data:`DECODE_SETTINGS`."""
    return 1 + int(share_logprobs) + 2 * int(processing)


def dtype_code(dtype: mx.Dtype | None) -> int:
    """``dtype`` as the handshake sends it (``None``, unknown: 0; MLX's dtypes cannot be compared with ``None``)."""
    return DTYPES.index(dtype) + 1 if dtype is not None and dtype in DTYPES else 0


def _dtype_name(code: int) -> object:
    return str(DTYPES[code - 1]) if 0 < code <= len(DTYPES) else "unknown"


def _step_size(value: int) -> object:
    return "auto" if value == 0 else value


def _decode_settings(value: int) -> object:
    return DECODE_SETTINGS[value] if 0 <= value < len(DECODE_SETTINGS) else value


def _offset(value: int) -> object:
    return "uncounted" if value == UNCOUNTED else value


HANDSHAKE = Message(
    Kind.HANDSHAKE,
    (
        Field("calibration"),  # prefill_step_size="auto": the fingerprint of this rank's cost model (0: none)
        Field("prior"),  # prefill_step_size="auto": the fingerprint of the untimed cost model this rank would plan with
        agreed("num_tokens"),
        agreed("prefill_step_size", show=_step_size),  # 0: "auto"
        agreed("plan_fingerprint"),
        agreed("total_layers"),
        agreed("hidden_size"),
        agreed("dtype", show=_dtype_name),
        agreed("decode_settings", show=_decode_settings),
        agreed("lend_mlp"),
        agreed("lend_heads"),
        agreed("cache_offset", unknown=UNCOUNTED, show=_offset),  # a reused prefix
        agreed("speculation"),  # the decode after the prefill: a fingerprint of its proposer (0: none)
        Field("layer_start"),  # the layer ranges must split the model contiguously (checked by the handshake)
        Field("layer_stop"),
    ),
    "the handshake",
)
"""Opens a prefill: every rank is about to run the same plan over one contiguous split."""

AGREE = Message(Kind.AGREE, (agreed("step"), Field("failed_chunk")), "an agreement point")
"""Closes a prefill step; ``failed_chunk``: the chunk the model raised on (-1: none)."""

MAX_GUESSES = 16
"""The most tokens one decode step of speculative decoding guesses (``num_draft_tokens``)."""
NEXT_GUESSES = (
    Field("next_guesses"),  # the last rank's: how many tokens the next step guesses, the next_i fields
    *(Field(f"next_{i}") for i in range(MAX_GUESSES)),  # the last rank's guesses for the next step
)

DECODE = Message(
    Kind.DECODE,
    (
        agreed("index"),  # the token's number in the request
        agreed("max_tokens"),
        agreed("stop_tokens"),  # a fingerprint of the set
        agreed("guesses"),  # how many proposed tokens follow the step's input (speculative decoding)
        agreed("guessed"),  # a fingerprint of them
        Field("token"),  # the last rank's sampled token (after the accepted guesses)
        Field("accepted"),  # how many guesses the last rank's samples confirmed
        Field("shares_head"),  # this rank may share the output head (greedy, plain head)
        *NEXT_GUESSES,
    ),
    "a decode step",
)
"""One token of :func:`pipemlx.generate_step`; payload: the shared head's best logits, the last rank's logits (a
sampler or logits processors: every rank runs them) or its log-probabilities (``share_logprobs``)."""

GUESSES = Message(Kind.GUESSES, (Field("can_speculate"), *NEXT_GUESSES), "the first guesses")
"""Opens a speculative decode, after its prefill: whether every rank's caches can be cut back at any length
(``can_speculate``), and the last rank's guesses for the first step."""

PASS = Message(
    Kind.PASS,
    (
        agreed("tick"),  # the tick's number in the request
        agreed("in_flight"),  # how many passes every rank holds in flight before the tick
        agreed("max_tokens"),
        agreed("stop_tokens"),  # a fingerprint of the set
        Field("inputs"),  # rank 0's: how many tokens the pass it started in this tick reads (0: none)
        *(Field(f"in_{i}") for i in range(MAX_GUESSES + 1)),  # rank 0's: those tokens, the first and the guesses
        Field("token"),  # the last rank's: its sampled token after the accepted guesses of the pass it verified
        Field("accepted"),  # the last rank's: how many of that pass's guesses its samples confirmed
        Field("serial"),  # rank 0's: 1 when every rank leaves pipelining after this tick (num_draft_tokens="auto")
    ),
    "a pipelined speculation tick",
)
"""One tick of pipelined speculation (``speculation="pipelined"``): every rank computes a different pass, then this
message says which pass rank 0 started and what the last rank decided of the oldest one; payload: the last rank's
log-probabilities of that pass's rows (a sampler or ``share_logprobs``), zeros of the same size elsewhere."""

TICK = Message(
    Kind.TICK,
    (
        agreed("tick"),
        agreed("rows"),
        agreed("uids"),  # a fingerprint of the decoding rows' requests
        agreed("plan"),  # the tick's plan's fingerprint
        agreed("lend_mlp"),
        agreed("lend_heads"),
        agreed("prefixes", unknown=UNCOUNTED),  # a fingerprint of the rows' reused prefix lengths
        Field("failed_decode"),
        Field("failed_uid"),  # + 1; 0: none
        Field("greedy"),  # every live row of this rank's batch is greedy
        Field("failed_sample"),  # 1: this rank's sampling of the last tick's logits raised (failed one tick late)
        Field("last_tick_us"),  # this rank's time of the last tick, in microseconds (decode_groups="auto")
    ),
    "a batch tick",
)
"""One tick of :class:`pipemlx.BatchGenerator`; payload: the last rank's tokens, then the shared head's best logits."""

SERVE = Message(
    Kind.SERVE,
    (
        # Rank 0's fields: the server's next operation.
        Field("op"),  # HELLO, IDLE, REQUEST, SHUTDOWN or STEP (pipemlx.serve.broadcast)
        Field("seq"),  # the step's number
        Field("n_tokens"),  # the length of the encoded operations: the TOKENS message that follows
        Field("pause_ms"),  # IDLE: how long the other ranks wait before the next message
        Field("checksum"),  # of the encoded operations
        # Every rank's own fields: where it stands.
        Field("pid"),
        Field("last_seq"),  # the last request this rank finished
        Field("cache_tokens"),  # positions its cache held when that request ended (-1: discarded)
        Field("outcome"),  # how it ended (pipemlx.serve.broadcast.OUTCOMES)
        Field("bytes_per_token"),  # HELLO: this rank's KV bytes per cached token
        Field("trimmable"),  # HELLO: 1 when every cache of this rank can be cut back at any length
        Field("prefix_entries"),
        Field("prefix_tokens"),
    ),
    "the request broadcast",
)
"""The server's heartbeat and request hand-out (:mod:`pipemlx.serve.broadcast`)."""

TOKENS = Message(Kind.TOKENS, (agreed("count"),), "a token broadcast")
"""Rank 0's token ids (a prompt, a batch step's operations) as an ``int32`` payload; the other ranks send zeros."""

CALIBRATE = Message(Kind.CALIBRATE, (Field("calibration"), Field("prior")), "the calibration")
"""The fingerprint of the figures each rank holds (0: none; :mod:`.calibration_cache`) and of the untimed figures it
would plan with otherwise (:func:`pipemlx.runtime.calibrate.prior_figures`); with a payload, each rank's timings."""

MEMORY = Message(Kind.MEMORY, (Field("bytes_per_position"), Field("budget_kib")), "the memory exchange")
"""Each rank's KV bytes per cached position and its memory budget (:class:`pipemlx.BatchGenerator`)."""
