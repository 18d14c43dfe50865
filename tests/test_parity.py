"""pipemlx's command lines against mlx-lm's, read at test time: every flag of ``mlx_lm.generate`` and
``mlx_lm.server`` is a flag of ``pipemlx generate`` / ``pipemlx serve`` (with mlx-lm's default where pipemlx
honours it) or is refused by pipemlx with its own reason; the prompt ``pipemlx generate`` builds gives the text
``mlx_lm.generate`` prints; and ``pipemlx serve`` honours ``top_k`` and names what it refuses."""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipemlx import cli
from pipemlx.cli.parity import REFUSED_GENERATE, REFUSED_SERVE
from pipemlx.demo import MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent

OWN_DEFAULTS = {
    "--model": "the demo model, shipped with pipemlx (mlx-lm's default is a Hub repo)",
    "--prompt": "the opening of Pride and Prejudice, for the demo model",
    "--prefill-step-size": "auto: the step pipemlx measures fastest (performance.md)",
}
"""Flags whose pipemlx default differs from mlx_lm.generate's, and why."""


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # pyright: ignore[reportPrivateUsage]
    return sub.choices[name]  # type: ignore[index,no-any-return]


def flags_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}  # pyright: ignore[reportPrivateUsage]


def mlx_lm_generate_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = importlib.import_module("mlx_lm.generate").setup_arg_parser()
    return parser


def mlx_lm_server_flags() -> list[str]:
    """mlx_lm.server builds its parser inside main(): its flags, read from the source."""
    source = inspect.getsource(importlib.import_module("mlx_lm.server"))
    flags = re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', source)
    assert len(flags) >= 20, flags  # the reading still works
    return flags


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def test_every_mlx_lm_generate_flag_is_a_pipemlx_generate_flag_with_its_default() -> None:
    ours = flags_of(subcommand("generate"))
    theirs = flags_of(mlx_lm_generate_parser())
    ours_defaults = vars(subcommand("generate").parse_args([]))
    theirs_defaults = vars(mlx_lm_generate_parser().parse_args([]))
    for flag, action in theirs.items():
        if flag in ("-h", "--help"):
            continue
        assert flag in ours, f"pipemlx generate neither takes nor refuses mlx_lm.generate's {flag}"
        if flag in REFUSED_GENERATE or any(f in OWN_DEFAULTS for f in action.option_strings):
            continue
        mine = ours[flag].dest
        assert ours_defaults[mine] == theirs_defaults[action.dest] or (
            not ours_defaults[mine] and not theirs_defaults[action.dest]  # () and None: nothing given
        ), (flag, ours_defaults[mine], theirs_defaults[action.dest])


def test_every_mlx_lm_server_flag_is_a_pipemlx_serve_flag() -> None:
    ours = flags_of(subcommand("serve"))
    for flag in mlx_lm_server_flags():
        assert flag in ours, f"pipemlx serve neither takes nor refuses mlx_lm.server's {flag}"
    defaults = vars(subcommand("serve").parse_args([]))
    assert defaults["max_tokens"] == 512 and defaults["num_draft_tokens"] == 3 and defaults["log_level"] == "INFO"
    assert (defaults["temp"], defaults["top_p"], defaults["top_k"], defaults["min_p"]) == (0.0, 1.0, 0, 0.0)


@pytest.mark.parametrize(
    "command,flag,why",
    [("generate", f, w) for f, w in REFUSED_GENERATE.items()] + [("serve", f, w) for f, w in REFUSED_SERVE.items()],
)
def test_a_flag_pipemlx_cannot_honour_is_refused_with_its_reason(
    capsys: pytest.CaptureFixture[str], command: str, flag: str, why: str
) -> None:
    code, err = run_cli(capsys, command, flag, "4")
    assert code == 2 and f"pipemlx {command}: error: {flag}: {why}" in err, err
    assert "unrecognized" not in err and "Traceback" not in err


def test_renamed_serve_flags_name_mlx_lm_s(capsys: pytest.CaptureFixture[str]) -> None:
    for old, new in (("--max-concurrency", "--decode-concurrency"), ("--prefix-cache", "--prompt-cache-bytes")):
        code, err = run_cli(capsys, "serve", old, "4")
        assert code == 2 and f"{old} was renamed {new} as mlx_lm.server names it" in err, err


