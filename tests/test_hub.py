"""Models by name: a Hugging Face repo id in place of a folder, each rank fetching only the files it needs.

A stand-in Hub (``hub_server.StandInHub``, reached through ``HF_ENDPOINT``)
serves a tiny 4-layer llama split over 4 safetensors files: the embedding,
layers 0-1, layers 2-3, and the final norm with the output head. With 2
ranks, rank 0 needs files 1, 2 and 4 and rank 1 files 3 and 4; the server's
log (the rank is in each request's user agent) shows who fetched what. Every
test has its own ``HF_HOME``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from fakes import FakeGroup
from hub_server import StandInHub
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate
from mlx_lm.utils import load

from pipemlx.cli.split import main as split_main
from pipemlx.launch import launch
from pipemlx.models import loading
from pipemlx.models.hub import ModelSource, needed_files, rank_files
from pipemlx.models.sharding import EmbeddingStandIn
from pipemlx.models.weights import FolderSource, rank_tensors
from pipemlx.runtime.calibration_cache import CACHE_DIR_VARIABLE
from pipemlx.runtime.stage import stage_of
from pipemlx.testing import build_model, save_model_dir, tiny_config

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120
REPO, BROKEN, SINGLE = "some-org/some-model", "some-org/broken-model", "some-org/one-file-model"
PROMPT = "t5 t17 t3 t99 t42 t8 t61 t23 t7 t11"
FILES = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
RANK_FILES = {"0": {FILES[0], FILES[1], FILES[3]}, "1": {FILES[2], FILES[3]}}
# lend="auto" (the default) may cut inside the layer before a rank's first: that rank fetches its file too.
RANK_FILES_LENDING = {"0": RANK_FILES["0"], "1": RANK_FILES["1"] | {FILES[1]}}


pytestmark = pytest.mark.usefixtures("fake_groups_load_alone")  # conftest.py: FakeGroup loads skip the exchange


def _file_of(name: str) -> str:
    """Which of the 4 files holds tensor ``name``: embedding, layers 0-1, layers 2-3, norm and head."""
    if "embed_tokens" in name:
        return FILES[0]
    if ".layers." in name:
        return FILES[1] if int(name.split(".")[2]) < 2 else FILES[2]
    return FILES[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama as a Hub repo would hold it: 4 weight files and their index."""
    config = tiny_config("llama", num_hidden_layers=4)
    model = build_model(config, seed=3)
    root = save_model_dir(model, config, tmp_path_factory.mktemp("hub") / "some-model", index=False)
    (root / "model.safetensors").unlink()
    # bfloat16 as on the Hub: a rank that fetches no embedding must still compute in the checkpoint's dtype.
    weights: list[tuple[str, mx.array]] = [(k, v.astype(mx.bfloat16)) for k, v in tree_flatten(model.parameters())]  # type: ignore[misc]
    for file in FILES:
        mx.save_safetensors(
            str(root / file), {k: v for k, v in weights if _file_of(k) == file}, metadata={"format": "mlx"}
        )
    index = {
        "metadata": {"total_size": sum(v.nbytes for _, v in weights)},
        "weight_map": {k: _file_of(k) for k, _ in weights},
    }
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model as one ``model.safetensors`` without an index."""
    config = tiny_config("llama", num_hidden_layers=2)
    return save_model_dir(build_model(config), config, tmp_path_factory.mktemp("hub") / "one-file", index=False)


@pytest.fixture(scope="module")
def hub(model_dir: Path, single_dir: Path) -> Iterator[StandInHub]:
    """The stand-in Hub: the model, a broken copy whose third weight file is missing, a one-file model."""
    repos = {REPO: model_dir, BROKEN: model_dir, SINGLE: single_dir}
    with StandInHub(repos, hidden={BROKEN: {FILES[2]}}) as server:
        yield server


@pytest.fixture
def env(hub: StandInHub, tmp_path: Path) -> dict[str, str]:
    """The environment of a pipemlx process that reaches the stand-in Hub, with a fresh cache."""
    hub.clear()
    return {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        CACHE_DIR_VARIABLE: str(tmp_path / "pipemlx"),  # the ranks' weight folders and the headers read
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }


def pipemlx(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m pipemlx argv...``; on timeout interrupted (its launcher then kills every rank) and failed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipemlx", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher's finally kills its ranks
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"pipemlx {' '.join(argv)} timed out after {TIMEOUT} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def weight_requests(hub: StandInHub) -> dict[str | None, dict[str, set[str]]]:
    """Per rank (None: no rank), the weight files requested per method (``GET`` whole, ``RANGE``, ``HEAD``)."""
    seen: dict[str | None, dict[str, set[str]]] = {}
    for request in hub.requests():
        file = request.file()
        if file is None or file not in FILES:
            continue
        kind = "RANGE" if request.range else request.method
        seen.setdefault(request.rank(), {}).setdefault(kind, set()).add(file)
    return seen


def _span(text: str | None) -> tuple[int, int]:
    """``bytes=a-b`` as the byte range ``(a, b + 1)``."""
    first, _, last = (text or "").removeprefix("bytes=").partition("-")
    return int(first), int(last) + 1


def reference_tokens(model_dir: Path, step: int, max_tokens: int) -> list[int]:
    """Single-process mlx-lm on the same model folder, greedy."""
    loaded: Any = load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]
    return [
        r.token
        for r in stream_generate(model, tokenizer, PROMPT, max_tokens=max_tokens, prefill_step_size=step)
        if r.finish_reason != "stop"
    ]


def test_generate_by_repo_id_fetches_only_each_ranks_files_then_runs_offline(
    hub: StandInHub, env: dict[str, str], model_dir: Path
) -> None:
    argv = ["generate", "--model", REPO, "--ranks", "2", "--temp", "0", "--json", "--max-tokens", "8"]
    result = pipemlx(env, *argv, "--prompt", PROMPT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["split"] == [2, 2]
    assert report["tokens"] == reference_tokens(model_dir, report["largest_chunk"], 8)
    fetched = weight_requests(hub)
    assert None not in fetched, f"the launcher fetched weights: {fetched}"
    assert all(set(kinds) == {"RANGE"} for kinds in fetched.values()), f"whole files were requested: {fetched}"
    # Each rank's tensor bytes (headers aside): its own tensors, by range requests, within 1.1x of what it keeps: with
    # the default head ("auto", resolved from the config before fetching: "split" here), its rows of the vocabulary.
    held = FolderSource(model_dir)
    headers = held.headers()
    config = json.loads((model_dir / "config.json").read_text())
    for rank, files in RANK_FILES_LENDING.items():
        files = files | {FILES[0]}  # the embedding's file: every rank reads its rows of it (head="split")
        parts = rank_tensors(headers, config, (2, 2), int(rank), lend_mlp=int(rank) > 0, head="split")
        kept = sum(b - a for a, b in (p.byte_range(headers[p.name]) for p in parts))
        asked = [(r.file(), *_span(r.range)) for r in hub.requests() if r.rank() == rank and r.file() in FILES]
        data = [(f, a, b) for f, a, b in asked if a not in (0, 8)]  # 0-7 and 8-...: a file's header
        assert {f for f, _, _ in data} <= files, f"rank {rank} asked for other ranks' tensors: {data}"
        sent = sum(b - a for _, a, b in data)
        assert kept <= sent <= 1.1 * kept, (rank, sent, kept)

    hub.clear()
    offline = pipemlx({**env, "HF_HUB_OFFLINE": "1"}, *argv, "--prompt", PROMPT)
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout.strip().splitlines()[-1])["tokens"] == report["tokens"]
    assert [r for r in hub.requests() if "/api/agent-harnesses" not in r.path] == []


def test_split_sizes_a_repo_from_headers_without_fetching_weights_which_offline_use_needs(
    hub: StandInHub, env: dict[str, str], model_dir: Path, single_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for repo, folder, extra in (
        (REPO, model_dir, []),
        (REPO, model_dir, ["--context", "1k"]),
        (SINGLE, single_dir, []),
    ):
        argv = ["--ranks", "2", *extra]
        result = pipemlx(env, "split", repo, *argv)
        assert result.returncode == 0, result.stderr
        assert split_main([str(folder), *argv]) == 0
        assert result.stdout == capsys.readouterr().out
    single = [r for r in hub.requests() if r.file() == "model.safetensors"]
    assert single and all(r.range for r in single), single
    fetched = weight_requests(hub)
    assert set(fetched) == {None} and set(fetched[None]) == {"RANGE"}, fetched  # headers only, by range
    assert fetched[None]["RANGE"] == set(FILES)
    assert not list(Path(env["HF_HOME"]).rglob("model-*.safetensors"))
    # Offline, the local ranks would share this cache, which holds no weights: one line before any rank starts.
    offline = pipemlx({**env, "HF_HUB_OFFLINE": "1"}, "generate", "--model", REPO, "--ranks", "2")
    assert offline.returncode == 2
    assert offline.stderr.strip().splitlines() == [
        f"pipemlx generate: error: {FILES[0]} of {REPO!r} is not in the Hub cache and HF_HUB_OFFLINE is set: "
        "fetch it once online (or unset HF_HUB_OFFLINE)"
    ]


def test_a_missing_repo_or_file_is_one_line_and_status_2(env: dict[str, str]) -> None:
    result = pipemlx(env, "split", "some-org/no-such-model", "--ranks", "2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pipemlx split: 'some-org/no-such-model' is neither a local folder nor a model repo on the Hub "
        "(a private one needs hf auth login)"
    ]
    result = pipemlx(env, "generate", "--model", BROKEN, "--ranks", "2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"pipemlx generate: error: the Hub repo {BROKEN!r} (commit {StandInHub.commit(BROKEN)[:12]}) has no file "
        f"{FILES[2]}, which its model.safetensors.index.json names"
    ]


def test_every_rank_stops_with_the_same_line_on_a_missing_file(hub: StandInHub, env: dict[str, str]) -> None:
    """Started as ranks (as under mlx.launch), each rank checks the whole index: none waits in a collective."""
    command = [sys.executable, "-m", "pipemlx", "generate", "--model", BROKEN, "--temp", "0", "--max-tokens", "2"]
    results = launch(2, command, timeout=TIMEOUT, env=env, cwd=ROOT, fail_fast=False)
    lines = [r.stderr.strip().splitlines() for r in results]
    assert [r.returncode for r in results] == [2, 2], lines
    assert lines[0] == lines[1] and len(lines[0]) == 1 and f"has no file {FILES[2]}" in lines[0][0], lines
    assert weight_requests(hub) == {}


def test_rank_files_follow_what_each_rank_keeps(model_dir: Path) -> None:
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    source = ModelSource(model_dir, REPO, "0" * 40, weight_map, tuple(FILES))
    assert set(needed_files(source, (2, 2), 0)) == RANK_FILES["0"]
    assert set(needed_files(source, (2, 2), 1)) == RANK_FILES["1"]
    # lend_mlp: rank 1 runs the feed-forward half of rank 0's last layer (layer 1).
    assert set(needed_files(source, (2, 2), 1, lend_mlp=True)) == {FILES[1], FILES[2], FILES[3]}
    # head="last": rank 0 keeps no output head; the norm shares its file, which rank 0 still needs.
    assert set(needed_files(source, (2, 2), 0, head="last")) == RANK_FILES["0"]
    assert set(needed_files(source, (3, 1), 1)) == RANK_FILES["1"]
    assert set(needed_files(source, (1, 3), 1)) == {FILES[1], FILES[2], FILES[3]}
    # A tied model's embedding is its head: every rank that keeps the head needs it.
    untied = {k: v for k, v in weight_map.items() if not k.startswith("lm_head.")}
    tied = ModelSource(model_dir, REPO, "0" * 40, untied, tuple(FILES))
    assert set(rank_files(tied, range(2, 4), keep_embedding=False, keep_head=True)) == {FILES[0], FILES[2], FILES[3]}
    assert set(rank_files(tied, range(2, 4), keep_embedding=False, keep_head=False)) == {FILES[2], FILES[3]}
    # The output head in a file of its own: head="last" gives it to the last rank alone, "all" to every rank.
    own = {k: "head.safetensors" if k.startswith("lm_head.") else v for k, v in weight_map.items()}
    apart = ModelSource(model_dir, REPO, "0" * 40, own, (*FILES, "head.safetensors"))
    assert "head.safetensors" in needed_files(apart, (2, 2), 1, head="last")
    assert "head.safetensors" not in needed_files(apart, (2, 2), 0, head="last")
    assert all("head.safetensors" in needed_files(apart, (2, 2), r) for r in (0, 1))
    # head="split": every rank holds rows of the embedding and of the head, so every rank needs both files.
    embedding_file = weight_map["model.embed_tokens.weight"]
    for r in (0, 1):
        assert {"head.safetensors", embedding_file} <= set(needed_files(apart, (2, 2), r, head="split"))
    assert embedding_file not in needed_files(apart, (2, 2), 1)  # without the split, rank 1 needs no embedding


@dataclass(frozen=True)
class RemoteFolder(FolderSource):
    """A model folder read as a remote source is: by byte ranges into a rank's weight folder."""

    @property
    def local(self) -> bool:
        return False


