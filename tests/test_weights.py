"""A rank's own tensors fetched by byte ranges, from a peer that has the model or from the (stand-in) Hub.

In one process, no ranks: a :class:`PeerServer` serving a tiny llama folder on loopback, and ``StandInHub``
serving it as a repo. Each fetch writes rank 1 of 2's weight folder (its two layers, the norm and the head, no
embedding); the bytes the server sent are counted and compared with the bytes of the tensors kept, the folder's
tensors with the model's own, and a second fetch must send nothing. A proxy between the rank and the server
changes one byte, or cuts the connection, and the fetch must fail with a clear error and leave no weight folder.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from hub_server import StandInHub

from pipemlx.models.hub import HubSource, ModelSource, locate_model, resolve_source
from pipemlx.models.peer import PeerServer, PeerSource, fingerprint
from pipemlx.models.weights import (
    DONE_FILE,
    FolderSource,
    TensorPart,
    TransferError,
    fetch_rank_folder,
    header_bytes,
    rank_tensors,
    weights_root,
)
from pipemlx.runtime.calibration_cache import CACHE_DIR_VARIABLE
from pipemlx.testing import build_model, save_model_dir, tiny_config

REPO = "some-org/peer-model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tiny_config("llama", num_hidden_layers=4)
    return save_model_dir(build_model(config, seed=5), config, tmp_path_factory.mktemp("peer") / "model", index=False)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def rank1_parts(source: FolderSource) -> tuple[TensorPart, ...]:
    """Rank 1 of a (2, 2) split: layers 2-3, the final norm and the untied head; no embedding."""
    headers = source.headers()
    return rank_tensors(headers, json.loads((source.root / "config.json").read_text()), (2, 2), 1)


def kept_bytes(source: FolderSource, parts: tuple[TensorPart, ...]) -> int:
    headers = source.headers()
    return sum(headers[p.name].stop - headers[p.name].start for p in parts)


def check_folder(folder: Path, model_dir: Path, parts: tuple[TensorPart, ...]) -> None:
    """The folder's tensors are exactly ``parts``, byte-equal to the model's; its config and tokenizer beside."""
    whole = mx.load(str(model_dir / "model.safetensors"))
    got = mx.load(str(folder / "model.safetensors"))
    assert set(got) == {p.name for p in parts}
    for name, value in got.items():  # pyright: ignore[reportUnknownVariableType]
        assert mx.array_equal(value, whole[name]).item(), name  # pyright: ignore[reportUnknownArgumentType]
    assert (folder / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    assert (folder / "tokenizer.json").is_file() and (folder / DONE_FILE).is_file()


def tensors(path: Path) -> dict[str, mx.array]:
    """The tensors of a safetensors file."""
    return cast(dict[str, mx.array], mx.load(str(path)))


def peer_of(server: PeerServer, address: tuple[str, int] | None = None, token: bytes | None = None) -> PeerSource:
    held = server.source
    return PeerSource(str(held.root), address or server.address, token or server.token, fingerprint(held), 0)


@pytest.fixture
def writebacks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every ``_Writeback`` of the test's fetches, each starting the disk write every 4 KiB (the tiny model's
    folders are far below the 16 MiB of a real fetch), so that the checks below run with the writes started."""
    from pipemlx.models import weights

    made: list[Any] = []

    class Counted(weights._Writeback):  # noqa: SLF001
        def __init__(self, fd: int) -> None:
            super().__init__(fd)
            made.append(self)

    monkeypatch.setattr(weights, "WRITEBACK_BYTES", 4096)
    monkeypatch.setattr(weights, "_Writeback", Counted)
    return made


