"""The docs stay true: flags, keywords, the README's Python and every figure's command.

- Every ``--flag`` in README.md and docs/*.md exists where it is used. After ``pipemlx CMD`` in the same
  fenced line, paragraph or table row: in that command's argparse parser (``pipemlx.cli.build_parser``'s
  subparsers; ``split``'s own), the flags renamed in 0.2.0 not counted; after ``benchmarks/x.py``,
  ``examples/x.py`` or ``-m pipemlx.x``: in that script's source. A flag with no command before it: in some
  ``pipemlx`` command, or in a command named earlier in its section. Flags of other programs
  (``mlx.launch``, ``mpirun``, ``pip``...) pass after those programs' names, listed in :data:`OTHER_TOOLS`
  each with its reason.
- Every ``keyword=`` in a call of a pipemlx function shown in those files is a parameter of it.
- Every ```python block of the README runs, on 2 local ranks when it joins a group; a block that cannot run
  on one machine says so on its first line (``# not run: <why>``).
- Every table of docs/performance.md has the command that reproduces it just before it.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pipemlx
from pipemlx.cli import build_parser
from pipemlx.cli.common import RenamedFlag
from pipemlx.runtime.lean_decode import lean_generate_step
from pipemlx.runtime.stage import stage_of

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "# not run:"

OTHER_TOOLS: dict[str, str] = {
    # a regex for the program named before the flag -> why its flags are not pipemlx's
    r"mlx\.launch": "MLX's launcher",
    r"mlx\.distributed_config": "MLX's hostfile writer",
    r"mpirun|mpiexec|ompi_info": "Open MPI",
    r"\bpip3?\b|python -m pip|\buv\b": "the package installer",
    r"\bruff\b|\bpyright\b|lint-imports|pytest": "the linters and test runner",
    r"\bnc\b|\bcurl\b|\bssh\b|\bip\b|\bgit\b|apt-get|\bsudo\b|\bhf\b|huggingface-cli|\bvenv\b": "system tools",
    r"mlx_lm\.\w+|python -m mlx_lm": "mlx-lm's own commands",
}
"""Flags that belong to other programs, recognised by the command named before them."""


GLOBAL_FLAGS = {"--version", "--help"}

FLAG = re.compile(r"(?<![\w\-/.=])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
PIPEMLX_COMMAND = re.compile(r"\bpipemlx\s+(generate|bench|split|plan|doctor|serve)\b")
SCRIPT = re.compile(r"\b((?:benchmarks|examples|tests)/[\w/]+\.py|-m\s+pipemlx(?:\.\w+)+)")


def documents() -> Iterator[tuple[Path, str]]:
    for path in DOCS:
        yield path, path.read_text(encoding="utf-8")


def fences(text: str) -> Iterator[tuple[str, str]]:
    """``(language, body)`` of each fenced block."""
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        yield match.group(1), match.group(2)


def contexts(text: str) -> Iterator[tuple[str, str]]:
    """``(context, earlier)``: where a flag is read, and the text of its section before it (whose last command
    a flag in a context without one belongs to). Contexts: each logical line of a fenced block (backslash
    continuations joined), each table row, and each prose paragraph with its code spans' backticks dropped."""
    for section in re.split(r"^#+ ", text, flags=re.M):
        earlier = ""
        for part in re.split(r"(^```\w*\n.*?^```)", section, flags=re.S | re.M):
            if part.startswith("```"):
                lines = part.replace("\\\n", " ").splitlines()[1:-1]
            else:
                lines = [
                    piece.replace("`", " ").replace("\n", " ")
                    for paragraph in re.split(r"\n\s*\n", part)
                    for piece in (re.findall(r"^\|.*$", paragraph, flags=re.M) or [paragraph])
                ]
            for line in lines:
                yield line, earlier
                earlier += "\n" + line


class _Captured(Exception):
    pass


