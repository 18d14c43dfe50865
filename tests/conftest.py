"""Shared helpers: run a rank program on N local ranks and collect each rank's JSON report; the demo run."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis_profiles  # noqa: F401  (loads the hypothesis profile before any test module is collected)
import pytest

from pipemlx.launch import LaunchError, launch
from pipemlx.runtime.calibration_cache import CACHE_DIR_VARIABLE

RANKS_DIR = Path(__file__).parent / "ranks"


@pytest.fixture(scope="session", autouse=True)
def calibration_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One calibration cache for the whole session (the rank programs inherit it): "auto" (the default step and
    lending) calibrates once per configuration, not once per test, and nothing is written to the user's cache."""
    folder = tmp_path_factory.mktemp("calibration-cache")
    previous = os.environ.get(CACHE_DIR_VARIABLE)
    os.environ[CACHE_DIR_VARIABLE] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(CACHE_DIR_VARIABLE, None)
    else:
        os.environ[CACHE_DIR_VARIABLE] = previous


def run_ranks(
    num_ranks: int,
    program: str,
    spec: dict[str, Any],
    timeout: float = 120.0,
    expect_exit: dict[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Run ``tests/ranks/<program>`` on ``num_ranks`` ranks; return each rank's last stdout line as JSON.

    Every rank is killed when one fails or ``timeout`` passes, and the test
    fails with every rank's stderr. ``expect_exit`` maps ranks that are meant
    to die (fault injection) to their exit status: then no rank is killed
    early, those ranks' statuses are checked and they owe no report (``{}``).
    """
    command = [sys.executable, str(RANKS_DIR / program), json.dumps(spec)]
    expected = expect_exit or {}
    try:
        results = launch(num_ranks, command, timeout=timeout, fail_fast=not expected)
    except LaunchError as exc:
        pytest.fail(f"{program} on {num_ranks} ranks failed: {exc}", pytrace=False)
    reports: list[dict[str, Any]] = []
    for r in results:
        if r.rank in expected:
            assert r.returncode == expected[r.rank], f"rank {r.rank} exited {r.returncode}; stderr:\n{r.stderr}"
            reports.append({})
            continue
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}; stderr:\n{r.stderr[-4000:]}"
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        assert lines, f"rank {r.rank} printed no report; stderr:\n{r.stderr}"
        reports.append(json.loads(lines[-1]))
    return reports


# --- the demo run: `pipemlx generate --ranks 2` on the demo model, once per session -------------------------------

ROOT = Path(__file__).resolve().parent.parent
DEMO_MAX_TOKENS = 20
BUILD_TIMEOUT = 480
RUN_TIMEOUT = 240
DEMO_RUN_TIMEOUT = BUILD_TIMEOUT + 3 * RUN_TIMEOUT  # for a test that may be the first to ask for demo_run


@dataclass
class DemoRun:
    """One ``pipemlx generate --ranks 2 --max-tokens 20`` (its defaults: greedy, the auto step, lend="auto") and its output.

    ``source`` is ``"wheel"`` when the command came from the wheel built from this checkout and installed in a
    fresh venv (then ``wheel``, ``sdist`` and ``imported_from`` are set), else ``"checkout"`` (``python -m pipemlx``
    here; ``why`` says why not the wheel).
    """

    source: str
    returncode: int
    stdout: str
    stderr: str
    why: str = ""
    wheel: Path | None = None
    sdist: Path | None = None
    venv: Path | None = None
    imported_from: Path | None = None
    wheel_failure: DemoRun | None = None  # the wheel's build, install or import that failed (then run from here)


def _install_wheel(tmp: Path) -> tuple[DemoRun | str, list[str], dict[str, str], Path]:
    """Build the wheel and sdist, install the wheel in a fresh venv; ``(partial run or why not, argv, env, cwd)``."""
    import importlib.util
    import os
    import subprocess
    import venv

    if importlib.util.find_spec("build") is None:
        return "the build package (pipemlx[test]) is not installed", [], {}, ROOT
    dist = tmp / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    if built.returncode != 0:
        return (
            DemoRun("wheel", built.returncode, built.stdout[-3000:], built.stderr[-3000:], "build failed"),
            [],
            {},
            ROOT,
        )
    (wheel,) = dist.glob("pipemlx-*.whl")
    (sdist,) = dist.glob("pipemlx-*.tar.gz")
    # --system-site-packages: MLX and mlx-lm need not be downloaded again; --no-deps: pipemlx comes from the wheel
    env_dir = tmp / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--force-reinstall", str(wheel)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    partial = DemoRun("wheel", installed.returncode, "", installed.stderr, "", wheel, sdist, env_dir)
    if installed.returncode != 0:
        partial.why = "pip install failed"
        return partial, [], {}, ROOT
    elsewhere = tmp / "elsewhere"  # not the checkout: nothing may be imported from there
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    where = subprocess.run(
        [str(python), "-c", "import pipemlx; print(pipemlx.__file__)"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=elsewhere,
        env=env,
    )
    partial.imported_from = Path(where.stdout.strip()).resolve() if where.returncode == 0 else None
    if partial.imported_from is None:
        partial.why, partial.stderr = "import pipemlx failed in the venv", where.stderr
    return partial, [str(bin_dir / "pipemlx")], env, elsewhere


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """``pipemlx generate --ranks 2 --max-tokens 20`` run once for the session, from the installed wheel when it can
    be built (tests/test_wheel.py), else from the checkout; tests/test_cli.py checks its text against mlx-lm's."""
    import os
    import signal
    import subprocess

    prepared, argv, env, cwd = _install_wheel(tmp_path_factory.mktemp("wheel"))
    failed: DemoRun | None = None
    if isinstance(prepared, DemoRun) and (prepared.returncode != 0 or prepared.imported_from is None):
        failed, prepared = prepared, f"the wheel failed: {prepared.why}"  # tests/test_wheel.py fails on it
    if isinstance(prepared, str):
        argv, env, cwd = [sys.executable, "-m", "pipemlx"], {}, ROOT
    # its own process group: on a timeout the command and both ranks it started are killed, and the test shows
    # what they printed (rank 0's stderr, where the ranks' errors end up)
    proc = subprocess.Popen(
        [*argv, "generate", "--ranks", "2", "--max-tokens", str(DEMO_MAX_TOKENS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env or None,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed with its ranks after {RUN_TIMEOUT} s)"
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if isinstance(prepared, str):
        return DemoRun("checkout", result.returncode, result.stdout, result.stderr, prepared, wheel_failure=failed)
    prepared.returncode, prepared.stdout, prepared.stderr = result.returncode, result.stdout, result.stderr
    return prepared


def demo_prompt_tokens(prompt: str) -> list[int]:
    """``prompt`` as ``mlx_lm.generate`` encodes it for the demo model: in the model's chat template (it ships one)."""
    from mlx_lm.utils import load_tokenizer

    from pipemlx.demo import MODEL_DIR

    tokenizer = load_tokenizer(MODEL_DIR)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def demo_reference_tokens(prompt: str, step_size: int, max_tokens: int, temp: float = 0.0, seed: int = 0) -> list[int]:
    """Single-process mlx-lm on the demo model, the prompt built as ``mlx_lm.generate`` builds it: the tokens
    stream_generate yields (up to end of text)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    from pipemlx.demo import MODEL_DIR

    model, tokenizer = load(str(MODEL_DIR))
    tokens: list[int] = []
    mx.random.seed(seed)
    for response in stream_generate(
        model,
        tokenizer,
        demo_prompt_tokens(prompt),
        max_tokens=max_tokens,
        prefill_step_size=step_size,
        sampler=make_sampler(temp),
    ):
        if response.finish_reason != "stop":
            tokens.append(response.token)
    return tokens


def check_demo_run(run: DemoRun) -> None:
    """The demo run streamed single-process mlx-lm's text (greedy) and named each rank's layers."""
    from mlx_lm.utils import load

    from pipemlx.demo import MODEL_DIR, default_prompt

    assert run.returncode == 0, f"{run.source} ({run.why}): {run.stderr[-4000:]}"
    _, tokenizer = load(str(MODEL_DIR))
    prompt_tokens = len(demo_prompt_tokens(default_prompt()))
    expected = demo_reference_tokens(default_prompt(), 512, DEMO_MAX_TOKENS)  # greedy, as pipemlx generate's default
    assert len(set(expected)) > 2, expected
    assert run.stdout == tokenizer.decode(expected) + "\n"
    err = run.stderr
    assert f"prompt {prompt_tokens} tokens, prefill step auto" in err
    assert f"{prompt_tokens - 1}/{prompt_tokens - 1}" in err and "tok/s" in err  # the progress bar's last state
    assert "layers 0-3" in err and "layers 4-7" in err and "peak memory" in err
    assert "Traceback" not in err


@pytest.fixture
def fake_groups_load_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_sharded on a FakeGroup (this process alone) skips the ranks' progress exchange, which needs a real group
    (the exchange itself: tests/test_hub.py's two-host download tests)."""
    from fakes import load_without_exchange

    from pipemlx.models import loading

    monkeypatch.setattr(loading, "while_ranks_load", load_without_exchange)
    # ... and the all-gather of who has the model (pipemlx/models/peer.py): every FakeGroup rank has it or none does
    from pipemlx.models.peer import Sharing

    monkeypatch.setattr(loading, "share_model", lambda *a, **k: contextlib.nullcontext(Sharing(None, True)))  # pyright: ignore[reportUnknownLambdaType]
