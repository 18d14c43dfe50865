"""Recover the demo model's training text from Debian's ``r-cran-janeaustenr`` package.

The package ships Jane Austen's six novels (Project Gutenberg's public-domain
texts, one line per element of an R character vector) in R's lazy-load data
base ``data/Rdata.rdb`` + ``Rdata.rdx``. This script reads that format with a
small reader of R's serialization (XDR, version 2 or 3; only the types these
files use) and writes one novel as gzipped UTF-8 text.

Usage::

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    python -m pipemlx.demo.extract_text pkg/usr/lib/R/site-library/janeaustenr/data \\
        prideprejudice pipemlx/demo/pride_and_prejudice.txt.gz
"""

from __future__ import annotations

import argparse
import gzip
import struct
import zlib
from pathlib import Path
from typing import Any, cast

NIL_TYPES = (242, 251, 252, 253, 254)
SYMBOL, PAIRLIST, CHARS, LOGICAL, INTEGER, REAL, STRINGS, LIST, EXPRESSIONS, REFERENCE = (
    1,
    2,
    9,
    10,
    13,
    14,
    16,
    19,
    20,
    255,
)


class _Reader:
    """Reads one serialized R object from ``data`` (after the header)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0
        self.symbols: list[Any] = []

    def int(self) -> int:
        (value,) = struct.unpack(">i", self.data[self.at : self.at + 4])
        self.at += 4
        return value

    def numbers(self, fmt: str, size: int) -> list[Any]:
        count = self.int()
        values = list(struct.unpack(f">{count}{fmt}", self.data[self.at : self.at + size * count]))
        self.at += size * count
        return values

    def object(self) -> Any:
        flags = self.int()
        kind, has_attributes, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in NIL_TYPES:
            return None
        if kind == REFERENCE:
            return self.symbols[(flags >> 8) - 1]
        if kind == SYMBOL:
            name = self.object()
            self.symbols.append(name)
            return name
        if kind == CHARS:
            length = self.int()
            if length == -1:
                return None
            text = self.data[self.at : self.at + length].decode("utf-8", "replace")
            self.at += length
            return text
        if kind == PAIRLIST:
            if has_attributes:
                self.object()
            tag = self.object() if has_tag else None
            head = (tag, self.object())
            rest = self.object()
            return [head, *(rest if isinstance(rest, list) else [])]  # pyright: ignore[reportUnknownArgumentType]
        if kind in (STRINGS, LIST, EXPRESSIONS):
            value: Any = [self.object() for _ in range(self.int())]
        elif kind in (LOGICAL, INTEGER):
            value = self.numbers("i", 4)
        elif kind == REAL:
            value = self.numbers("d", 8)
        else:
            raise ValueError(f"R type {kind} at byte {self.at} is not supported by this reader")
        if has_attributes:
            return value, dict(self.object())
        return value


def unserialize(data: bytes) -> Any:
    """The R object serialized in ``data`` (``X\\n`` format); attributes come back as ``(value, dict)``."""
    if data[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    reader = _Reader(data)
    reader.at = 2
    version = reader.int()
    reader.int()
    reader.int()
    if version == 3:
        encoding_length = reader.int()  # then the native encoding's name
        reader.at += encoding_length
    return reader.object()


def read_lazy_load(directory: Path, name: str) -> list[str]:
    """The character vector ``name`` from the lazy-load data base ``Rdata.rdb`` / ``Rdata.rdx`` in ``directory``."""
    index, _ = unserialize(gzip.decompress((directory / "Rdata.rdx").read_bytes()))
    offsets, attributes = index[0]
    names: list[str] = attributes["names"]
    if name not in names:
        raise KeyError(f"{name!r} is not in {directory}; it holds {names}")
    start, length = offsets[names.index(name)]
    blob = (directory / "Rdata.rdb").read_bytes()[start : start + length]
    value = unserialize(zlib.decompress(blob[4:]))
    lines = cast("list[str | None]", value[0] if isinstance(value, tuple) else value)
    return [line or "" for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("data_dir", type=Path, help="janeaustenr/data folder of the unpacked package")
    parser.add_argument("novel", help="emma, mansfieldpark, northangerabbey, persuasion, prideprejudice, ...")
    parser.add_argument("output", type=Path, help="where to write the gzipped text")
    args = parser.parse_args()
    text = "\n".join(read_lazy_load(args.data_dir, args.novel)).strip() + "\n"
    with gzip.open(args.output, "wt", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {len(text)} characters to {args.output}")


if __name__ == "__main__":
    main()
