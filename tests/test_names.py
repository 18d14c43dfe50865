"""One name per concept, one default per name: the public signatures (``inspect.signature``) and the commands' flags
hold the agreed names and defaults (docs/api.md, "Defaults"), and every name of pipemlx 0.1 is refused naming its
replacement."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

import pipemlx
from pipemlx.cli import build_parser
from pipemlx.cli.common import DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT
from pipemlx.models.sharding import DEFAULT_TIMEOUT as SHARD_TIMEOUT

AGREED: dict[str, dict[str, Any]] = {
    # name: default, in every public function that takes it
    "prefill_step_size": {"default": "auto"},
    "prompt_progress_callback": {"default": None},
    "max_tokens": {"default": 256},
    "lend": {"default": "auto"},
    "context": {"default": None},
    "timeout": {"default": None},  # None: the model's (shard_model's 120 s)
    "kv_group_size": {"default": 64},
    "quantized_kv_start": {"default": 5000},
    "prefill_chunking": {"default": "equal-cost"},
}
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "shard_model": pipemlx.shard_model,
    "load_sharded": pipemlx.load_sharded,
    "pipeline_prefill": pipemlx.pipeline_prefill,
    "generate_step": pipemlx.generate_step,
    "stream_generate": pipemlx.stream_generate,
    "BatchGenerator": pipemlx.BatchGenerator.__init__,
}
WANTED: dict[str, set[str]] = {
    "shard_model": {"prefill_step_size", "lend", "context", "timeout"},
    "load_sharded": {"prefill_step_size", "lend", "context", "timeout"},
    "pipeline_prefill": {"prefill_step_size", "prompt_progress_callback", "timeout", "kv_group_size"},
    "generate_step": {"prefill_step_size", "prompt_progress_callback", "max_tokens", "timeout", "quantized_kv_start"},
    "stream_generate": {"max_tokens"},
    "BatchGenerator": {"prefill_step_size", "max_tokens", "timeout", "prefill_chunking"},
}
RETIRED = {  # pipemlx 0.1's names: each is refused naming its replacement
    "step_size": "prefill_step_size",
    "progress_callback": "prompt_progress_callback",
    "lend_mlp": "lend",
    "lend_heads": "lend",
    "prefill_budget": "prefill_chunk_tokens",
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_public_signatures_use_the_agreed_names_and_defaults(name: str) -> None:
    parameters = inspect.signature(FUNCTIONS[name]).parameters
    assert WANTED[name] <= set(parameters), f"{name} lacks {WANTED[name] - set(parameters)}"
    for parameter in parameters.values():
        assert parameter.name not in RETIRED, f"{name} still takes {parameter.name}"
        agreed = AGREED.get(parameter.name)
        if agreed is not None and not (name in ("shard_model", "load_sharded") and parameter.name == "timeout"):
            assert parameter.default == agreed["default"], f"{name}({parameter.name}=...) defaults differently"
    if "timeout" in parameters and name in ("shard_model", "load_sharded"):
        assert parameters["timeout"].default == SHARD_TIMEOUT == DEFAULT_TIMEOUT == 120.0


def call_with(name: str, keyword: str) -> None:
    """Call ``name`` with only a retired keyword: the check runs before any other argument is looked at."""
    function = FUNCTIONS[name]
    if name == "BatchGenerator":
        pipemlx.BatchGenerator(None, **{keyword: 1})  # type: ignore[arg-type]
    else:
        function(None, None, None, **{keyword: 1})


@pytest.mark.parametrize(
    "name,old",
    [
        ("pipeline_prefill", "step_size"),
        ("pipeline_prefill", "progress_callback"),
        ("generate_step", "step_size"),
        ("generate_step", "progress_callback"),
        ("shard_model", "step_size"),
        ("shard_model", "lend_mlp"),
        ("shard_model", "lend_heads"),
        ("load_sharded", "lend_mlp"),
        ("load_sharded", "lend_heads"),
        ("load_sharded", "step_size"),
        ("BatchGenerator", "prefill_budget"),
    ],
)
def test_retired_names_raise_a_type_error_naming_the_new_one(name: str, old: str) -> None:
    with pytest.raises(TypeError, match=f"got the keyword argument '{old}', renamed '{RETIRED[old]}' in pipemlx 0.2.0"):
        call_with(name, old)


def options(command: str) -> dict[str, Any]:
    """``--flag: default`` of one command of the ``pipemlx`` parser."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # pyright: ignore[reportPrivateUsage]
    chosen = sub.choices[command]  # type: ignore[index]
    return {
        flag: action.default
        for action in chosen._actions  # pyright: ignore[reportPrivateUsage]
        for flag in action.option_strings
        if action.help != "==SUPPRESS=="
    }


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_commands_use_the_same_flags_and_defaults(command: str) -> None:
    flags = options(command)
    assert flags["--prefill-step-size"] == "auto" and flags["--lend"] == "auto"
    # mlx-lm's defaults, command line to command line: mlx_lm.generate's 100, mlx_lm.server's 512 (test_parity)
    expected_tokens = {"generate": 100, "serve": 512, "bench": DEFAULT_MAX_TOKENS}[command]
    assert flags["--max-tokens"] == expected_tokens and flags["--timeout"] == DEFAULT_TIMEOUT
    assert not {"--step-size", "--lend-mlp", "--lend-heads"} & set(flags)
    if command != "bench":
        assert flags["--temp"] == 0.0  # mlx-lm's
    doctor = options("doctor")
    assert doctor["--timeout"] == DEFAULT_TIMEOUT


def test_the_version_is_0_2_0() -> None:
    assert pipemlx.__version__ == "0.2.0"


@pytest.mark.parametrize("command", ["generate", "bench", "serve", "split"])
def test_retired_flags_are_refused_naming_the_new_one(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from pipemlx import cli

    retired = {"--step-size": "--prefill-step-size"}
    if command != "split":
        retired |= {"--lend-mlp": "--lend", "--lend-heads": "--lend"}
    for old, new in retired.items():
        argv = [command, old, "4", *(["some_model"] if command == "split" else [])]
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
        assert code == 2 and f"{old} was renamed {new} in pipemlx 0.2.0" in capsys.readouterr().err, (command, old)
