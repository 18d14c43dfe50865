"""A stand-in for the Hugging Face Hub: model folders served over HTTP as huggingface_hub's clients ask for them.

Point ``HF_ENDPOINT`` at :attr:`StandInHub.url`. It answers what huggingface_hub's
downloads call, and logs every request (method, path, user agent, range):

- ``GET /api/models/{repo}/revision/{rev}``: ``{"id", "sha", "siblings"}``;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: a list of ``{"type": "file", "path", "size", "oid"}``;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: the file with ``ETag``, ``X-Repo-Commit`` and
  ``Content-Length``; ``Range: bytes=a-b`` gets 206 and that slice (safetensors headers read remotely).

An unknown repo is 404 with ``X-Error-Code: RepoNotFound``, an unknown revision ``RevisionNotFound``, an unknown
file ``EntryNotFound``, as the Hub answers. A repo's files are its folder's files minus ``hidden`` ones (which
the index may still name: a missing file).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Request:
    """One request the stand-in received."""

    method: str
    path: str
    agent: str
    range: str | None
    at: float = 0.0
    """When it arrived (``time.monotonic()``)."""

    def rank(self) -> str | None:
        """The rank named in the user agent (``rank/1``), or None (a launcher, a single process)."""
        match = re.search(r"rank/(\d+)", self.agent)
        return match.group(1) if match else None

    def file(self) -> str | None:
        """The file a ``/resolve/`` request names."""
        match = re.match(r"^/[^/]+/[^/]+/resolve/[^/]+/(.+)$", self.path)
        return match.group(1) if match else None


class StandInHub:
    """An HTTP server on 127.0.0.1 serving ``repos`` (repo id -> folder); use as a context manager."""

    def __init__(self, repos: dict[str, Path], hidden: dict[str, set[str]] | None = None, delay: float = 0.0) -> None:
        self.repos = repos
        self.hidden = hidden or {}
        self.delay = delay
        """Seconds every answer waits before it is sent (a slow link to the Hub); may be changed while serving."""
        self.weight_delay = 0.0
        """Seconds more that a weight file's tensors (``*.safetensors``, whole or a range past the header) wait."""
        self.log: list[Request] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub._answer(self, body=False)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> StandInHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def requests(self) -> list[Request]:
        with self._lock:
            return list(self.log)

    def clear(self) -> None:
        with self._lock:
            self.log.clear()

    @staticmethod
    def commit(repo: str) -> str:
        """The one commit a repo has (40 hex digits)."""
        return hashlib.sha1(repo.encode()).hexdigest()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        hidden = self.hidden.get(repo, set())
        return {p.name: p for p in sorted(root.iterdir()) if p.is_file() and p.name not in hidden}

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        agent, wanted_range = handler.headers.get("User-Agent", ""), handler.headers.get("Range")
        with self._lock:
            self.log.append(Request(handler.command, path, agent, wanted_range, time.monotonic()))
        if self.delay:
            time.sleep(self.delay)
        tensors = wanted_range is None or not re.match(r"bytes=(0|8)-", wanted_range)  # not a header's bytes
        if self.weight_delay and path.endswith(".safetensors") and tensors and handler.command == "GET":
            time.sleep(self.weight_delay)
        api = re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?$", path)
        resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        repo = api.group(1) if api else resolve.group(1) if resolve else None
        if repo is None or repo not in self.repos:
            return _error(handler, 404, "RepoNotFound", f"Repository {repo} not found")
        revision = (api or resolve).group(3 if api else 2)  # type: ignore[union-attr]
        sha = self.commit(repo)
        if revision not in ("main", sha):
            return _error(handler, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = self.files(repo)
        if api and api.group(2) == "revision":
            info = {"id": repo, "modelId": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
            return _send(handler, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if api:
            tree = [{"type": "file", "path": f, "size": p.stat().st_size, "oid": _oid(p)} for f, p in files.items()]
            return _send(handler, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        assert resolve is not None
        name = resolve.group(3)
        if name not in files:
            return _error(handler, 404, "EntryNotFound", f"Entry {name} not found")
        data = files[name].read_bytes()
        headers = {"ETag": f'"{_oid(files[name])}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        wanted = re.match(r"bytes=(\d+)-(\d*)", handler.headers.get("Range") or "")
        if wanted:
            start = int(wanted.group(1))
            stop = min(int(wanted.group(2)) + 1 if wanted.group(2) else len(data), len(data))
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{len(data)}"
            return _send(handler, 206, data[start:stop], headers, body)
        return _send(handler, 200, data, headers, body)


class _QuietServer(ThreadingHTTPServer):
    """A client that went away mid-answer (a rank killed while it downloads) is no error of the stand-in's."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def _oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
    handler.send_response(status)
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if body:
        handler.wfile.write(data)


def _error(handler: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
    data = json.dumps({"error": message}).encode()
    handler.send_response(status)
    handler.send_header("X-Error-Code", code)
    handler.send_header("X-Error-Message", message)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)
