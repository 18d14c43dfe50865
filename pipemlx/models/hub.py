"""Models by name: a Hugging Face repo id in place of a model folder, each rank fetching only its tensors.

``load_sharded`` and the ``pipemlx`` commands take ``--model org/name`` as
mlx-lm does: a path that exists is a local folder, anything else that looks
like a repo id is fetched from the Hub (``HF_ENDPOINT``, ``HF_HOME``,
``HF_HUB_OFFLINE`` and the login token work as for every huggingface_hub
client). What a rank fetches when no rank of its group has the model (else
:mod:`pipemlx.models.peer`):

1. :func:`locate_model`: ``config.json``, the tokenizer files and
   ``model.safetensors.index.json`` (the patterns mlx-lm's ``sharded_load`` uses
   for everything but the weights), and the repo's file list, to check that
   every weight file the index names exists. Every rank does this before it
   fetches anything, so every rank stops with the same
   :class:`ModelNotFoundError` for a missing repo, revision or file.
2. :class:`HubSource` (:func:`resolve_source`): the safetensors headers, by two
   HTTP range requests per file (kept in pipemlx's cache), and then the byte
   ranges of the tensors the rank keeps
   (:func:`pipemlx.models.weights.rank_tensors`), written into its weight folder
   (:func:`pipemlx.models.weights.fetch_rank_folder`). A snapshot in the Hub
   cache that holds every weight file is read in place.

:func:`rank_files` tells the weight files holding a rank's tensors from the
index alone. ``pipemlx split`` sizes a repo from its index and the safetensors
headers read with HTTP range requests (:func:`model_bytes_of`,
:func:`memory_model_of`), without downloading the weights.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from ..schedule.memory_model import HeadPolicy, MemoryModel
from ..schedule.memory_split import ModelBytes
from .memory import memory_model_from_dir, memory_model_from_headers
from .safetensors import (
    decoder_prefix,
    model_bytes_from_dir,
    model_bytes_from_headers,
    read_dir_config,
    read_safetensors_header,
)
from .weights import (
    CHUNK_BYTES,
    FetchCount,
    FolderSource,
    TensorInfo,
    TransferError,
    is_tied,
    parse_header,
    rank_layers,
    tensor_wanted,
    weights_root,
)

METADATA_PATTERNS = ("*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
"""What every rank fetches besides weights: config, tokenizer files, the index (as mlx-lm's ``sharded_load``)."""
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_PATTERN = "model*.safetensors"
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

T = TypeVar("T")


class ModelNotFoundError(FileNotFoundError):
    """A model that is neither a local folder nor a repo, revision or file the Hub (or the offline cache) has.

    Its message is one line naming what is missing; the commands print it and exit with status 2.
    """


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a local folder (``repo`` None), or a Hub repo at one commit.

    For a repo, ``root`` is the commit's snapshot folder in the Hub cache, holding the config, the tokenizer
    files and the index, and the weight files fetched so far; ``weight_map`` is the index's (tensor name ->
    file; empty for a repo without an index, usually one ``model.safetensors``) and ``weight_files`` every
    weight file.
    """

    root: Path
    repo: str | None = None
    commit: str | None = None
    weight_map: dict[str, str] = field(default_factory=dict[str, str])
    weight_files: tuple[str, ...] = ()
    user_agent: str = "pipemlx"

    @property
    def name(self) -> str:
        """The model as the user named it: the repo id, or the folder."""
        return self.repo if self.repo is not None else str(self.root)


def is_repo_id(name: str | os.PathLike[str]) -> bool:
    """Whether ``name`` names a Hub repo rather than a local folder: no such path exists and it reads ``org/name``."""
    text = os.fspath(name)
    return not Path(text).exists() and REPO_ID.fullmatch(text) is not None and ".." not in text


def offline() -> bool:
    """Whether huggingface_hub may not reach the Hub (``HF_HUB_OFFLINE=1``, read when it was imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cache_folder(name: str | os.PathLike[str]) -> Path | None:
    """The Hub cache folder where the repo ``name``'s files arrive (``None``: ``name`` is a local folder)."""
    if not is_repo_id(name):
        return None
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + os.fspath(name).replace("/", "--"))


