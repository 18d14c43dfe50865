"""What the ``pipemlx`` commands share: bad-input errors, argument types, model and rank checks."""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

from ..demo import MODEL_DIR, default_prompt
from ..models.hub import check_cached, is_repo_id, locate_model, offline
from ..models.vocab_head import HEAD_CHOICES
from ..schedule.plan import default_step_size as default_step_size  # what the commands (and tests) use
from ..schedule.split import resolve_split

RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")


class UserError(Exception):
    """Bad input: reported as ``pipemlx <command>: error: <message>`` with exit status 2."""


def whole_number(text: str, least: int) -> int:
    """``text`` as an int of at least ``least``; else ``argparse.ArgumentTypeError`` naming the problem."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    return whole_number(text, 1)


def token_limit(text: str) -> int:
    """argparse type: at least 1 token, or -1 for no limit (mlx-lm's ``max_tokens=-1``)."""
    value = whole_number(text, -1)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1, or -1 for no limit, got 0")
    return value


def layer_counts(text: str) -> list[int]:
    """argparse type: layers per rank, comma-separated (``6,2``)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layers per rank like 6,2, got {text!r}") from None


def positive_float(text: str) -> float:
    """argparse type: a number greater than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def prefill_step(text: str) -> int | str:
    """argparse type: ``auto`` or an integer of 1 or more (``--prefill-step-size``)."""
    return "auto" if text == "auto" else whole_number(text, 1)


def lend_choice(text: str) -> int | str:
    """argparse type: ``auto``, ``none``, ``mlp`` or a count of key-value heads (``--lend``)."""
    if text in ("auto", "none", "mlp"):
        return text
    try:
        return whole_number(text, 0)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, none, mlp or a number of heads, got {text!r}") from None


DEFAULT_TIMEOUT = 120.0
"""``--timeout``'s default in every command: :func:`pipemlx.shard_model`'s."""
DEFAULT_MAX_TOKENS = 256
"""``--max-tokens``' default in every command: mlx-lm's (``mlx_lm.generate``, ``generate_step``)."""

SHARDING_FLAGS = {
    "--allow-unregistered": "shard an architecture pipemlx has not been verified on (load_sharded's "
    "allow_unregistered=True); compare with one process before relying on it",
    "--lend": "where the cuts between ranks fall (load_sharded's lend): auto cuts inside each rank's last layer "
    "where the model allows (its feed-forward half and the key-value heads the ranks' timings predict fastest "
    "run on the next rank; llama, mistral, qwen2, qwen3) and keeps whole layers elsewhere; none: whole layers; "
    "mlp: the feed-forward half only; K: the feed-forward half and K key-value heads",
}
RENAMED_FLAGS = {
    "--step-size": ("--prefill-step-size", "in pipemlx 0.2.0"),
    "--lend-mlp": ("--lend", "in pipemlx 0.2.0"),
    "--lend-heads": ("--lend", "in pipemlx 0.2.0"),
    "--max-concurrency": ("--decode-concurrency", "as mlx_lm.server names it"),
    "--prefix-cache": ("--prompt-cache-bytes", "as mlx_lm.server names it (in bytes, or 500M, 2G)"),
    "--cors-origin": ("--allowed-origins", "as mlx_lm.server names it (origins separated by commas)"),
}
"""Flags of earlier pipemlx versions and the flags that replace them: each old one is refused with an error naming
the new one."""


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default: `` (default: X)`` after the help unless it says its default already
    (options without a value, or whose default is ``None``, are left as they are)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        if isinstance(default, (list, tuple)) and not default:
            return text
        return f"{text} (default: %(default)s)"


class RenamedFlag(argparse.Action):
    """A flag of an earlier version: using it is an argparse error (exit status 2) naming the flag that replaces it."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, option: str | None = None
    ) -> None:
        new, when = RENAMED_FLAGS.get(option or "", ("?", ""))
        parser.error(f"{option} was renamed {new} {when}")


def add_renamed_flags(parser: argparse.ArgumentParser, flags: Sequence[str] = tuple(RENAMED_FLAGS)) -> None:
    """Refuse the old ``flags`` (:data:`RENAMED_FLAGS`) with an error naming the new one; hidden from ``--help``."""
    for flag in flags:
        parser.add_argument(flag, action=RenamedFlag, nargs="?", help=argparse.SUPPRESS)


def add_prefill_step_flag(parser: argparse.ArgumentParser) -> None:
    """``--prefill-step-size`` (mlx-lm's name): ``auto`` (the default) or tokens per prefill chunk."""
    parser.add_argument(
        "--prefill-step-size",
        type=prefill_step,
        default="auto",
        metavar="{auto,N}",
        help="prompt tokens per prefill chunk (mlx-lm's prefill_step_size); auto: the ranks plan from the layers' "
        "shapes, refine it from the chunks the prefills run (kept in the calibration cache) and choose the chunks "
        "predicted fastest for the prompt",
    )


def draft_tokens(text: str) -> int | Literal["auto"]:
    """``--num-draft-tokens``: a positive count or ``auto``."""
    return "auto" if text == "auto" else positive_int(text)


def add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (docs/speculative.md): mlx-lm's ``--draft-model`` and ``--num-draft-tokens``,
    and pipemlx's ``--prompt-lookup``."""
    group = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    group.add_argument(
        "--draft-model",
        help="a small model with the same tokenizer (folder or Hugging Face repo id), whole on every rank, that "
        "guesses the next tokens; one pass through the pipeline checks them (default: none)",
    )
    group.add_argument(
        "--num-draft-tokens",
        type=draft_tokens,
        default=3,
        metavar="{auto,K}",
        help="tokens guessed per pass (mlx-lm's); auto: as many as the measured rate of confirmed guesses pays for",
    )
    group.add_argument(
        "--prompt-lookup",
        type=positive_int,
        metavar="N",
        help="guess without a draft model: what followed the latest earlier match of the last N tokens (default: off)",
    )


def check_draft(draft: str | None) -> None:
    """A ``--draft-model`` folder that does not exist is a :class:`UserError` before any rank starts (a repo id is
    left to mlx-lm's loader on every rank)."""
    if draft is not None and not is_repo_id(Path(draft)) and not Path(draft).is_dir():
        raise UserError(f"cannot load the draft model {draft}: no such folder (a folder or a Hugging Face repo id)")


def check_speculation(args: argparse.Namespace) -> None:
    """:func:`check_draft`, and ``--draft-model`` with ``--prompt-lookup`` (one proposer or the other) refused as a
    :class:`UserError` before any rank starts, rather than as ``generate_step``'s ``ValueError`` on every rank."""
    if args.draft_model is not None and args.prompt_lookup is not None:
        raise UserError("--draft-model and --prompt-lookup both guess tokens: pass one of them, not both")
    check_draft(args.draft_model)


def add_sharding_flags(parser: argparse.ArgumentParser, flags: Sequence[str] = tuple(SHARDING_FLAGS)) -> None:
    """``--allow-unregistered`` and ``--lend`` (or those of them in ``flags``): ``load_sharded``'s
    ``allow_unregistered`` and ``lend``; and the refusal of the flags they replaced."""
    for flag in flags:
        if flag == "--lend":
            parser.add_argument(
                flag, type=lend_choice, default="auto", metavar="{auto,none,mlp,K}", help=SHARDING_FLAGS[flag]
            )
        else:
            parser.add_argument(flag, action="store_true", help=SHARDING_FLAGS[flag])
    if "--lend" in flags:
        add_renamed_flags(parser, ["--lend-mlp", "--lend-heads"])


def add_head_flag(parser: argparse.ArgumentParser) -> None:
    """``--head``: ``load_sharded``'s ``head`` (one flag for generate, serve and split)."""
    parser.add_argument(
        "--head",
        choices=HEAD_CHOICES,
        default="auto",
        help="load_sharded's head: each rank's share of the vocabulary's rows of the embedding and head (split), "
        "the output head on every rank (all) or on the last only (last); auto: split wherever the model allows, "
        "else all",
    )


def in_launched_rank() -> bool:
    """True when a launcher (pipemlx's, ``mlx.launch``, ``mpirun``) started this process as a rank."""
    return any(name in os.environ for name in RANK_VARIABLES)


def model_layers(model_dir: Path) -> int | None:
    """Check that ``model_dir`` is an mlx-lm model folder or Hub repo; return its decoder layer count if known.

    A Hub repo id (``org/name``, no such folder here) has its config, tokenizer files and index fetched
    (:func:`pipemlx.models.hub.locate_model`): a missing repo or weight file is a :class:`UserError`, and so,
    offline, is a weight file missing from the cache where this process starts the ranks (or is the only one).
    """
    if is_repo_id(model_dir):
        try:
            source = locate_model(model_dir)
            if offline() and not in_launched_rank():  # the local ranks share this cache: every file must be there
                check_cached(source)
        except OSError as exc:
            raise UserError(str(exc)) from None
        model_dir, remote = source.root, True
    else:
        remote = False
    if not model_dir.exists():
        raise UserError(f"model folder {str(model_dir)!r} does not exist")
    if not model_dir.is_dir():
        raise UserError(f"{str(model_dir)!r} is not a folder; --model takes an mlx-lm model folder or a Hub repo id")
    config_path = model_dir / "config.json"
    try:
        config: Any = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{str(model_dir)!r} has no config.json; it is not an mlx-lm model folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {config_path}: {exc}") from None
    if not remote and not any(model_dir.glob("model*.safetensors")):  # a repo's weights are checked, not fetched
        raise UserError(f"{str(model_dir)!r} has no model*.safetensors weights")
    if not isinstance(config, dict):
        raise UserError(f"{config_path} does not hold a JSON object")
    layers = config.get("num_hidden_layers")  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
    text_config = config.get("text_config")  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
    if layers is None and isinstance(text_config, dict):
        layers = text_config.get("num_hidden_layers")  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
    return layers if isinstance(layers, int) else None


def model_name(model_dir: Path) -> str:
    """``the demo model`` for the shipped one, else the folder or repo id as given."""
    return "the demo model" if Path(model_dir).resolve() == MODEL_DIR.resolve() else str(model_dir)


def check_ranks(ranks: int, model_dir: Path, split: list[int] | None = None) -> None:
    """Every rank needs at least one layer of the model; an explicit ``split`` must fit model and ranks."""
    layers = model_layers(model_dir)
    if layers is not None and ranks > layers:
        raise UserError(
            f"more ranks than layers: {ranks} ranks cannot share the {layers} layers of {model_name(model_dir)} "
            "(every rank needs at least one)"
        )
    if split is not None:
        if layers is None:
            raise UserError(f"--split needs the model's layer count, which {model_dir}/config.json does not give")
        try:
            resolve_split(split, layers, ranks)
        except ValueError as exc:
            raise UserError(f"--split: {exc}") from None


def check_ranks_here(ranks: int, model_dir: Path, split: list[int] | None = None) -> None:
    """:func:`check_ranks` on a host of a ``--hostfile`` group where the model folder is here. A host without it
    (a folder elsewhere, or a Hub repo id) checks nothing before joining: its rank fetches the model from a rank
    that has it (:mod:`pipemlx.models.peer`) or from the Hub, and where no rank and no Hub has it every rank's
    ``load_sharded`` fails with the same line."""
    if Path(model_dir).is_dir():
        check_ranks(ranks, model_dir, split)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from ``--prompt``, ``--prompt-file`` or the demo prompt."""
    if args.prompt is not None:
        from .parity import read_prompt_text

        text: str = read_prompt_text(args.prompt)
    elif args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read prompt file {args.prompt_file!r}: {exc}") from None
    else:
        text = default_prompt()
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


RING_STARTING_PORT = 32323
"""The first port of a hostfile that names hosts by IP (``mlx.launch``'s ``--starting-port`` default): one port per
rank and IP, counting up, as ``mlx.launch`` assigns them."""


def read_hostfile(path: str) -> list[list[str]]:
    """Each rank's ``"ip:port"`` addresses from the hostfile at ``path``, in either of MLX's forms: the ring
    backend's list of lists, or what ``mlx.distributed_config`` writes (``{"backend", "envs", "hosts": [{"ssh",
    "ips", "rdma"}]}``, ports given as ``mlx.launch`` gives them); :class:`UserError` when it is neither."""
    return _ring_of(path, _hostfile_json(path))


def join_by_hostfile(path: str, rank: int | None) -> int:
    """Make this process rank ``rank`` (``None``: found by its address) of the ring the hostfile at ``path``
    describes, through MLX's environment variables (and the hostfile's ``envs``, as ``mlx.launch`` sets them);
    returns the rank. A hostfile in ``mlx.distributed_config``'s form is handed to MLX as a ring
    hostfile written to a private temporary file."""
    entries = _hostfile_json(path)
    hosts = _ring_of(path, entries)
    rank = hostfile_rank(path, rank, hosts)
    ring_file = path
    if not _is_hostfile(entries):  # mlx.distributed_config's form
        descriptor, ring_file = tempfile.mkstemp(prefix="pipemlx-ring-", suffix=".json")  # mode 0600
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            json.dump(hosts, out)
        if isinstance(entries, dict):
            os.environ.update(_config_envs(path, cast("dict[str, Any]", entries)))
    os.environ.update({"MLX_HOSTFILE": ring_file, "MLX_RANK": str(rank), "PIPEMLX_BACKEND": "ring"})
    return rank


def hostfile_rank(path: str, rank: int | None, hosts: list[list[str]]) -> int:
    """This host's rank among the ``hosts`` of the hostfile at ``path`` (``rank`` if given, when it is one)."""
    if rank is not None:
        if not 0 <= rank < len(hosts):
            raise UserError(f"--rank {rank} is not a rank of {path!r}, which has {len(hosts)} ranks")
        return rank
    local = [r for r, addresses in enumerate(hosts) if any(_is_local(a.rsplit(":", 1)[0]) for a in addresses)]
    if len(local) == 1:
        return local[0]
    if not local:
        raise UserError(f"no address in {path!r} belongs to this host; pass --rank R to choose this process's rank")
    raise UserError(f"ranks {local} of {path!r} all have addresses of this host; pass --rank R to choose one")