def split_parser() -> argparse.ArgumentParser:
    """``pipemlx split``'s parser, built inside ``split.main``: caught as it parses."""
    from pipemlx.cli import split

    captured: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        captured.append(self)
        raise _Captured

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        split.main(["--help"])
    except _Captured:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return captured[0]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    found = {"": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    found["split"] = found["plan"] = split_parser()
    return found


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    """The flags a parser takes; the renamed ones of pipemlx 0.1 (refused) are not among them."""
    return {
        option for action in parser._actions if not isinstance(action, RenamedFlag) for option in action.option_strings
    }


def script_flags(script: str) -> set[str] | None:
    """Flags a script or ``-m`` module defines (the quoted ``--x`` in its source), None when not found."""
    if script.startswith("-m"):
        module = script.split()[-1]
        path = ROOT / Path(*module.split(".")).with_suffix(".py")
        if not path.exists():
            path = ROOT / Path(*module.split(".")) / "__main__.py"
    else:
        path = ROOT / script
    if not path.exists():
        return None
    return set(re.findall(r"""["'](--[a-z0-9-]+)""", path.read_text(encoding="utf-8")))


def heads_in(text: str) -> list[tuple[int, str, str]]:
    """The commands named in ``text``: ``(position, kind, name)``, kind ``pipemlx``, ``script`` or ``other``."""
    heads = [(m.start(), "pipemlx", m.group(1)) for m in PIPEMLX_COMMAND.finditer(text)]
    heads += [(m.start(), "script", m.group(1)) for m in SCRIPT.finditer(text)]
    heads += [(m.start(), "other", p) for p in OTHER_TOOLS for m in re.finditer(p, text)]
    return sorted(heads)


def flag_problems() -> list[str]:
    """A flag after a command in the same line, paragraph or table row must be that command's; any other
    flag must be some pipemlx command's, or a flag of a command named earlier in its section."""
    parsers = subparsers()
    every_command = set().union(*(flags_of(p) for p in parsers.values()))

    def known(kind: str, name: str) -> set[str] | None:
        if kind == "pipemlx":
            return flags_of(parsers[name])
        if kind == "script":
            return script_flags(name)
        return None  # another program's flags

    problems = []
    for path, text in documents():
        for context, earlier in contexts(text):
            for match in FLAG.finditer(context):
                flag = match.group()
                if flag in GLOBAL_FLAGS:
                    continue
                where = f"{path.relative_to(ROOT)}: {flag} in {context.strip()[max(0, match.start() - 60) :][:100]!r}"
                heads = heads_in(context[: match.start()])
                if heads:
                    _, kind, name = heads[-1]
                    if kind == "script" and script_flags(name) is None:
                        problems.append(f"{where}: {name} does not exist")
                    elif (flags := known(kind, name)) is not None and flag not in flags:
                        problems.append(f"{where}: not a flag of {'pipemlx ' * (kind == 'pipemlx')}{name}")
                    continue
                sets = [known(kind, name) for _, kind, name in heads_in(earlier)]
                if flag in every_command or any(flags is None or flag in flags for flags in sets):
                    continue
                problems.append(f"{where}: no pipemlx command, nor a command named before it, has it")
    return problems


def test_every_flag_exists_where_it_is_used() -> None:
    problems = flag_problems()
    assert not problems, "\n".join(problems)


def parameters(function: Callable[..., object]) -> set[str]:
    return set(inspect.signature(function).parameters)


FUNCTIONS: dict[str, set[str]] = {
    name: parameters(getattr(pipemlx, name))
    for name in ("shard_model", "load_sharded", "pipeline_prefill", "generate_step", "BatchGenerator", "send_mode")
}
FUNCTIONS["stream_generate"] = parameters(pipemlx.stream_generate) | FUNCTIONS["generate_step"]  # its **kwargs
FUNCTIONS["insert"] = parameters(pipemlx.BatchGenerator.insert)
FUNCTIONS["lean_generate_step"] = parameters(lean_generate_step)
"""The pipemlx functions whose keywords the docs may show, and their parameters."""

CALL = re.compile(r"(?<![\w])(?:(mlx_lm\.|mlx-lm's |speculative_)?)(" + "|".join(FUNCTIONS) + r")\(")


def arguments(text: str, start: int) -> str:
    """The text between the parenthesis at ``start`` and its match (or the end)."""
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + 1 : index]
    return text[start + 1 :]