@pytest.mark.parametrize("available", [True, False])
def test_the_disk_write_starts_while_the_bytes_arrive_and_without_it_the_folder_is_the_same(
    served: PeerServer, model_dir: Path, writebacks: list[Any], available: bool
) -> None:
    """On Linux the fetch starts the disk write of its new file as it goes (``sync_file_range``); where that call
    is missing (macOS) or fails, it is skipped: either way the folder equals the model's."""
    parts = rank1_parts(served.source)
    if not available:
        from pipemlx.models import weights

        original = weights._Writeback.__init__  # noqa: SLF001

        def without(self: Any, fd: int) -> None:
            original(self, fd)
            self._call = None

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(weights._Writeback, "__init__", without)  # noqa: SLF001
            folder = fetch_rank_folder(peer_of(served), parts)
    else:
        folder = fetch_rank_folder(peer_of(served), parts)
    check_folder(folder, model_dir, parts)
    (made,) = writebacks
    expected = available and sys.platform == "linux"
    assert (made.started > 0) == expected, made.started
    if expected:  # at most one start per 4 KiB written (the calls that started counted: they did not fail)
        assert made.started <= kept_bytes(served.source, parts) // 4096


def test_a_peer_sends_only_the_ranges_of_the_tensors_kept_and_a_second_fetch_sends_nothing(model_dir: Path) -> None:
    held = FolderSource(model_dir)
    parts = rank1_parts(held)
    assert not any("embed_tokens" in p.name for p in parts) and any("lm_head" in p.name for p in parts)
    with PeerServer(held, "127.0.0.1", b"k" * 32) as server:
        peer = peer_of(server)
        folder = fetch_rank_folder(peer, parts)
        first = server.served
        peer.close()
        again = fetch_rank_folder(peer_of(server), parts)
        assert server.served == first and again == folder  # from the cache: nothing sent
    check_folder(folder, model_dir, parts)
    kept = kept_bytes(held, parts)
    assert kept <= first <= 1.1 * kept + header_bytes(held.headers()), (first, kept)
    assert first < 0.8 * (model_dir / "model.safetensors").stat().st_size  # not the whole file


@pytest.mark.parametrize("head", ["all", "split"])
def test_the_stand_in_hub_is_read_by_ranges_of_the_tensors_kept(model_dir: Path, head: str) -> None:
    """Rank 1 of 2's tensors by range requests; with head="split" its rows of the embedding and head only."""
    held = FolderSource(model_dir)
    parts = rank_tensors(held.headers(), json.loads((model_dir / "config.json").read_text()), (2, 2), 1, head=head)
    assert head == "all" or {p.name for p in parts if p.rows} == {"model.embed_tokens.weight", "lm_head.weight"}
    with StandInHub({REPO: model_dir}) as hub, pytest.MonkeyPatch.context() as patch:
        from huggingface_hub import constants

        patch.setattr(constants, "ENDPOINT", hub.url)
        patch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        patch.setenv("HF_HUB_CACHE", str(weights_root().parent / "hf"))
        patch.setattr(constants, "HF_HUB_CACHE", str(weights_root().parent / "hf"))
        source = resolve_source(REPO)
        assert isinstance(source, HubSource)
        hub.clear()
        folder = fetch_rank_folder(source, parts)
        sent = _range_bytes(hub)
        hub.clear()
        assert fetch_rank_folder(resolve_source(REPO), parts) == folder
        assert _range_bytes(hub) == 0
    whole = tensors(model_dir / "model.safetensors")
    got = tensors(folder / "model.safetensors")
    assert set(got) == {p.name for p in parts}
    for part in parts:
        first, last = part.rows or (0, whole[part.name].shape[0])
        assert mx.array_equal(got[part.name], whole[part.name][first:last]).item(), part
    assert (folder / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    kept = sum(value.nbytes for value in got.values())
    assert kept <= sent <= 1.1 * kept + header_bytes(held.headers()), (sent, kept)
    if head == "split":  # the folder's rows are rank 1's: rank 0 of 2 (or rank 1 of 3) loading it is refused
        from mlx_lm.utils import load_model  # pyright: ignore[reportUnknownVariableType]

        from pipemlx.models.loading import take_fetched_rows

        for rank, size in ((0, 2), (1, 3)):
            model: Any = load_model(folder, lazy=True, strict=False)[0]  # pyright: ignore[reportUnknownVariableType]
            with pytest.raises(
                ValueError, match=r"holds rows \(\d+, \d+\) of (model.embed_tokens|lm_head).weight, which are not rank"
            ):
                take_fetched_rows(model, folder, rank, size)
        model: Any = load_model(folder, lazy=True, strict=False)[0]  # pyright: ignore[reportUnknownVariableType]
        assert take_fetched_rows(model, folder, 1, 2) == 2
        assert model.model.embed_tokens.weight.shape == whole["model.embed_tokens.weight"].shape  # the stand-in


def _range_bytes(hub: StandInHub) -> int:
    """Bytes of the weight file the hub sent for range requests (``bytes=a-b``: b - a + 1 each)."""
    total = 0
    for request in hub.requests():
        if request.file() == "model.safetensors" and request.method == "GET":
            assert request.range is not None, "a whole weight file was requested"
            match = re.fullmatch(r"bytes=(\d+)-(\d+)", request.range)
            assert match is not None
            total += int(match.group(2)) - int(match.group(1)) + 1
    return total


class Proxy:
    """A TCP proxy to ``target`` that changes byte ``flip`` of what the server sends (counted from the start of
    a connection), or closes both sides after ``cut`` bytes from the server, on its first ``times`` connections
    (``None``: on every one); later connections pass unchanged."""

    def __init__(
        self, target: tuple[str, int], *, flip: int | None = None, cut: int | None = None, times: int | None = None
    ) -> None:
        self.target, self.flip, self.cut, self.times = target, flip, cut, times
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = ("127.0.0.1", self.sock.getsockname()[1])
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            tamper = self.times is None or self.connections <= self.times
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, tamper), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if tamper and self.flip is not None and seen <= self.flip < seen + len(data):
                    changed = bytearray(data)
                    changed[self.flip - seen] ^= 0x01
                    data = bytes(changed)
                if tamper and self.cut is not None and seen + len(data) > self.cut:
                    dst.sendall(data[: self.cut - seen])
                    break
                dst.sendall(data)
                seen += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def served(model_dir: Path) -> Iterator[PeerServer]:
    with PeerServer(FolderSource(model_dir), "127.0.0.1", b"t" * 32) as server:
        yield server


