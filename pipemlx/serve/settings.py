"""``pipemlx serve``'s settings, split by who reads them.

- :class:`HttpLimits`: the HTTP side (rank 0, or the front process): what one client may make the server hold
  or do, and who may call it.
- :class:`EngineSettings`: every rank: how the requests run (schedulers, caches, speculation, waits).
- :class:`RequestDefaults`: what a request that says nothing gets.
- :class:`ProcessControl`: how the serving process stops and when it gives up.

:class:`ServeSettings` holds one of each; it is made once from the command line (:mod:`pipemlx.cli.serve`) and
passed on as a value: a process that starts serving ranks (the front's supervisor, or ``pipemlx serve
--no-recover``) gives each its :class:`RankOptions` as JSON (:func:`rank_process`), not a command line to parse
again.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..models.sharding import LendSpec
from ..models.vocab_head import HeadSpec
from .requests import SamplingParams, from_json, to_json

RANK_VARIABLE = "PIPEMLX_SERVE_RANK"
"""The JSON form of the :class:`RankOptions` of a process started as a serving rank (``python -m pipemlx.serve``)."""


@dataclass(frozen=True)
class HttpLimits:
    """What one client may make the server hold or do (docs/serve.md, "Limits and timeouts")."""

    api_key: str | None = None
    """The API key, or several separated by commas (each client's own: the prefix cache keeps them apart)."""
    max_queue: int = 64
    """Requests that may wait; more get 429."""
    max_body_bytes: int = 4 << 20
    max_tokens_limit: int = 8192
    max_streams: int = 64
    header_timeout: float = 10.0
    """Seconds a connection may take to send a request's headers: its first one after it opened, each next one
    after the previous answer ended (a kept-alive connection trickling bytes holds nothing for longer)."""
    body_timeout: float = 30.0
    """Seconds a request's body may take to arrive once its headers did; then 408."""
    max_connections: int = 1024
    """Open HTTP connections; one more is answered 503 and closed (the descriptors stay for those with work)."""
    idle_timeout: int = 5
    """Seconds a kept-alive connection may stay idle between requests."""
    metrics_public: bool = False
    report_cached_tokens: bool = True
    """``usage.prompt_tokens_details.cached_tokens`` as counted (False: always 0, ``--no-cached-tokens``)."""
    cors_origins: tuple[str, ...] = ()
    """Origins (``"*"``: any) whose pages may call the API from a browser; none by default."""


def api_keys(text: str | None) -> tuple[str, ...]:
    """The keys of :attr:`HttpLimits.api_key`: the text split at commas, blanks dropped (none: no key needed)."""
    return tuple(k.strip() for k in (text or "").split(",") if k.strip())


@dataclass(frozen=True)
class EngineSettings:
    """How every rank runs the requests (the same on every rank)."""

    max_concurrency: int = 1
    """Requests decoded together; 1: one at a time (:class:`.schedulers.OneAtATime`)."""
    prefill_chunking: Literal["fixed", "equal-cost"] = "equal-cost"
    decode_groups: int | Literal["auto"] = "auto"
    """``BatchGenerator(decode_groups=)`` with ``max_concurrency`` above 1 (``--decode-groups``): ``"auto"``, groups
    in flight from 8 live rows per group on, where measured faster in the run (the server owns the loop, so the order of the responses across requests
    is not seen; the library's default stays 1, mlx-lm's order)."""
    prefix_cache_mb: float = 1024.0
    prefill_step_size: int | Literal["auto"] = "auto"
    timeout: float = 120.0
    context: int | None = None
    draft_model: str | None = None
    """Speculative decoding (docs/speculative.md): a folder or repo id, loaded whole on every rank."""
    num_draft_tokens: int | Literal["auto"] = 3
    prompt_lookup: int | None = None

    @property
    def speculation(self) -> str | None:
        """How requests guess tokens, in words (``None``: they do not)."""
        if self.draft_model is not None:
            return f"draft model {self.draft_model}, {self.num_draft_tokens} tokens a pass"
        if self.prompt_lookup is not None:
            return f"prompt lookup of up to {self.prompt_lookup} tokens, {self.num_draft_tokens} tokens a pass"
        return None


@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for a field it does not send."""

    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """The server's ``--temp``, ``--top-p``, ``--top-k`` and ``--min-p``; a request's fields replace them."""
    chat_template: str = ""
    """A chat template of the server's own (``--chat-template``; empty: the model's)."""
    chat_template_args: str = "{}"
    """A JSON object of arguments for the chat template (``--chat-template-args``)."""
    use_default_chat_template: bool = False


@dataclass(frozen=True)
class ProcessControl:
    """How the serving process stops."""

    grace: float = 30.0
    """On SIGTERM: seconds the running requests get to finish."""
    fault_grace: float = 5.0
    """After a fault it cannot recover from: seconds of 503 answers before the process exits."""
    parent_pid: int | None = None
    """Local ranks: the supervising process; rank 0 stops the group when it is gone."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``pipemlx serve``'s options set, by who reads it."""

    model_id: str
    http: HttpLimits = field(default_factory=HttpLimits)
    engine: EngineSettings = field(default_factory=EngineSettings)
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    process: ProcessControl = field(default_factory=ProcessControl)


@dataclass(frozen=True)
class RankOptions:
    """What one rank needs to start serving."""

    model_dir: Path
    settings: ServeSettings
    host: str = "127.0.0.1"
    port: int = 8080
    split: list[int] | None = None
    expected_ranks: int | None = None
    allow_unregistered: bool = False
    lend: LendSpec = "auto"
    head: HeadSpec = "auto"  # load_sharded's head (--head)
    trust_remote_code: bool = False
    adapter_path: str | None = None
    """LoRA adapters (``--adapter-path``): each rank keeps its own layers'."""


def rank_process(options: RankOptions) -> tuple[list[str], dict[str, str]]:
    """The command and the environment variables that start a process serving as a rank with ``options``."""
    return [sys.executable, "-m", "pipemlx.serve"], {RANK_VARIABLE: json.dumps(to_json(options))}


def rank_options_from_environment() -> RankOptions:
    """The :class:`RankOptions` that :func:`rank_process` gave this process; ValueError naming what is wrong."""
    try:
        return from_json(RankOptions, json.loads(os.environ[RANK_VARIABLE]))
    except KeyError:
        raise ValueError(f"${RANK_VARIABLE} is not set: start serving ranks with pipemlx serve") from None