def test_a_rank_loads_from_its_tensors_alone_in_the_checkpoints_dtype(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2 with only its tensors (no embedding): its stand-in embedding has the checkpoint's dtype."""
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    source = RemoteFolder(model_dir, REPO, tuple(FILES))
    fetched: list[set[str]] = []
    fetch = loading.fetch_rank_folder

    def counted(s: Any, parts: Any, **k: Any) -> Path:
        fetched.append({p.name for p in parts})
        return fetch(s, parts, **k)

    monkeypatch.setattr(loading, "resolve_source", lambda *a, **k: source)  # pyright: ignore[reportUnknownLambdaType]
    monkeypatch.setattr(loading, "fetch_rank_folder", counted)
    model, _ = loading.load_sharded(REPO, FakeGroup(1, 2), lend="none", head="all")  # "split" fetches its rows
    assert len(fetched) == 1 and {_file_of(n) for n in fetched[0]} == RANK_FILES["1"]
    assert not any("embed_tokens" in n for n in fetched[0]) and any(".layers.3." in n for n in fetched[0])
    stand_in = getattr(model, "model").embed_tokens
    assert isinstance(stand_in, EmbeddingStandIn) and stand_in(mx.array([1])).dtype == mx.bfloat16
    whole: Any = load(str(model_dir))
    expected = dict(tree_flatten(whole[0].model.layers[2].parameters()))
    for name, value in tree_flatten(getattr(model, "model").layers[0].parameters()):
        assert mx.array_equal(value, expected[name]).item(), name


@pytest.mark.parametrize(
    "plan",
    [
        {"memory": [3e6, 1e6]},
        {"memory": ["24MB", "11.2MB"], "context": 2048},
        {"split": "balanced", "speeds": [3.0, 1.0]},
    ],
)
def test_a_planned_split_is_planned_from_the_headers_before_fetching(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: dict[str, Any]
) -> None:
    """A memory split (or a balanced one with given speeds) of a remote model: the split a whole-folder load
    plans, decided from the headers, then only the tensors it needs."""
    monkeypatch.setenv(CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    source = RemoteFolder(model_dir, REPO, tuple(FILES))
    config = json.loads((model_dir / "config.json").read_text())
    fetched: list[set[str]] = []
    fetch = loading.fetch_rank_folder

    def counted(s: Any, parts: Any, **k: Any) -> Path:
        fetched.append({p.name for p in parts})
        return fetch(s, parts, **k)

    monkeypatch.setattr(loading, "fetch_rank_folder", counted)
    for rank in range(2):
        local, _ = loading.load_sharded(model_dir, FakeGroup(rank, 2), lend="none", **plan)
        with monkeypatch.context() as patched:
            patched.setattr(loading, "resolve_source", lambda *a, **k: source)  # pyright: ignore[reportUnknownLambdaType]
            remote, _ = loading.load_sharded(REPO, FakeGroup(rank, 2), lend="none", **plan)
        split = stage_of(local).info.split
        assert stage_of(remote).info.split == split and split != (2, 2), split
        # The default head ("auto": "split" on this model, decided before the plan and the fetch): every rank's rows.
        assert stage_of(remote).info.head == stage_of(local).info.head == "split"
        assert fetched[-1] == {p.name for p in rank_tensors(source.headers(), config, split, rank, head="split")}
    assert fetched[0] != fetched[1]


def _hostfile_ranks(
    tmp_path: Path, hubs: list[StandInHub], argv: list[str]
) -> tuple[list[subprocess.Popen[str]], list[dict[str, str]]]:
    """``pipemlx generate --hostfile`` as 2 processes on loopback, each with its own Hub and its own cache (two
    hosts that download apart); returns the processes."""
    from pipemlx.launch import free_ports

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    envs = [
        {
            **os.environ,
            "HF_ENDPOINT": hubs[r].url,
            "HF_HOME": str(tmp_path / f"hf{r}"),
            CACHE_DIR_VARIABLE: str(tmp_path / f"pipemlx{r}"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        }
        for r in range(2)
    ]
    command = [sys.executable, "-m", "pipemlx", "generate", "--hostfile", str(hostfile), *argv]
    procs = [
        subprocess.Popen(
            [*command, "--rank", str(r)],
            cwd=ROOT,
            env=envs[r],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    return procs, envs


def _finish(procs: list[subprocess.Popen[str]], deadline: float) -> list[tuple[int | None, str, str]]:
    """Every rank's status, stdout and stderr, killing any still running after ``deadline`` seconds."""
    import time

    end = time.monotonic() + deadline
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        p.kill()
    return [(p.returncode, *p.communicate()) for p in procs]


@pytest.mark.slow  # about 27 s (the suite's 15-minute budget): bash tests/run_slow.sh runs it
def test_a_download_slower_than_the_timeout_is_waited_for_while_it_progresses(model_dir: Path, tmp_path: Path) -> None:
    """Rank 1's Hub answers every request a second late: its files arrive over more than twice ``--timeout``;
    rank 0, with a fast Hub, waits for it (no timeout in the first collective) and both give mlx-lm's tokens."""
    timeout, argv = 3.0, ["--model", REPO, "--temp", "0", "--json", "--max-tokens", "6", "--prompt", PROMPT]
    with StandInHub({REPO: model_dir}) as fast, StandInHub({REPO: model_dir}, delay=1.0) as slow:
        procs, _ = _hostfile_ranks(tmp_path, [fast, slow], [*argv, "--timeout", str(timeout)])
        results = _finish(procs, TIMEOUT)
        log = slow.requests()
    stderr = "\n".join(f"--- rank {r} (status {code}):\n{err[-3000:]}" for r, (code, _, err) in enumerate(results))
    assert [code for code, _, _ in results] == [0, 0], stderr
    span = log[-1].at - log[0].at
    assert span > 2 * timeout, f"rank 1's downloads took {span:.1f} s, not more than twice the timeout"
    report = json.loads(results[0][1].strip().splitlines()[-1])
    assert report["tokens"] == reference_tokens(model_dir, report["largest_chunk"], 6)
    assert "waits for rank 1" in results[0][2], results[0][2]  # rank 0 said whom it waited for


def test_a_rank_killed_while_downloading_ends_every_rank_with_a_clear_error(model_dir: Path, tmp_path: Path) -> None:
    import time

    argv = ["--model", REPO, "--temp", "0", "--max-tokens", "4", "--prompt", PROMPT, "--timeout", "5"]
    with StandInHub({REPO: model_dir}) as fast, StandInHub({REPO: model_dir}) as slow:
        slow.weight_delay = 30.0  # rank 1's weight files hang: it is still downloading when it is killed
        procs, _ = _hostfile_ranks(tmp_path, [fast, slow], argv)
        deadline = time.monotonic() + 60
        while not any(r.file() in FILES and r.method == "GET" for r in slow.requests()) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.5)
        procs[1].kill()  # rank 1 dies while it downloads its weights
        killed = time.monotonic()
        results = _finish(procs[:1], 60)
        took = time.monotonic() - killed
        slow.weight_delay = 0.0
    code, _, err = results[0]
    assert code == 1, f"status {code}:\n{err}"  # a clean exit after the error, not an abort in MLX teardown
    assert "rank 0" in err and ("PeerLostError" in err or "rank 1" in err), f"status {code}:\n{err}"
    assert took < 30, f"rank 0 took {took:.0f} s to notice"