def _no_folder_left() -> None:
    left = [p.name for p in weights_root().glob("*") if not p.name.startswith("meta-")]
    assert left == [], f"a weight folder was left: {left}"


def test_a_flipped_byte_in_transit_fails_the_fetch_and_leaves_no_folder(
    served: PeerServer, model_dir: Path, writebacks: list[Any]
) -> None:
    parts = rank1_parts(served.source)
    fetch_rank_folder(peer_of(served), ())  # the metadata (headers, config) through a clean link first
    for folder in weights_root().glob("*"):
        if not folder.name.startswith("meta-"):
            import shutil

            shutil.rmtree(folder)
    proxy = Proxy(served.address, flip=16 + 9 + 1000)  # the challenge, one answer's head, then its body
    with pytest.raises(TransferError, match="fail their check"):
        fetch_rank_folder(peer_of(served, proxy.address), parts)
    proxy.close()
    _no_folder_left()


@pytest.mark.parametrize("times", [1, None])
def test_a_cut_transfer_resumes_or_fails_with_a_clear_error_and_leaves_no_folder(
    served: PeerServer,
    model_dir: Path,
    times: int | None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: Any,
    writebacks: list[Any],
) -> None:
    """Cut once: the rank reconnects and goes on from the answer that was cut; the folder equals the model's.
    Cut on every connection: the rank fails after RESUME_TRIES reconnections, with no folder left. (The disk
    write of the new file is started every 4 KiB here: the bytes written again after the cut still land.)"""
    from pipemlx.models import peer

    monkeypatch.setattr(peer, "RESUME_WAIT_S", 0.01)
    parts = rank1_parts(served.source)
    fetch_rank_folder(peer_of(served), ())
    for folder in weights_root().glob("*"):
        if not folder.name.startswith("meta-"):
            import shutil

            shutil.rmtree(folder)
    before = served.served
    proxy = Proxy(served.address, cut=16 + 9 + 5000, times=times)
    if times is None:
        with pytest.raises(TransferError, match=r"was cut after \d+ bytes .*\(3 reconnections failed\)"):
            fetch_rank_folder(peer_of(served, proxy.address), parts)
        assert proxy.connections == 1 + peer.RESUME_TRIES
        _no_folder_left()
    else:
        folder = fetch_rank_folder(peer_of(served, proxy.address), parts)
        check_folder(folder, model_dir, parts)
        assert proxy.connections == 2 and "reconnecting (1 of 3)" in caplog.text
        kept = kept_bytes(served.source, parts)
        assert kept < served.served - before <= kept + 5000 + 2 * 16 * 2**20  # the cut answer sent again
    proxy.close()


