"""The calibration cache: what ``prefill_step_size="auto"`` and ``lend="auto"`` measured, kept on disk.

Calibrating times each rank's layers on a few chunks (:mod:`pipemlx.runtime.calibrate`): seconds on a large model,
paid by every new process. Its result depends only on the model, how it is cut, the machines and the software, so
each rank keeps the agreed figures in a small JSON file and the next run (in this process or another) reads them
instead of measuring again.

- **Where**: ``$PIPEMLX_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/pipemlx``, else ``~/.cache/pipemlx``; one file
  per kind and key, ``calibration-<kind>-<hash of the key>.json``.
- **Key**: everything the figures depend on (:func:`environment` and the caller's part): the model's configuration,
  the split and what is lent across each cut, the activation dtype, the world size, the hosts (the hostfile's
  addresses without their ports, or this host's name), the device, the pipemlx, MLX, mlx-lm and Python versions,
  the machine, and a preloaded BLAS. The whole key is stored in the file and compared on reading: any difference is
  a miss, and the file is then replaced.
- **Never trusted**: a file that is missing, unreadable, not JSON, of another format, of another key, or whose
  figures are not finite non-negative numbers of the expected shape is ignored (the group calibrates, and the file
  is rewritten); a cache folder that cannot be written is ignored too (the next run calibrates again).
- **Agreed**: reading the cache is local to a rank, so the ranks then compare a fingerprint of what they hold (one
  small all-gather that was there already): unless every rank holds the same figures, every rank measures again.

Nothing here communicates; nothing is kept in memory between calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from .._version import __version__

CACHE_DIR_VARIABLE = "PIPEMLX_CACHE_DIR"
"""Overrides the folder of the calibration cache (tests point it at a temporary folder)."""
FORMAT = 1
"""The files' format; bumped when the figures' meaning changes, which makes every older file a miss."""


def cache_dir() -> Path:
    """The folder of the calibration cache (see the module's docstring); it may not exist yet."""
    chosen = os.environ.get(CACHE_DIR_VARIABLE)
    if chosen:
        return Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pipemlx"


def _package_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed as a distribution: the key still says so
        return "?"


def hosts() -> list[str]:
    """The group's hosts as this rank knows them: the ring hostfile's addresses without their ports (the ports of
    local ranks change from run to run; the machines do not), else this host's name."""
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            entries: Any = json.loads(Path(path).read_text(encoding="utf-8"))
            return [
                ",".join(str(a).rsplit(":", 1)[0] for a in cast(list[Any], entry)) for entry in cast(list[Any], entries)
            ]
        except (OSError, ValueError, TypeError):
            pass
    return [socket.gethostname()]


def environment() -> dict[str, Any]:
    """The part of every key that describes the machines and the software, the same on every rank of a group."""
    return {
        "format": FORMAT,
        "pipemlx": __version__,
        "mlx": str(getattr(mx, "__version__", "?")),
        "mlx-lm": _package_version("mlx-lm"),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "blas": os.path.basename(os.environ.get("LD_PRELOAD", "")),
        "hosts": hosts(),
    }


def model_config(model: Any) -> dict[str, Any]:
    """The model's configuration (its ``args``) as JSON-able values: part of the key."""
    args: Any = getattr(model, "args", None)
    config: dict[str, Any] = cast(dict[str, Any], vars(args)) if hasattr(args, "__dict__") else {}
    return cast(dict[str, Any], json.loads(json.dumps(config, sort_keys=True, default=str)))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(value: Any) -> int:
    """A positive 31-bit fingerprint of a JSON-able ``value`` (0 is kept for "nothing"): what the ranks compare."""
    digest = hashlib.sha256(_canonical(value).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF or 1


def cache_path(kind: str, key: Mapping[str, Any]) -> Path:
    """The file holding the figures of ``kind`` for ``key``."""
    digest = hashlib.sha256(_canonical(key).encode()).hexdigest()[:24]
    return cache_dir() / f"calibration-{kind}-{digest}.json"


def load(kind: str, key: Mapping[str, Any]) -> Any:
    """The figures stored for ``kind`` and ``key``; ``None`` when there are none or the file cannot be trusted."""
    path = cache_path(kind, key)
    try:
        stored: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict):
        return None
    entry = cast(dict[str, Any], stored)
    if entry.get("kind") != kind or _canonical(entry.get("key")) != _canonical(key):
        return None
    return entry.get("value")


def store(kind: str, key: Mapping[str, Any], value: Any) -> None:
    """Write the figures of ``kind`` for ``key`` (atomically: a reader sees the old file or the new one); an error
    of the file system is ignored (the next run calibrates again)."""
    path = cache_path(kind, key)
    text = json.dumps({"kind": kind, "key": key, "value": value}, sort_keys=True, default=str)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(text)
            os.replace(temporary, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def figures(value: Any, length: int | None = None) -> list[float] | None:
    """``value`` as a list of finite non-negative floats (of ``length`` if given); ``None`` if it is anything else."""
    if not isinstance(value, list):
        return None
    items = cast(list[Any], value)
    if length is not None and len(items) != length:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in items):
        return None
    return [float(v) for v in items]
