"""Where a rank's weights come from: one source (a folder, the Hub, a peer rank), and its tensors fetched once.

Loading is one pass: :func:`pipemlx.models.loading.load_sharded` resolves the
model it is given into one :class:`WeightSource` (a local folder or a fully
cached Hub snapshot: :class:`FolderSource`; a Hub repo read by HTTP range
requests: :class:`HubSource`; a rank that has the model:
:class:`pipemlx.models.peer.PeerSource`), plans the split from what the source
answers (its config, its safetensors headers), and, when the source is not a
local folder, fetches the byte ranges of the tensors this rank keeps
(:func:`rank_tensors`) into a weight folder of its own in the cache
(:func:`fetch_rank_folder`). A second run finds that folder and fetches
nothing.

A rank's tensor set is a tuple of :class:`TensorPart`: a whole tensor, or a
range of its rows (rows of the first axis are consecutive bytes in a
safetensors file, so a row range is one byte range); the cache key covers the
set, rows included.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..runtime.calibration_cache import cache_dir
from .safetensors import LAYER_NAME, decoder_prefix, read_dir_config, read_header_bytes

LOGGER = logging.getLogger("pipemlx")
CHUNK_BYTES = 16 << 20
"""The most bytes one request asks for (a peer reads, authenticates and sends one chunk at a time)."""
MERGE_GAP_BYTES = 4 << 10
"""Two ranges of one file closer than this are fetched as one (the bytes between them are dropped)."""
DONE_FILE = "pipemlx-weights.json"
"""Written last into a rank's weight folder, before the folder is renamed into place: what it holds."""
WEIGHTS_FILE = "model.safetensors"
METADATA_FILE = re.compile(
    r"^(?!model.*\.safetensors$)(?!model\.safetensors\.index\.json$).*"
    r"(\.json|\.py|\.tiktoken|\.txt|\.jsonl|\.jinja|tokenizer\.model|tiktoken\.model)$"
)
"""Files a rank's folder copies besides its weights: config, tokenizer files, chat template (no weight index)."""
EMBEDDING_SEGMENT = re.compile(r"(?:embed_tokens|embeddings?|wte|tok_embeddings|word_embeddings)\.[^.]+")
HEAD_SEGMENT = re.compile(r"(?:^|\.)lm_head\.")
VOCAB_MODULES = ("model.embed_tokens", "lm_head")
"""The modules whose tensors a rank of a ``head="split"`` pipeline keeps by vocabulary rows (as mlx-lm names them;
:mod:`.vocab_rows` reads the same)."""
WRITEBACK_BYTES = 16 << 20
"""After this many bytes written into a rank's new weight file, the disk write of what is written so far is started
(:class:`_Writeback`), so that the final ``fsync`` waits only for the last of it."""
SYNC_FILE_RANGE_WRITE = 2
"""Linux's flag for ``sync_file_range``: start writing the range's dirty pages to disk, wait for nothing."""
PROGRESS_EVERY_S = 5.0
"""How often a rank that fetches says how far it is."""