def test_the_server_answers_only_the_token_and_only_the_models_files(
    served: PeerServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipemlx.models import peer

    monkeypatch.setattr(peer, "RESUME_WAIT_S", 0.01)  # a wrong token looks like a cut: reconnections, then the error
    with pytest.raises(TransferError, match="was cut|cannot reach"):  # a wrong token: the server hangs up
        peer_of(served, token=b"x" * 32).headers()
    peer = peer_of(served)
    for request, refusal in (
        ({"op": "file", "name": "../../etc/passwd"}, "not a config or tokenizer file"),
        ({"op": "file", "name": "model.safetensors"}, "not a config or tokenizer file"),
        ({"op": "range", "file": "config.json", "start": 0, "stop": 10}, "not a weight file"),
        ({"op": "range", "file": "model.safetensors", "start": 0, "stop": 10**12}, "not a range"),
        ({"op": "write", "file": "model.safetensors"}, "unknown request"),
    ):
        with pytest.raises(TransferError, match=refusal):
            peer._request(request)  # pyright: ignore[reportPrivateUsage]


def test_rank_tensors_match_the_files_each_rank_fetched_from_the_index(model_dir: Path) -> None:
    """The tensor view and the file view agree: every tensor a rank keeps is in a file it would fetch."""
    held = FolderSource(model_dir)
    headers = held.headers()
    config = json.loads((model_dir / "config.json").read_text())
    weight_map = {name: f"file-{name.split('.')[2] if '.layers.' in name else name}" for name in headers}
    from pipemlx.models.hub import needed_files

    model = ModelSource(model_dir, REPO, "0" * 40, weight_map, tuple(sorted(set(weight_map.values()))))
    for split in ((2, 2), (1, 3), (3, 1)):
        for rank in (0, 1):
            parts = rank_tensors(headers, config, split, rank)
            assert {weight_map[p.name] for p in parts} == set(needed_files(model, split, rank))
    assert locate_model(model_dir).repo is None


# --- three loopback ranks, only rank 0 has the model --------------------------------------------------------------

PROMPT_IDS = [5, 17, 3, 99, 42, 8, 61, 23, 7, 11]


def _peer_ranks(tmp_path: Path, model_dir: Path, **extra: object) -> list[tuple[int, str, str]]:
    """``tests/ranks/peer_load.py`` on 2 ranks: rank 0's folder holds ``model`` (a copy), rank 1's does not;
    each rank its own pipemlx cache. Returns each rank's status, stdout and stderr. (Three ranks, each but the
    first fetching: the namespace-host test below.)"""
    import shutil
    import sys

    from pipemlx.launch import launch

    cwds = [tmp_path / f"host{r}" for r in range(2)]
    for cwd in cwds:
        cwd.mkdir(exist_ok=True)
    if not (cwds[0] / "model").exists():
        shutil.copytree(model_dir, cwds[0] / "model")
    spec = {
        "cwds": [str(c) for c in cwds],
        "caches": [str(tmp_path / f"cache{r}") for r in range(2)],
        "model": "model",
        "prompt": PROMPT_IDS,
        "step": 4,
        "max_tokens": 6,
        **extra,
    }
    program = Path(__file__).parent / "ranks" / "peer_load.py"
    results = launch(2, [sys.executable, str(program), json.dumps(spec)], timeout=120, fail_fast=False)
    return [(r.returncode, r.stdout, r.stderr) for r in results]


def _reference(model_dir: Path) -> list[int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model: object = load(str(model_dir))[0]
    prompt = mx.array(PROMPT_IDS, dtype=mx.int32)
    return [int(t) for t, _ in generate_step(prompt, model, prefill_step_size=4, max_tokens=6)]  # type: ignore[arg-type]


def test_a_rank_without_the_model_fetches_its_tensors_from_rank_0_then_nothing_the_second_time(
    model_dir: Path, tmp_path: Path
) -> None:
    first = _peer_ranks(tmp_path, model_dir, loads=2)  # the second load_sharded must fetch nothing
    shown = "\n".join(f"--- rank {r} ({code}):\n{err[-2500:]}" for r, (code, _, err) in enumerate(first))
    assert [code for code, _, _ in first] == [0, 0], shown
    reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in first]
    expected = _reference(model_dir)
    assert all(r["tokens"] == expected for r in reports), (reports, expected)
    assert reports[0]["folders"] == [] and len(reports[1]["folders"]) == 2, reports  # meta-* and its own
    served = [int(m) for m in re.findall(r"served (\d+) bytes", first[0][2])]
    assert len(served) == 1, first[0][2]  # one "served" line: the second load served nothing
    assert len(re.findall(r"rank 1/2 fetched", first[1][2])) == 1, first[1][2]
    headers = FolderSource(model_dir).headers()
    folder = next(p for p in (tmp_path / "cache1" / "weights").glob("*") if not p.name.startswith("meta-"))
    got = mx.load(str(folder / "model.safetensors"))
    kept = sum(headers[n].stop - headers[n].start for n in got)
    assert "model.embed_tokens.weight" not in got and "lm_head.weight" in got and len(got) < len(headers)
    assert "rank 1/2 fetched" in first[1][2] and "from rank 0 (127.0.0.1:" in first[1][2], first[1][2]
    assert kept <= served[0] <= 1.1 * kept, (served, kept)


def test_with_a_split_head_a_rank_fetches_only_its_rows_of_the_embedding_and_head(
    model_dir: Path, tmp_path: Path
) -> None:
    """head="split": rank 1 fetches rows [V/2, V) of the embedding and of the head, not the whole matrices (bytes
    served within 1.1x of the rows and layers it keeps), and decodes mlx-lm's tokens on every rank."""
    results = _peer_ranks(tmp_path, model_dir, head="split")
    shown = "\n".join(f"--- rank {r} ({code}):\n{err[-2500:]}" for r, (code, _, err) in enumerate(results))
    assert [code for code, _, _ in results] == [0, 0], shown
    reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    expected = _reference(model_dir)
    assert all(r["tokens"] == expected for r in reports), (reports, expected)
    whole = tensors(model_dir / "model.safetensors")
    folder = next(p for p in (tmp_path / "cache1" / "weights").glob("*") if not p.name.startswith("meta-"))
    got = tensors(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        vocab = whole[name].shape[0]
        assert mx.array_equal(got[name], whole[name][vocab // 2 :]).item(), name
    kept = sum(value.nbytes for value in got.values())
    served = [int(m) for m in re.findall(r"served (\d+) bytes", results[0][2])]
    assert len(served) == 1 and kept <= served[0] <= 1.1 * kept, (served, kept)
    rows_bytes = whole["model.embed_tokens.weight"].nbytes // 2 + whole["lm_head.weight"].nbytes // 2
    assert served[0] < kept + rows_bytes  # the other halves were not sent


def test_the_holder_killed_mid_transfer_ends_every_rank_with_a_clear_error_and_no_folder(
    model_dir: Path, tmp_path: Path
) -> None:
    results = _peer_ranks(tmp_path, model_dir, chunk=8192, die_after=3, timeout=5.0)
    shown = "\n".join(f"--- rank {r} ({code}):\n{err[-2500:]}" for r, (code, _, err) in enumerate(results))
    assert results[0][0] == 9, shown
    for r in (1,):
        code, _, err = results[r]
        assert code == 3, shown
        line = [x for x in err.splitlines() if x.startswith(f"rank {r}:")]
        assert line and "rank 0" in line[0], shown
        left = [p.name for p in (tmp_path / f"cache{r}" / "weights").glob("*") if not p.name.startswith("meta-")]
        assert left == [], f"rank {r} left {left}"


def host_folders(model_dir: Path, tmp_path: Path, count: int) -> list[Path]:
    """A working folder per namespace host; only host 0's holds the model, as ``model``."""
    import shutil

    cwds = [tmp_path / f"host{r}" for r in range(count)]
    for cwd in cwds:
        cwd.mkdir()
    shutil.copytree(model_dir, cwds[0] / "model")
    return cwds


def test_generate_with_a_hostfile_where_only_host_0_has_the_model(model_dir: Path, tmp_path: Path) -> None:
    """`pipemlx generate --hostfile FILE --model model` on 3 network-namespace hosts, each in its own folder with
    its own cache: only host 0's folder has ``model``. The others read their tensors from it over the hostfile's
    addresses, and every rank gives single-process mlx-lm's tokens."""
    import os
    import subprocess
    import sys

    from netns import every_stderr, finish_all, namespace_hosts, skip_unless_available

    skip_unless_available()
    root = Path(__file__).resolve().parent.parent
    cwds = host_folders(model_dir, tmp_path, 3)
    with namespace_hosts(3) as hosts:
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps([[a] for a in hosts.addresses]))
        argv = [sys.executable, "-m", "pipemlx", "generate", "--hostfile", str(hostfile), "--model", "model"]
        argv += ["--prompt", "t5 t17 t3 t99 t42 t8 t61 t23", "--prefill-step-size", "4", "--max-tokens", "6"]
        argv += ["--temp", "0", "--json", "--lend", "none", "--timeout", "20"]
        python_path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
        procs = [
            subprocess.Popen(
                [*hosts.prefix(r), *argv],
                cwd=cwds[r],
                env={**os.environ, "PYTHONPATH": python_path, CACHE_DIR_VARIABLE: str(tmp_path / f"cache{r}")},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(3)
        ]
        results = finish_all(procs, 120)
    stderr = every_stderr(results)
    assert [code for code, _, _ in results] == [0, 0, 0], stderr
    report = json.loads(results[0][1].strip().splitlines()[-1])
    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import load

    loaded: object = load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]  # type: ignore[index]
    expected = [
        r.token
        for r in stream_generate(model, tokenizer, "t5 t17 t3 t99 t42 t8 t61 t23", max_tokens=6, prefill_step_size=4)
        if r.finish_reason != "stop"
    ]
    assert report["tokens"] == expected, stderr
    for r in (1, 2):
        assert f"from rank 0 ({hosts.ips[0]}:" in results[r][2], stderr
    assert "served" in results[0][2], stderr


def test_the_doctor_says_which_hosts_have_the_model(model_dir: Path, tmp_path: Path) -> None:
    from pipemlx.cli.doctor_rank import model_here, render

    assert model_here(model_dir) == "has it" and model_here(tmp_path / "model") == "fetches"
    ranks = [
        {"rank": r, "host": f"h{r}", "address": "", "mlx": "1", "mlx-lm": "2", "pipemlx": "3", "available": 10**9}
        for r in range(2)
    ]
    ranks = [{**ranks[0], "model": "has it"}, {**ranks[1], "model": "fetches"}]
    lines = render({"backend": "ring", "ranks": ranks, "links": [], "ok": True, "problems": []}).splitlines()
    assert "model" in lines[1].split() and "has it" in lines[2] and "fetches" in lines[3], lines


def test_a_row_range_of_a_tensor_is_fetched_as_a_tensor_of_those_rows(served: PeerServer, model_dir: Path) -> None:
    """A tensor set entry may be rows of a tensor (the vocabulary rows a rank keeps of the embedding or head):
    one byte range, written as a tensor of that many rows; other rows, other cache key."""
    whole = mx.load(str(model_dir / "model.safetensors"))
    parts = (TensorPart("model.embed_tokens.weight", (64, 192)), TensorPart("model.norm.weight"))
    before = served.served
    folder = fetch_rank_folder(peer_of(served), parts)
    got = mx.load(str(folder / "model.safetensors"))
    embedding = whole["model.embed_tokens.weight"]
    assert got["model.embed_tokens.weight"].shape == (128, embedding.shape[1])
    assert mx.array_equal(got["model.embed_tokens.weight"], embedding[64:192]).item()
    assert mx.array_equal(got["model.norm.weight"], whole["model.norm.weight"]).item()
    assert served.served - before == 128 * embedding.shape[1] * embedding.itemsize + whole["model.norm.weight"].nbytes
    other = fetch_rank_folder(peer_of(served), (TensorPart("model.embed_tokens.weight", (0, 64)),))
    assert other != folder
    with pytest.raises(ValueError, match="out of range"):
        fetch_rank_folder(peer_of(served), (TensorPart("model.embed_tokens.weight", (0, 10**6)),))


def test_serve_with_a_hostfile_where_only_host_0_has_the_model(model_dir: Path, tmp_path: Path) -> None:
    """`pipemlx serve --hostfile FILE --model model` on 2 network-namespace hosts, each in its own folder with its
    own cache: only host 0's folder has ``model``. Host 1 skips the model checks, fetches its tensors from rank 0,
    and a completion asked of rank 0 (from inside host 0's namespace) is single-process mlx-lm's text."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from mlx_lm.generate import stream_generate
    from mlx_lm.utils import load
    from netns import namespace_hosts, skip_unless_available
    from test_serve_recovery_hosts import enter_namespace

    skip_unless_available()
    root = Path(__file__).resolve().parent.parent
    cwds = host_folders(model_dir, tmp_path, 2)
    prompt = "t5 t17 t3 t99 t42 t8 t61 t23"
    with namespace_hosts(2) as hosts:
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps([[a] for a in hosts.addresses]))
        port = 18131
        argv = [sys.executable, "-m", "pipemlx", "serve", "--hostfile", str(hostfile), "--model", "model"]
        argv += ["--host", hosts.ips[0], "--port", str(port), "--lend", "none", "--timeout", "20"]
        python_path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
        logs = [open(tmp_path / f"rank{r}.err", "w+b") for r in range(2)]  # noqa: SIM115 (closed below)
        procs = [
            subprocess.Popen(
                [*hosts.prefix(r), *argv],
                cwd=cwds[r],
                env={**os.environ, "PYTHONPATH": python_path, CACHE_DIR_VARIABLE: str(tmp_path / f"cache{r}")},
                stdout=subprocess.DEVNULL,
                stderr=logs[r],
            )
            for r in range(2)
        ]

        def stderr() -> str:
            return "\n".join(
                f"--- rank {r} ({p.poll()}):\n{(tmp_path / f'rank{r}.err').read_text(errors='replace')[-2000:]}"
                for r, p in enumerate(procs)
            )

        def ask() -> dict[str, object]:
            url = f"http://{hosts.ips[0]}:{port}"
            deadline = time.monotonic() + 90
            while True:  # until rank 0 listens (the ranks load first)
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        raise
                time.sleep(0.5)
            body = json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0}).encode()
            request = urllib.request.Request(
                f"{url}/v1/completions", body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=60) as answer:
                return json.loads(answer.read())

        try:
            with ThreadPoolExecutor(1, initializer=enter_namespace, initargs=(hosts.hosts[0],)) as pool:
                try:
                    answer = pool.submit(ask).result(timeout=150)
                except Exception as exc:
                    pytest.fail(f"no answer from rank 0: {type(exc).__name__}: {exc}\n{stderr()}", pytrace=False)
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=30)
            for log in logs:
                log.close()
    loaded: object = load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]  # type: ignore[index]
    expected = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=6))
    choices: list[dict[str, object]] = answer["choices"]  # type: ignore[assignment]
    assert choices[0]["text"] == expected, stderr()
    assert "from rank 0 (" in stderr(), stderr()


def test_the_holder_listens_on_its_hostfile_entry_or_on_pipemlx_peer_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ring: the rank's hostfile entry; MPI (no hostfile): loopback unless PIPEMLX_PEER_HOST names an address."""
    from pipemlx.models.peer import own_host

    monkeypatch.delenv("PIPEMLX_PEER_HOST", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    assert own_host(1) == "127.0.0.1"
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["[fd00::2]:5001"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert (own_host(0), own_host(1)) == ("10.0.0.1", "fd00::2")
    monkeypatch.setenv("PIPEMLX_PEER_HOST", "192.168.1.7")
    assert own_host(1) == "192.168.1.7"