def texts(argv: list[str]) -> tuple[str, str]:
    """What ``mlx_lm.generate`` and ``pipemlx generate --ranks 2`` print for ``argv`` (greedy, text only)."""
    common = ["--model", str(MODEL_DIR), "--max-tokens", "24", "--verbose", "false", *argv]
    theirs = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", *common], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    ours = subprocess.run(
        [sys.executable, "-m", "pipemlx", "generate", "--ranks", "2", *common],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    assert ours.returncode == 0, ours.stderr[-2000:]
    return theirs.stdout, ours.stdout


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt", "Do you like to dance, Mr. Darcy?"],
        ["--prompt", "Do you like to dance?", "--system-prompt", "You are Mr. Darcy."],
        ["--prompt", "It is a truth universally acknowledged", "--ignore-chat-template"],
    ],
    ids=["chat-template", "system-prompt", "ignore-chat-template"],
)
def test_generate_prints_what_mlx_lm_generate_prints(argv: list[str]) -> None:
    """The demo model ships a chat template: by default both apply it, so the texts agree only if pipemlx builds the
    prompt as mlx-lm does."""
    theirs, ours = texts(argv)
    assert theirs.strip(), "mlx_lm.generate printed nothing: the comparison loses its power"
    assert ours == theirs


def test_generate_prompt_tokens_follow_the_chat_template() -> None:
    """The prompt's tokens, flag by flag, against the template rendered by hand (a check that can fail without
    running a model)."""
    from mlx_lm.utils import load_tokenizer  # pyright: ignore[reportUnknownVariableType]

    from pipemlx.cli.parity import prompt_tokens

    tokenizer: Any = load_tokenizer(MODEL_DIR)
    args = subcommand("generate").parse_args(["--system-prompt", "S", "--prefill-response", "I"])
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "I"}],
        tokenize=False,
        continue_final_message=True,
    )
    assert prompt_tokens(tokenizer, "Q", args) == list(tokenizer.encode(expected, add_special_tokens=False))
    raw = subcommand("generate").parse_args(["--ignore-chat-template"])
    assert prompt_tokens(tokenizer, "Q", raw) == list(tokenizer.encode("Q", add_special_tokens=True))


KEYWORD_DIFFERENCES = {
    ("generate_step", "stream"): "None: each rank computes on its stage's stream (mlx-lm's stream is accepted)",
    ("generate_step", "prefill_step_size"): '"auto": the chunk the cost model predicts fastest (mlx-lm: 2048)',
    ("BatchGenerator", "prefill_step_size"): '"auto", as generate_step',
    (
        "BatchGenerator",
        "max_tokens",
    ): "256, pipemlx's one max_tokens default (generate_step's; mlx-lm's batch says 128)",
    ("BatchGenerator", "stop_tokens"): "() and mlx-lm's None both mean none",
    ("BatchGenerator", "completion_batch_size"): "None: as many rows as the memory budget admits",
    ("BatchGenerator", "prefill_batch_size"): "None: as many prompts as the ticks' plan takes",
}
"""Where a pipemlx function's keyword default differs from mlx-lm's on purpose, and why."""


@pytest.mark.parametrize("name", ["generate_step", "stream_generate", "BatchGenerator", "BatchGenerator.insert"])
def test_public_functions_take_every_mlx_lm_keyword_with_its_default(name: str) -> None:
    """Read at test time: each keyword of mlx-lm's function is one of pipemlx's (``stream_generate`` passes its
    ``**kwargs`` to ``generate_step``), with mlx-lm's default unless KEYWORD_DIFFERENCES says why not."""
    import pipemlx

    generate = importlib.import_module("mlx_lm.generate")
    owner, _, method = name.partition(".")
    theirs_fn, ours_fn = getattr(generate, owner), getattr(pipemlx, owner)
    if method or owner == "BatchGenerator":
        theirs_fn, ours_fn = getattr(theirs_fn, method or "__init__"), getattr(ours_fn, method or "__init__")
    theirs = inspect.signature(theirs_fn).parameters
    ours = dict(inspect.signature(ours_fn).parameters)
    if name == "stream_generate":
        ours |= {k: v for k, v in inspect.signature(pipemlx.generate_step).parameters.items() if k not in ours}
    problems: list[str] = []
    for keyword, parameter in theirs.items():
        if keyword == "self" or parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        if keyword not in ours:
            problems.append(f"{keyword}: mlx-lm's, not pipemlx's")
        elif repr(ours[keyword].default) != repr(parameter.default) and not {
            (owner, keyword),
            ("generate_step", keyword),
        } & set(KEYWORD_DIFFERENCES):
            problems.append(f"{keyword}: default {ours[keyword].default!r}, mlx-lm's {parameter.default!r}")
    assert not problems, f"{name}: " + "; ".join(problems)