class TransferError(OSError):
    """A fetch that failed: a cut or refused transfer, a range of the wrong length, or bytes that fail their check.

    Its message is one line naming the tensor's file, what came and from whom."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: its dtype, shape and absolute byte range in ``file``."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    def to_json(self) -> list[Any]:
        return [self.file, self.dtype, list(self.shape), self.start, self.stop]

    @staticmethod
    def from_json(row: list[Any]) -> TensorInfo:
        return TensorInfo(str(row[0]), str(row[1]), tuple(int(d) for d in row[2]), int(row[3]), int(row[4]))


@dataclass(frozen=True, order=True)
class TensorPart:
    """An entry of a rank's tensor set: tensor ``name`` whole (``rows`` None) or its rows ``rows[0]:rows[1]``.

    A row range is what a rank keeps of a matrix it shares by rows (the embedding or the output head split by
    vocabulary): the rows are consecutive in the file, so the part is one byte range and is written as a tensor
    of that many rows under the same name."""

    name: str
    rows: tuple[int, int] | None = None

    def byte_range(self, info: TensorInfo) -> tuple[int, int]:
        """The absolute byte range of this part in its file."""
        if self.rows is None:
            return info.start, info.stop
        first, last = self.rows
        if not info.shape or not 0 <= first < last <= info.shape[0]:
            raise ValueError(f"rows {first}:{last} of {self.name} (shape {list(info.shape)}) are out of range")
        row = (info.stop - info.start) // info.shape[0]
        return info.start + first * row, info.start + last * row

    def shape(self, info: TensorInfo) -> tuple[int, ...]:
        if self.rows is None:
            return info.shape
        return (self.rows[1] - self.rows[0], *info.shape[1:])


class WeightSource(Protocol):
    """What loading asks of a model's source: its metadata, its headers, byte ranges of its weight files."""

    @property
    def name(self) -> str:
        """The model as the user named it (a folder, a repo id), for messages."""
        ...

    @property
    def local(self) -> bool:
        """Whether :meth:`metadata_root` holds every weight file too (then the rank loads from it directly)."""
        ...

    def identity(self) -> str:
        """What identifies the model's bytes (a folder's path and files, a repo's commit): the cache key's part."""
        ...

    def metadata_root(self) -> Path:
        """A local folder with the model's ``config.json`` and tokenizer files."""
        ...

    def headers(self) -> dict[str, TensorInfo]:
        """Every tensor of the model's weight files (name -> file, dtype, shape, absolute byte range)."""
        ...

    def read(self, file: str, start: int, stop: int) -> Iterator[tuple[int, bytes | memoryview]]:
        """Bytes ``start:stop`` of weight file ``file``, in pieces, each with its offset in the file; raises
        :class:`TransferError` when they do not arrive or fail their check.

        A piece may be a view of a buffer the source reuses: it is valid until the next is asked for. A source
        that checks a whole answer (a peer's keyed hash) raises after its last piece at the latest, so the caller
        writes pieces only where a failure discards them (:func:`fetch_rank_folder`'s temporary folder). A source
        that recovers from a cut transfer goes back to the start of the answer that was cut and sends its bytes
        again (an offset at or before the end of the pieces before it): the last bytes written at an offset are
        the checked ones once the range ends."""
        ...

    def describe(self) -> str:
        """Whom the bytes come from, for progress lines (``the Hub``, ``rank 0 (10.0.0.1:5123)``)."""
        ...


def parse_header(raw: bytes, length: int, file: str, where: str) -> dict[str, TensorInfo]:
    """The tensors of a safetensors header (``raw``, the JSON after the 8-byte length ``length``) of ``file``."""
    try:
        entries: dict[str, Any] = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{file} of {where} is not a safetensors file: its header is not JSON") from None
    entries.pop("__metadata__", None)
    base = 8 + length
    out: dict[str, TensorInfo] = {}
    for name, entry in entries.items():
        begin, end = (int(x) for x in entry["data_offsets"])
        out[name] = TensorInfo(
            file, str(entry["dtype"]), tuple(int(d) for d in entry["shape"]), base + begin, base + end
        )
    return out


def read_file_headers(path: Path, file: str) -> dict[str, TensorInfo]:
    """The tensors of the local safetensors file ``path`` (named ``file`` in the model)."""
    raw = read_header_bytes(path)
    return parse_header(raw, len(raw), file, str(path.parent))