def locate_model(name: str | os.PathLike[str], *, revision: str | None = None, rank: int | None = None) -> ModelSource:
    """Where the model ``name`` is: a local folder as is, or a Hub repo with its metadata fetched.

    For a repo id, fetches (or, offline, finds in the cache) ``config.json``,
    the tokenizer files and the safetensors index at ``revision`` (default:
    the main branch), and checks that the repo holds every weight file the
    index names. ``rank`` goes into the user agent of the requests, so a
    server's log tells the ranks apart. Raises :class:`ModelNotFoundError`
    (one line) for a missing repo, revision or file, ``OSError`` when the Hub
    fails otherwise; a local path is not checked here.
    """
    if not is_repo_id(name):
        return ModelSource(Path(name))
    repo = os.fspath(name)
    agent = f"pipemlx; rank/{rank}" if rank is not None else "pipemlx"
    from huggingface_hub import HfApi, snapshot_download  # pyright: ignore[reportUnknownVariableType]

    what = f"the metadata of {repo!r}"
    root = Path(
        _hub_call(
            lambda: snapshot_download(
                repo,
                revision=revision,
                allow_patterns=list(METADATA_PATTERNS),
                user_agent=agent,
                tqdm_class=_quiet_bar(),  # small files: no progress bar before a one-line error
            ),
            repo,
            revision,
            what,
        )
    )
    commit = root.name
    if not (root / "config.json").is_file():
        raise ModelNotFoundError(f"the Hub repo {repo!r} has no config.json: it is not an mlx-lm model")
    weight_map: dict[str, str] = {}
    if (root / INDEX_FILE).is_file():
        try:
            index: Any = json.loads((root / INDEX_FILE).read_text(encoding="utf-8"))
            weight_map = {str(k): str(v) for k, v in dict(index["weight_map"]).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"the Hub repo {repo!r} has an unreadable {INDEX_FILE}: {exc}") from None
    files = tuple(sorted(set(weight_map.values())))
    if not offline():
        listed = set(
            _hub_call(lambda: HfApi(user_agent=agent).list_repo_files(repo, revision=commit), repo, revision, what)
        )
        if not weight_map:  # no index: every model*.safetensors, as mlx-lm's loader globs them
            files = tuple(sorted(f for f in listed if fnmatch.fnmatchcase(f, WEIGHT_PATTERN)))
            if not files:
                raise ModelNotFoundError(f"the Hub repo {repo!r} has no {WEIGHT_PATTERN} weight files")
        missing = [f for f in files if f not in listed]
        if missing:
            raise ModelNotFoundError(
                f"the Hub repo {repo!r} (commit {commit[:12]}) has no file {missing[0]}, which its {INDEX_FILE} names"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
    if not files:  # offline without an index: the weight files cached (a single model.safetensors if none)
        files = tuple(sorted(p.name for p in root.glob(WEIGHT_PATTERN))) or (SINGLE_FILE,)
    return ModelSource(root, repo, commit, weight_map, files, agent)


def rank_files(
    source: ModelSource,
    layers: range,
    *,
    keep_embedding: bool,
    keep_head: bool,
    tied: bool | None = None,
) -> tuple[str, ...]:
    """The weight files of ``source`` that hold the tensors a rank keeps, from the index alone.

    ``layers`` are the decoder layers whose weights the rank needs;
    ``keep_embedding`` whether it keeps the input embedding when the model has
    a separate output head (``lm_head``), ``keep_head`` whether it keeps that
    head (see :func:`pipemlx.models.weights.tensor_wanted`; ``tied``, default
    read from the index and config, says whether the embedding is the head).
    Without an index, every weight file (one ``model.safetensors``, usually).
    """
    if not source.weight_map:
        return source.weight_files
    names = list(source.weight_map)
    prefix = decoder_prefix(names)
    if tied is None:
        tied = is_tied(names, read_dir_config(source.root))
    return tuple(
        sorted(
            {
                file
                for name, file in source.weight_map.items()
                if tensor_wanted(name, prefix, layers, keep_embedding=keep_embedding, keep_head=keep_head, tied=tied)
            }
        )
    )


def needed_files(
    source: ModelSource,
    split: tuple[int, ...],
    rank: int,
    *,
    lend_mlp: bool = False,
    head: HeadPolicy = "all",
) -> tuple[str, ...]:
    """The weight files rank ``rank`` of a pipeline with layers per rank ``split`` needs (see :func:`rank_files`)."""
    layers = rank_layers(split, rank, lend_mlp=lend_mlp)
    # head="split": every rank holds its rows of the embedding and of the head.
    last = rank == len(split) - 1
    return rank_files(source, layers, keep_embedding=rank == 0 or head == "split", keep_head=head != "last" or last)


def check_cached(source: ModelSource, files: Iterable[str] | None = None) -> None:
    """Raise :class:`ModelNotFoundError` naming the first of ``files`` (default: every weight file) not cached.

    For offline use (``HF_HUB_OFFLINE=1``): what a rank, or a launcher whose ranks share this machine's cache,
    checks before starting.
    """
    if source.repo is None:
        return
    if headers_path(f"hub:{source.repo}@{source.commit}").is_file():
        return  # loaded once by range requests: the ranks' weight folders are in pipemlx's cache (each rank checks)
    wanted = sorted(set(source.weight_files if files is None else files))
    absent = [f for f in wanted if not (source.root / f).is_file()]
    if absent:
        raise ModelNotFoundError(
            f"{absent[0]} of {source.repo!r} is not in the Hub cache and HF_HUB_OFFLINE is set: "
            "fetch it once online (or unset HF_HUB_OFFLINE)"
        )


def remote_headers(source: ModelSource) -> dict[str, dict[str, Any]]:
    """Every tensor's safetensors header entry (dtype, shape, data_offsets) of ``source``, no tensor data read.

    A local folder's files are read; a repo's files are read from the cache
    where they are there, else their headers are fetched with HTTP range
    requests (huggingface_hub's ``parse_safetensors_file_metadata``).
    """
    if source.repo is None:
        from .safetensors import read_dir_headers

        return read_dir_headers(source.root)
    repo = source.repo
    headers: dict[str, dict[str, Any]] = {}
    for file in source.weight_files:
        cached = source.root / file
        if cached.is_file():
            headers.update(read_safetensors_header(cached))
            continue
        if offline():
            raise ModelNotFoundError(
                f"{file} of {repo!r} is not in the Hub cache and HF_HUB_OFFLINE is set: its header cannot be read"
            )
        from huggingface_hub import HfApi

        api = HfApi(user_agent=source.user_agent)
        metadata = _hub_call(
            lambda: api.parse_safetensors_file_metadata(repo, file, revision=source.commit),
            repo,
            source.commit,
            f"the header of {file} of {repo!r}",
        )
        for name, info in metadata.tensors.items():
            headers[name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": list(info.data_offsets)}
    return headers


def model_bytes_of(name: str | os.PathLike[str]) -> ModelBytes:
    """Per-layer and fixed parameter bytes of a model folder or Hub repo, from safetensors headers only."""
    source = locate_model(name)
    if source.repo is None:
        return model_bytes_from_dir(source.root)
    return model_bytes_from_headers(remote_headers(source), read_dir_config(source.root), source.name)


def memory_model_of(name: str | os.PathLike[str]) -> MemoryModel:
    """The memory model of a model folder or Hub repo, from its config and safetensors headers only."""
    source = locate_model(name)
    if source.repo is None:
        return memory_model_from_dir(source.root)
    return memory_model_from_headers(remote_headers(source), read_dir_config(source.root), source.name)


def _hub_call(call: Callable[[], T], repo: str, revision: str | None, what: str) -> T:
    """``call()``, with huggingface_hub's errors turned into one line naming what is missing."""
    from huggingface_hub import errors

    try:
        return call()
    except errors.LocalEntryNotFoundError:
        _raise_not_cached(repo, what)
    except errors.GatedRepoError:
        raise ModelNotFoundError(
            f"the Hub repo {repo!r} is gated: accept its terms on the Hub and log in (hf auth login)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{repo!r} is neither a local folder nor a model repo on the Hub (a private one needs hf auth login)"
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"the Hub repo {repo!r} has no revision {revision!r}") from None
    except errors.EntryNotFoundError as exc:
        raise ModelNotFoundError(f"the Hub repo {repo!r} lacks a file for {what}: {_first_line(exc)}") from None
    except errors.HfHubHTTPError as exc:
        raise OSError(f"the Hub failed while fetching {what}: {_first_line(exc)}") from None


def _quiet_bar() -> Any:
    """A tqdm class that shows nothing (huggingface_hub's ``tqdm_class``)."""
    from tqdm.asyncio import tqdm_asyncio

    class QuietBar(tqdm_asyncio):  # pyright: ignore[reportMissingTypeArgument]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # pyright: ignore[reportUnknownMemberType]

    return QuietBar


def _raise_not_cached(repo: str, what: str) -> NoReturn:
    reason = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
    raise ModelNotFoundError(f"{what} is not in the Hub cache and {reason}: fetch {repo!r} once online") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def headers_path(identity: str) -> Path:
    """Where pipemlx's cache keeps the safetensors headers of the model ``identity`` (a repo at a commit)."""
    return weights_root() / f"headers-{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"


@dataclass(frozen=True)
class HubSource:
    """A Hub repo at one commit, its weights read by HTTP range requests on the files' URLs.

    The config and tokenizer files are in the Hub cache (:func:`locate_model` fetched them); the safetensors
    headers are read with two range requests per file and kept in pipemlx's cache (``weights/``), so that a
    later run, online or offline, plans and finds its weight folder without asking the Hub again."""

    model: ModelSource
    count: FetchCount = field(default_factory=FetchCount)
    """Requests answered so far (the ranks' progress exchange counts them)."""

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def local(self) -> bool:
        return False

    def identity(self) -> str:
        return f"hub:{self.model.repo}@{self.model.commit}"

    def metadata_root(self) -> Path:
        return self.model.root

    def describe(self) -> str:
        from huggingface_hub import constants

        return f"the Hub ({constants.ENDPOINT})"

    def headers(self) -> dict[str, TensorInfo]:
        kept = headers_path(self.identity())
        try:
            return {k: TensorInfo.from_json(v) for k, v in json.loads(kept.read_text()).items()}
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass
        if offline():
            raise ModelNotFoundError(
                f"the safetensors headers of {self.name!r} are not in pipemlx's cache and HF_HUB_OFFLINE is set: "
                "load it once online (or unset HF_HUB_OFFLINE)"
            )
        out: dict[str, TensorInfo] = {}
        for file in self.model.weight_files:
            (length,) = struct.unpack("<Q", self._get(file, 0, 8))
            if length > 100 * 2**20:
                raise ValueError(f"{file} of {self.name!r} is not a safetensors file: header length {length}")
            out.update(parse_header(self._get(file, 8, 8 + length), length, file, repr(self.name)))
        kept.parent.mkdir(parents=True, exist_ok=True)
        temporary = kept.with_name(f"{kept.name}.{os.getpid()}")
        temporary.write_text(json.dumps({k: v.to_json() for k, v in out.items()}))
        os.replace(temporary, kept)
        return out

    def read(self, file: str, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
        """The range by one range request per :data:`~pipemlx.models.weights.CHUNK_BYTES`."""
        for begin in range(start, stop, CHUNK_BYTES):
            end = min(stop, begin + CHUNK_BYTES)
            offset = begin
            for piece in self._read_one(file, begin, end):
                yield offset, piece
                offset += len(piece)

    def _read_one(self, file: str, start: int, stop: int) -> Iterator[bytes]:
        if offline():
            raise ModelNotFoundError(
                f"{file} of {self.name!r} is not in pipemlx's cache for this rank's tensors and HF_HUB_OFFLINE is "
                "set: load it once online (or unset HF_HUB_OFFLINE)"
            )
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session  # pyright: ignore[reportUnknownVariableType]

        url = hf_hub_url(self.model.repo or "", file, revision=self.model.commit)
        headers = build_hf_headers(user_agent=self.model.user_agent)
        headers["Range"] = f"bytes={start}-{stop - 1}"
        got = 0
        try:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
                if response.status_code != 206:
                    raise TransferError(
                        f"the Hub answered {response.status_code} to a range request for bytes {start}-{stop - 1} "
                        f"of {file} of {self.name!r} (206 expected)"
                    )
                for piece in response.iter_bytes():
                    got += len(piece)
                    if got > stop - start:
                        break
                    yield piece
        except TransferError:
            raise
        except Exception as exc:  # the HTTP client's errors: a cut or refused connection
            raise TransferError(
                f"the range {start}-{stop - 1} of {file} of {self.name!r} from the Hub was cut after {got} of "
                f"{stop - start} bytes: {_first_line(exc)}"
            ) from None
        self.count.requests += 1
        if got != stop - start:
            raise TransferError(
                f"the Hub sent {got} bytes for the range {start}-{stop - 1} of {file} of {self.name!r}, "
                f"not {stop - start}"
            )

    def _get(self, file: str, start: int, stop: int) -> bytes:
        return b"".join(self._read_one(file, start, stop))


def resolve_source(
    name: str | os.PathLike[str],
    *,
    revision: str | None = None,
    rank: int | None = None,
    count: FetchCount | None = None,
) -> FolderSource | HubSource:
    """The model ``name`` as a weight source: a local folder, a Hub snapshot already holding every weight file
    (both read in place), or a Hub repo read by range requests. Raises :class:`ModelNotFoundError` as
    :func:`locate_model` does."""
    model = locate_model(name, revision=revision, rank=rank)
    if model.repo is None:
        return FolderSource(model.root)
    if all((model.root / f).is_file() for f in model.weight_files):
        return FolderSource(model.root, model.repo, model.weight_files)
    return HubSource(model, count if count is not None else FetchCount())


def cached_snapshot(name: str | os.PathLike[str], revision: str | None = None) -> FolderSource | None:
    """The model ``name`` where this machine has all of it without asking anyone: a model folder, or a Hub repo
    whose snapshot in the cache holds the config and every weight file. ``None`` otherwise (never raises)."""
    try:
        if not is_repo_id(name):
            root = Path(name)
            if (root / "config.json").is_file() and any(root.glob(WEIGHT_PATTERN)):
                return FolderSource(root)
            return None
        from huggingface_hub import snapshot_download  # pyright: ignore[reportUnknownVariableType]

        repo = os.fspath(name)
        root = Path(
            snapshot_download(repo, revision=revision, allow_patterns=list(METADATA_PATTERNS), local_files_only=True)
        )
        if not (root / "config.json").is_file():
            return None
        files: tuple[str, ...] = ()
        if (root / INDEX_FILE).is_file():
            files = tuple(sorted(set(json.loads((root / INDEX_FILE).read_text())["weight_map"].values())))
        else:
            files = tuple(sorted(p.name for p in root.glob(WEIGHT_PATTERN)))
        if files and all((root / f).is_file() for f in files):
            return FolderSource(root, repo, files)
    except Exception:  # not cached, unreadable: this machine does not hold it
        return None
    return None