def top_level_keywords(args: str) -> list[str]:
    flat, depth = [], 0
    for char in args:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        flat.append(char if depth == 0 else " ")
    return re.findall(r"(?<![\w.=!<>*])(\w+)\s*=(?!=)", "".join(flat))


def code_texts(text: str) -> Iterator[str]:
    for _, body in fences(text):
        yield body
    prose = re.sub(r"^```\w*\n.*?^```", "", text, flags=re.S | re.M)
    yield from re.findall(r"`([^`]+)`", prose)


def keyword_problems() -> list[str]:
    problems = []
    for path, text in documents():
        for code in code_texts(text):
            for match in CALL.finditer(code):
                if match.group(1):  # mlx-lm's function of the same name
                    continue
                name = match.group(2)
                if name == "insert" and code[match.start() - 1 : match.start()] != ".":
                    continue
                args = arguments(code, match.end() - 1)
                if name == "insert" and not re.search(r"\w+\s*=(?!=)", args):
                    continue  # list.insert and the like take no keywords
                known = FUNCTIONS[name]
                for keyword in top_level_keywords(args):
                    if keyword not in known:
                        problems.append(f"{path.relative_to(ROOT)}: {name}(..., {keyword}=...) has no such parameter")
    return problems


def test_every_keyword_exists_in_its_function() -> None:
    problems = keyword_problems()
    assert not problems, "\n".join(problems)


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [body for language, body in fences(text) if language == "python"]


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_runs(index: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    block = readme_python_blocks()[index]
    if block.lstrip().startswith(NOT_RUN):
        pytest.skip(block.lstrip().splitlines()[0])
    program = tmp_path / "block.py"
    program.write_text(block, encoding="utf-8")
    command = [sys.executable, str(program)]
    if "init_group" in block or "distributed.init" in block:
        command = [sys.executable, "-m", "pipemlx.launch", "-n", "2", "--", *command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # the calibration "auto" measures, kept between runs (pytest's cache folder): about 10 s instead of 25
    cache = getattr(request.config, "cache", None)  # pytest's cache folder (none under -p no:cacheprovider)
    env["PIPEMLX_CACHE_DIR"] = (
        str(cache.mkdir("docs-calibration")) if cache else env.get("PIPEMLX_CACHE_DIR", str(tmp_path))
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 0, f"README block {index} failed:\n{block}\n{result.stdout}\n{result.stderr}"


COMMAND = re.compile(r"`(?:python3? |pipemlx |bash )[^`]*`|^(?:\$ )?(?:python3? |pipemlx |bash )\S", re.M)
"""A command: an inline code span, or a line of a fenced block (``$ `` optional), running python, pipemlx or bash."""


def test_every_performance_table_has_its_command_before_it() -> None:
    lines = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8").splitlines()
    problems, previous_end = [], 0
    for number, line in enumerate(lines):
        starts_table = line.startswith("|") and (number == 0 or not lines[number - 1].startswith("|"))
        if not starts_table:
            continue
        before = "\n".join(lines[previous_end:number]) + "\n"
        if not COMMAND.search(before):
            problems.append(f"docs/performance.md:{number + 1}: no command between the previous table and this one")
        end = number
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        previous_end = end
    assert not problems, "\n".join(problems)


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped, spaces as hyphens)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_to_docs_resolve() -> None:
    """Every link to a page of the repository names a file that exists, and a heading of it if it names one."""
    problems = []
    for path, text in documents():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            page = (path.parent / target) if target else path
            if not page.exists():
                problems.append(f"{path.relative_to(ROOT)}: link to missing {target}")
            elif anchor and page.suffix == ".md" and anchor not in anchors(page.read_text(encoding="utf-8")):
                problems.append(f"{path.relative_to(ROOT)}: no heading #{anchor} in {target or path.name}")
    assert not problems, "\n".join(problems)


def documented_signatures() -> list[tuple[str, str, str]]:
    """Each signature docs/api.md writes out for a public function: (where, name, parameter text), from its
    headings and from the python blocks that open with a call of the function."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    found: list[tuple[str, str, str]] = []
    for heading in re.findall(r"^#+ `(\w+)\((.*)\)(?: -> [^`]*)?`", text, flags=re.M):
        found.append(("heading", *heading))
    for language, body in fences(text):
        match = re.match(r"(\w+)\(", body)
        if language == "python" and match:
            found.append(("block", match.group(1), arguments(body, match.end() - 1)))
    return [(where, name, args) for where, name, args in found if name in SIGNATURES]


SIGNATURES = {name: getattr(pipemlx, name) for name in ("shard_model", "load_sharded", "pipeline_prefill")}
SIGNATURES |= {name: getattr(pipemlx, name) for name in ("generate_step", "stream_generate", "BatchGenerator")}
SIGNATURES |= {"send_mode": pipemlx.send_mode, "stage_of": stage_of, "lean_generate_step": lean_generate_step}


@pytest.mark.parametrize("where,name,args", documented_signatures())
def test_documented_signatures_match_the_code(where: str, name: str, args: str) -> None:
    """Every parameter a signature in api.md shows exists, in the code's order, with the code's default and
    kind (positional or keyword-only); a signature without ``...`` shows every parameter."""
    import ast

    partial = "..." in args
    shown = ast.parse(f"def f({args.replace('...', '__rest__=None')}): pass").body[0]
    assert isinstance(shown, ast.FunctionDef)
    spec = shown.args
    defaults = [None] * (len(spec.args) - len(spec.defaults)) + list(spec.defaults)
    documented = [(a.arg, "positional", d) for a, d in zip(spec.args, defaults)]
    documented += [(a.arg, "keyword", d) for a, d in zip(spec.kwonlyargs, spec.kw_defaults)]
    documented += [(a.arg, "var", None) for a in (spec.vararg, spec.kwarg) if a is not None]
    documented = [entry for entry in documented if entry[0] != "__rest__"]
    actual = inspect.signature(SIGNATURES[name]).parameters
    if name == "BatchGenerator":
        actual = inspect.signature(pipemlx.BatchGenerator.__init__).parameters
        actual = {k: v for k, v in actual.items() if k != "self"}
    kinds = {
        inspect.Parameter.KEYWORD_ONLY: "keyword",
        inspect.Parameter.VAR_POSITIONAL: "var",
        inspect.Parameter.VAR_KEYWORD: "var",
    }
    order = list(actual)
    problems: list[str] = []
    for parameter, kind, default in documented:
        if parameter not in actual:
            problems.append(f"{parameter}: no such parameter")
            continue
        real = actual[parameter]
        if kinds.get(real.kind, "positional") != kind:
            problems.append(f"{parameter}: documented {kind}, is {real.kind.description}")
        if default is not None:
            try:
                value = ast.literal_eval(default)
            except ValueError:
                value = ast.unparse(default)  # a name: compare its spelling
                if real.default is inspect.Parameter.empty or value not in (repr(real.default), str(real.default)):
                    problems.append(f"{parameter}={value}: the code's default is {real.default!r}")
                continue
            if real.default is inspect.Parameter.empty or real.default != value:
                problems.append(f"{parameter}={value!r}: the code's default is {real.default!r}")
    names = [p for p, _, _ in documented if p in actual]
    if names != sorted(names, key=order.index):
        problems.append(f"the order differs from the code's: {order}")
    if not partial:
        missing = [p for p in order if p not in names]
        if missing:
            problems.append(f"missing (or write '...'): {missing}")
    assert not problems, f"docs/api.md {where} {name}(...): " + "; ".join(problems)


def test_design_names_every_module() -> None:
    """docs/design.md's map (or its prose, for the server's modules) names every module of pipemlx/."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    words = set(re.findall(r"[a-z_]+", text))
    skip = {"__init__", "__main__", "_version"}
    missing = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "pipemlx").rglob("*.py"))
        if path.stem not in skip and "demo" not in path.parts and path.stem not in words
    ]
    assert not missing, f"docs/design.md does not name: {missing}"


def test_the_readme_stays_short() -> None:
    """The README is read first: under 1,200 words (the rest is in docs/)."""
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words < 1200, f"README.md has {words} words"
