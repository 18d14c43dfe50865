"""docs/planning.md's worked 70B example is what `pipemlx split` prints for Llama-3.1-70B's config and header."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from header_only import llama_3_1_70b

from pipemlx.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "planning.md"


def examples() -> list[tuple[list[str], str]]:
    """Every ``$ pipemlx split llama-3.1-70b ...`` block of the doc: its arguments and the output shown."""
    found: list[tuple[list[str], str]] = []
    for block in re.findall(r"```\n(\$ pipemlx split llama-3\.1-70b.*?)```", DOC.read_text(), re.S):
        command, _, output = block.partition("\n")
        found.append((shlex.split(command)[2:], output.strip()))
    return found


def test_the_doc_has_the_8k_and_32k_examples() -> None:
    shown = [" ".join(argv) for argv, _ in examples()]
    assert any("--context 8k" in s for s in shown) and any("--context 32k" in s for s in shown)


@pytest.mark.parametrize("argv,expected", examples())
def test_worked_example_matches_the_command(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = llama_3_1_70b(tmp_path / "llama-3.1-70b", bits=None)
    status = main(["split", str(folder), *argv[2:]])
    out, err = capsys.readouterr()
    printed = (out + err).strip().replace(str(folder), "llama-3.1-70b")
    assert printed == expected
    assert status == (0 if out else 2)