def _ring_of(path: str, entries: Any) -> list[list[str]]:
    """The ring addresses of a hostfile's JSON, in either form (see :func:`read_hostfile`)."""
    if isinstance(entries, dict) or (isinstance(entries, list) and entries and isinstance(entries[0], dict)):
        return _ring_of_config(path, cast(Any, entries))
    if not _is_hostfile(entries):
        raise UserError(
            f'hostfile {path!r} must be a JSON list with one list of "ip:port" strings per rank, '
            'like [["10.0.0.1:5000"], ["10.0.0.2:5000"]], or what mlx.distributed_config writes'
        )
    return cast("list[list[str]]", entries)


def _hostfile_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read hostfile {path!r}: {exc}") from None


def _ring_of_config(path: str, config: dict[str, Any] | list[Any]) -> list[list[str]]:
    """The ring addresses of ``mlx.distributed_config``'s hostfile form, the ports counted as ``mlx.launch``
    counts them."""
    if isinstance(config, dict):
        backend = config.get("backend") or "ring"
        if backend != "ring":
            raise UserError(
                f"hostfile {path!r} is for MLX's {backend!r} backend: start the ranks with "
                f"mlx.launch --hostfile {path} --backend {backend} -- pipemlx ... (--hostfile runs the ring backend)"
            )
        hosts: Any = config.get("hosts")
    else:
        hosts = config
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, dict) for h in cast("list[Any]", hosts)):
        raise UserError(f'hostfile {path!r}: \'hosts\' must be a non-empty list of {{"ssh", "ips"}} objects')
    ring: list[list[str]] = []
    port = RING_STARTING_PORT
    for number, host in enumerate(cast("list[dict[str, Any]]", hosts)):
        ips: Any = host.get("ips")
        if not isinstance(ips, list) or not ips or not all(isinstance(ip, str) for ip in cast("list[Any]", ips)):
            raise UserError(
                f"hostfile {path!r}: host {number} ({host.get('ssh')!r}) has no 'ips'; the ring backend needs each "
                "host's IP addresses (mlx.distributed_config --backend ring writes them)"
            )
        ring.append([f"{ip}:{port + i}" for i, ip in enumerate(cast("list[str]", ips))])
        port += len(ring[-1])
    return ring


def _config_envs(path: str, config: dict[str, Any]) -> dict[str, str]:
    """The hostfile's ``envs`` (``["NAME=value", ...]``), set in every rank as ``mlx.launch`` sets them."""
    envs: Any = config.get("envs") or []
    if not isinstance(envs, list):
        envs = [None]
    pairs = [e.partition("=") for e in cast("list[Any]", envs) if isinstance(e, str)]
    if len(pairs) != len(cast("list[Any]", envs)) or any(not name or not eq for name, eq, _ in pairs):
        raise UserError(f"hostfile {path!r}: 'envs' must be a list of \"NAME=value\" strings")
    return {name: value for name, _, value in pairs}


def _is_hostfile(entries: Any) -> bool:
    """A non-empty list of non-empty lists of ``"host:port"`` strings."""
    if not isinstance(entries, list) or not entries:
        return False
    for entry in cast("list[Any]", entries):
        if not isinstance(entry, list) or not entry:
            return False
        if not all(isinstance(a, str) and ":" in a for a in cast("list[Any]", entry)):
            return False
    return True


def _is_local(host: str) -> bool:
    """Whether this machine has the address ``host`` (can bind to it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host.strip("[]"), 0))
        return True
    except OSError:
        return False