@dataclass(frozen=True)
class FolderSource:
    """A local model folder (or a Hub snapshot holding every weight file): nothing to fetch."""

    root: Path
    label: str = ""
    files: tuple[str, ...] = ()
    """The weight files (default: every ``model*.safetensors`` in ``root``)."""

    @property
    def name(self) -> str:
        return self.label or str(self.root)

    @property
    def local(self) -> bool:
        return True

    def weight_files(self) -> tuple[str, ...]:
        return self.files or tuple(sorted(p.name for p in self.root.glob("model*.safetensors")))

    def identity(self) -> str:
        """The folder's path and each weight file's name, size and modification time: rewritten files, new key."""
        parts = [str(self.root.resolve())]
        for file in self.weight_files():
            stat = (self.root / file).stat()
            parts.append(f"{file}:{stat.st_size}:{stat.st_mtime_ns}")
        return "folder:" + "|".join(parts)

    def metadata_root(self) -> Path:
        return self.root

    def headers(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for file in self.weight_files():
            out.update(read_file_headers(self.root / file, file))
        return out

    def metadata_files(self) -> tuple[str, ...]:
        """The config and tokenizer files a peer may ask for (see :data:`METADATA_FILE`)."""
        return tuple(sorted(p.name for p in self.root.iterdir() if p.is_file() and METADATA_FILE.match(p.name)))

    def read(self, file: str, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
        with open(self.root / file, "rb") as f:
            f.seek(start)
            offset = start
            while offset < stop:
                piece = f.read(min(stop - offset, CHUNK_BYTES))
                if not piece:
                    raise TransferError(f"{file} of {self.name} ends before byte {stop}")
                yield offset, piece
                offset += len(piece)

    def describe(self) -> str:
        return str(self.root)


def tensor_wanted(
    name: str, prefix: str | None, layers: range, *, keep_embedding: bool, keep_head: bool, tied: bool
) -> bool:
    """Whether a rank keeps tensor ``name``: its decoder ``layers`` (under ``prefix``), the input embedding where
    kept (or where the tied head is kept), the output head where kept, and every other tensor (final norm, a
    vision tower). Layers are matched by number, as mlx-lm's ``sharded_load`` does."""
    match = LAYER_NAME.match(name)
    if match is not None and match.group(1) == prefix:
        return int(match.group(2)) in layers
    if prefix is not None and is_embedding(name, prefix):
        return keep_embedding or (tied and keep_head)
    if HEAD_SEGMENT.search(name):
        return keep_head
    return True


def is_embedding(name: str, prefix: str) -> bool:
    """Whether tensor ``name`` is the input embedding held beside the decoder layers (``model.embed_tokens.*``)."""
    rest = name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else ("" if prefix else name)
    return EMBEDDING_SEGMENT.fullmatch(rest) is not None


def is_tied(names: Iterable[str], config: dict[str, Any]) -> bool:
    """Whether the output head is the embedding: the config says so, or no ``lm_head`` tensor exists."""
    flagged = any(bool(c.get("tie_word_embeddings")) for c in (config, config.get("text_config") or {}))
    return flagged or not any(HEAD_SEGMENT.search(n) for n in names)


def rank_layers(split: tuple[int, ...], rank: int, *, lend_mlp: bool) -> range:
    """The decoder layers whose weights rank ``rank`` needs: its own, and with ``lend_mlp`` the previous rank's
    last (whose feed-forward half it runs)."""
    start = sum(split[:rank])
    stop = start + split[rank]
    return range(start - 1 if lend_mlp and rank > 0 else start, stop)


def rank_tensors(
    headers: Mapping[str, TensorInfo],
    config: dict[str, Any],
    split: tuple[int, ...],
    rank: int,
    *,
    lend_mlp: bool = False,
    head: str = "all",
) -> tuple[TensorPart, ...]:
    """The tensor set of rank ``rank`` of a pipeline with layers per rank ``split`` (sorted by name).

    With ``head="split"`` on more than one rank, each tensor of the input embedding and the output head
    (:data:`VOCAB_MODULES`: their weights, and scales and biases where quantized) is this rank's rows of the
    vocabulary, ``[V*r/S, V*(r+1)/S)`` as :func:`pipemlx.models.vocab_head.row_range` gives them (the rows
    :func:`pipemlx.models.vocab_rows.preread_vocabulary` reads); every other tensor is whole."""
    listed = list(headers)
    prefix = decoder_prefix(listed)
    tied = is_tied(listed, config)
    layers = rank_layers(split, rank, lend_mlp=lend_mlp)
    keep_head = head != "last" or rank == len(split) - 1
    keep_embedding = rank == 0 or head == "split"  # head="split": every rank reads its rows of it (vocab_rows)
    by_rows = head == "split" and len(split) > 1
    parts: list[TensorPart] = []
    for name in sorted(listed):
        if not tensor_wanted(name, prefix, layers, keep_embedding=keep_embedding, keep_head=keep_head, tied=tied):
            continue
        vocab = headers[name].shape[0] if headers[name].shape else 0
        if by_rows and vocab and any(name.startswith(m + ".") for m in VOCAB_MODULES):
            parts.append(TensorPart(name, (vocab * rank // len(split), vocab * (rank + 1) // len(split))))
        else:
            parts.append(TensorPart(name))
    return tuple(parts)


def weights_root() -> Path:
    """Where the ranks' weight folders are: ``weights/`` in pipemlx's cache folder (``$PIPEMLX_CACHE_DIR``)."""
    return cache_dir() / "weights"


def folder_key(identity: str, parts: Iterable[TensorPart]) -> str:
    """The cache key of a rank's weight folder: the source's identity and the tensor set, rows included."""
    digest = hashlib.sha256(identity.encode())
    for part in sorted(parts):
        digest.update(f"\n{part.name}:{part.rows}".encode())
    return digest.hexdigest()[:32]


@dataclass
class FetchCount:
    """Bytes fetched so far (tensor bytes, as they arrive), for progress lines and the load exchange."""

    fetched: int = 0
    total: int = 0
    requests: int = 0
    """Requests answered (headers and metadata too): progress while nothing large arrives."""


def fetch_rank_folder(
    source: WeightSource,
    parts: tuple[TensorPart, ...],
    *,
    who: str = "",
    count: FetchCount | None = None,
    headers: dict[str, TensorInfo] | None = None,
) -> Path:
    """A weight folder holding ``parts`` of ``source`` (config and tokenizer files beside): from the cache, else
    fetched by byte ranges into a temporary folder renamed into place once every range arrived and passed its
    check. A failed fetch removes its temporary folder and raises; no folder that looks complete is left."""
    count = count if count is not None else FetchCount()
    final = weights_root() / folder_key(source.identity(), parts)
    if (final / DONE_FILE).is_file():
        return final
    headers = headers if headers is not None else source.headers()
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise ValueError("a tensor set names a tensor twice (one entry per tensor: its rows as one range)")
    missing = [p.name for p in parts if p.name not in headers]
    if missing:
        raise ValueError(f"{source.name} has no tensor {missing[0]}")
    spans = [(p, headers[p.name], *p.byte_range(headers[p.name])) for p in parts]
    count.total = sum(stop - start for _, _, start, stop in spans)
    temporary = final.with_name(f"{final.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    temporary.mkdir(parents=True)
    try:
        meta = source.metadata_root()
        for path in meta.iterdir():
            if path.is_file() and METADATA_FILE.match(path.name):
                shutil.copyfile(path, temporary / path.name)
        layout: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
        offset = 0
        for part, info, start, stop in spans:
            layout[part.name] = {
                "dtype": info.dtype,
                "shape": list(part.shape(info)),
                "data_offsets": [offset, offset + stop - start],
            }
            offset += stop - start
        text = json.dumps(layout, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(temporary / WEIGHTS_FILE, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            out.flush()
            body, fd = out.tell(), out.fileno()
            reporter = _Reporter(source, who, count)
            writeback = _Writeback(fd)
            for file, start, stop, members in _merged(spans):
                reach, first = start, 0  # bytes before ``reach`` arrived; members before ``first`` end before
                for position, piece in source.read(file, start, stop):
                    if not start <= position <= reach:
                        raise TransferError(f"{source.describe()} sent bytes of {file} from {position}, not {reach}")
                    if position < reach:  # a resumed transfer sends an answer again: write it again
                        first = 0
                    # write the bytes of the members this piece covers, each at its place in the new file
                    piece_end = position + len(piece)
                    view = memoryview(piece)
                    for part, _, begin, end in members[first:]:
                        if begin >= piece_end:
                            break
                        lo, hi = max(begin, position), min(end, piece_end)
                        if lo < hi:
                            at = body + layout[part.name]["data_offsets"][0] + (lo - begin)
                            _write_at(fd, view[lo - position : hi - position], at)
                            writeback.wrote(hi - lo)
                    while first < len(members) and members[first][3] <= piece_end:
                        first += 1
                    count.fetched += max(0, piece_end - max(position, reach))  # new bytes only
                    reach = max(reach, piece_end)
                    reporter.maybe_show()
                if reach != stop:
                    raise TransferError(f"{file} of {source.name}: {reach - start} of {stop - start} bytes arrived")
            out.flush()
            os.fsync(out.fileno())
        record = {
            "source": source.identity(),
            "tensors": [[p.name, p.rows] for p in parts],
            "rows_of": {p.name: headers[p.name].shape[0] for p in parts if p.rows is not None},
            "bytes": count.total,
        }
        (temporary / DONE_FILE).write_text(json.dumps(record))
        reporter.show(final=True)
        try:
            os.rename(temporary, final)
        except OSError:  # another process of this machine finished the same folder first
            if not (final / DONE_FILE).is_file():
                raise
            shutil.rmtree(temporary, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return final


def _merged(
    spans: list[tuple[TensorPart, TensorInfo, int, int]],
) -> Iterator[tuple[str, int, int, list[tuple[TensorPart, TensorInfo, int, int]]]]:
    """The spans grouped into ranges to request: per file, sorted by start, neighbours closer than the gap
    merged (a group's members are sorted by start; the range ends at their furthest end)."""
    ordered = sorted(spans, key=lambda s: (s[1].file, s[2]))
    group: list[tuple[TensorPart, TensorInfo, int, int]] = []
    reach = 0
    for span in ordered:
        if group and (span[1].file != group[-1][1].file or span[2] - reach > MERGE_GAP_BYTES):
            yield group[0][1].file, group[0][2], reach, group
            group, reach = [], 0
        group.append(span)
        reach = max(reach, span[3])
    if group:
        yield group[0][1].file, group[0][2], reach, group


class _Writeback:
    """Starts the disk write of a file being written every :data:`WRITEBACK_BYTES` bytes (Linux's
    ``sync_file_range`` with :data:`SYNC_FILE_RANGE_WRITE`, through ``ctypes``), so that the disk writes while the
    bytes still arrive and the ``fsync`` that ends the fetch waits only for the last of them (in the fetching rank's
    profile that ``fsync`` was a third of the time). Only a hint: where the call is missing (macOS) or fails, nothing
    happens, and the ``fsync`` alone makes the file durable, as before."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = 0
        self.started = 0
        """Writebacks started (tests count them)."""
        self._call: Any = None
        try:
            call: Any = ctypes.CDLL(None, use_errno=True).sync_file_range
            call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            call.restype = ctypes.c_int
            self._call = call
        except (OSError, AttributeError, TypeError):
            pass

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written: start the disk write of the whole file once enough are pending."""
        self.pending += n
        if self.pending < WRITEBACK_BYTES or self._call is None:
            return
        self.pending = 0
        if self._call(self.fd, 0, 0, SYNC_FILE_RANGE_WRITE) == 0:  # offset 0, length 0: the whole file
            self.started += 1


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` into file ``fd`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _Reporter:
    """Progress lines of a fetch: bytes, rate and from whom, every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, source: WeightSource, who: str, count: FetchCount) -> None:
        self.source, self.who, self.count = source, who, count
        self.began = self.shown = time.monotonic()

    def maybe_show(self) -> None:
        if time.monotonic() - self.shown >= PROGRESS_EVERY_S:
            self.show()

    def show(self, final: bool = False) -> None:
        self.shown = time.monotonic()
        took = max(self.shown - self.began, 1e-9)
        what = "fetched" if final else "fetching"
        LOGGER.warning(
            "pipemlx: %s%s %.1f of %.1f MB of its tensors from %s (%.1f MB/s)",
            f"{self.who} " if self.who else "",
            what,
            self.count.fetched / 1e6,
            self.count.total / 1e6,
            self.source.describe(),
            self.count.fetched / 1e6 / took,
        )


def config_of(source: WeightSource) -> dict[str, Any]:
    """The source's ``config.json``."""
    return read_dir_config(source.metadata_root())


def header_bytes(headers: dict[str, TensorInfo]) -> int:
    """Bytes of the safetensors headers of the files ``headers`` spans (8-byte length and JSON each)."""
    firsts: dict[str, int] = {}
    for info in headers.values():
        firsts[info.file] = min(firsts.get(info.file, info.start), info.start)
    return sum(firsts.values())
