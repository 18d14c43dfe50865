"""mlx-lm's command lines, flag for flag: what ``pipemlx generate`` and ``pipemlx serve`` take from
``mlx_lm.generate`` and ``mlx_lm.server``, with their names, meanings and defaults, and the flags pipemlx
refuses, each with the reason (one line, exit 2: never argparse's "unrecognized arguments", never ignored).

The prompt is built as ``mlx_lm.generate`` builds it (:func:`prompt_tokens`): the tokenizer's chat template by
default, ``--system-prompt``, ``--prefill-response``, ``--chat-template-config``, ``--ignore-chat-template``;
mlx-lm builds it inside its ``main``, so the same steps are written here.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import UserError, positive_int

GENERATE_MAX_TOKENS = 100
"""``mlx_lm.generate``'s ``--max-tokens``."""
SERVE_MAX_TOKENS = 512
"""``mlx_lm.server``'s ``--max-tokens``."""

REFUSED_GENERATE = {
    "--image": "pipemlx shards text models only: images are not taken",
    "--prompt-cache-file": "a saved prompt cache holds every layer; pipemlx's ranks hold their own layers' caches",
    "--quantize-activations": "activation quantization is not applied across the ranks",
    "--max-kv-size": "rotating caches of a bounded size are not yet prefilled across the ranks",
}
REFUSED_SERVE = {
    "--kv-bits": "quantized KV caches are not kept in pipemlx serve's prefix cache",
    "--kv-group-size": "quantized KV caches are not kept in pipemlx serve's prefix cache",
    "--quantized-kv-start": "quantized KV caches are not kept in pipemlx serve's prefix cache",
    "--prompt-cache-size": "pipemlx serve bounds its prefix cache in bytes (--prompt-cache-bytes, --prefix-cache MB)",
}


SHORT = {"--quantize-activations": ("-qa",)}
"""mlx-lm's short forms of refused flags."""


def str2bool(text: str) -> bool:
    """mlx-lm's reading of ``--verbose``'s value: anything but ``false``/``f`` is true."""
    return text.lower() not in ("false", "f")


def add_refused(parser: argparse.ArgumentParser, refused: dict[str, str]) -> None:
    """Flags taken only to be refused with their reason (:func:`check_refused`)."""
    group = parser.add_argument_group("mlx-lm flags pipemlx refuses (each says why)")
    for flag, why in refused.items():
        group.add_argument(flag, *SHORT.get(flag, ()), nargs="*", default=None, help=f"refused: {why}")


def check_refused(args: argparse.Namespace, refused: dict[str, str]) -> None:
    """:class:`UserError` for the first refused flag given, with its reason."""
    for flag, why in refused.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")) is not None:
            raise UserError(f"{flag}: {why}")


def add_adapter_flag(parser: argparse.ArgumentParser) -> None:
    """``--adapter-path``, as mlx-lm's commands take it."""
    parser.add_argument(
        "--adapter-path",
        help="a folder of LoRA adapters (adapters.safetensors, adapter_config.json) as mlx-lm's trainer saves them; "
        "each rank keeps its own layers' (whole layers: no lending)",
    )


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    """``mlx_lm.generate``'s flags that ``pipemlx generate`` honours, beyond those it shares with ``serve``."""
    prompt = parser.add_argument_group("the prompt, as mlx_lm.generate builds it")
    prompt.add_argument(
        "--system-prompt", help="a system message before the prompt (with the chat template)"
    )  # fmt: skip
    prompt.add_argument(
        "--prefill-response", help="the start of the answer, continued by the model (with the chat template)"
    )
    prompt.add_argument(
        "--ignore-chat-template", action="store_true", help="encode the prompt as it is, without the chat template"
    )
    prompt.add_argument(
        "--use-default-chat-template",
        action="store_true",
        help="use the tokenizer's default chat template when the model has none",
    )
    prompt.add_argument("--chat-template-config", help="JSON of extra arguments for the chat template")
    prompt.add_argument("--extra-eos-token", nargs="+", default=(), help="more tokens that end the answer")
    prompt.add_argument("--trust-remote-code", action="store_true", help="let the tokenizer run the model's code")
    sampling = parser.add_argument_group("sampling, as mlx-lm's make_sampler")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    sampling.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (0: off)")
    sampling.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    sampling.add_argument("--min-tokens-to-keep", type=positive_int, default=1, help="tokens min-p keeps at least")
    sampling.add_argument("--xtc-probability", type=float, default=0.0, help="XTC sampling's probability (0: off)")
    sampling.add_argument("--xtc-threshold", type=float, default=0.1, help="XTC sampling's threshold")
    caches = parser.add_argument_group("KV cache quantization, as mlx-lm")
    caches.add_argument("--kv-bits", type=int, help="quantize the KV cache to this many bits (default: not)")
    caches.add_argument("--kv-group-size", type=int, default=64, help="the KV quantization's group size")
    caches.add_argument(
        "--quantized-kv-start", type=int, default=5000, help="the position from which the KV cache is quantized"
    )
    parser.add_argument(
        "--verbose",
        type=str2bool,
        default=True,
        help="progress, text as it comes and the summary (false: only the text, at the end)",
    )
    add_refused(parser, REFUSED_GENERATE)


def read_prompt_text(text: str) -> str:
    """``--prompt``'s text as ``mlx_lm.generate`` reads it: ``-`` is standard input, ``\\n`` and ``\\t`` escapes."""
    text = text.replace("\\n", "\n").replace("\\t", "\t")
    return sys.stdin.read() if text == "-" else text


def prompt_tokens(tokenizer: Any, text: str, args: argparse.Namespace) -> list[int]:
    """The prompt's token ids as ``mlx_lm.generate`` builds them from ``text`` and the flags."""
    if args.use_default_chat_template and getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = tokenizer.default_chat_template
    use_template = not args.ignore_chat_template and bool(getattr(tokenizer, "has_chat_template", False))
    if use_template:
        messages = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
        messages.append({"role": "user", "content": text})
        prefill = args.prefill_response is not None
        if prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            continue_final_message=prefill,
            add_generation_prompt=not prefill,
            **template_config(args.chat_template_config),
        )
    return list(tokenizer.encode(text, add_special_tokens=not use_template))


def template_config(text: str | None) -> dict[str, Any]:
    """``--chat-template-config``'s JSON object; :class:`UserError` when it is not one."""
    if text is None:
        return {}
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--chat-template-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UserError("--chat-template-config must be a JSON object, like '{\"enable_thinking\": false}'")
    return dict(value)  # pyright: ignore[reportUnknownArgumentType]
