"""Packaging: ``python -m build`` makes a wheel and an sdist, and the wheel works on its own.

The wheel is installed into a fresh venv (``--system-site-packages`` so that MLX and mlx-lm need not be
downloaded again; ``pip install --no-deps`` so that pipemlx itself comes from the wheel, not from this
checkout), and ``pipemlx generate --ranks 2`` runs from that venv's ``bin`` in a folder outside the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT = 480
RUN_TIMEOUT = 240


@pytest.mark.timeout(BUILD_TIMEOUT + 2 * RUN_TIMEOUT)
def test_the_wheel_installs_and_generates(tmp_path: Path) -> None:
    pytest.importorskip("build", reason="the build package (pipemlx[test]) is not installed")
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("pipemlx-*.whl")
    (sdist,) = dist.glob("pipemlx-*.tar.gz")

    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "pipemlx/py.typed",
        "pipemlx/demo/prompt.txt",
        "pipemlx/demo/model/config.json",
        "pipemlx/demo/model/model.safetensors",
        "pipemlx/demo/model/tokenizer.json",
        "pipemlx/runtime/prefill.py",
        "pipemlx/cli/__init__.py",
    ):
        assert required in names, f"{required} is not in {wheel.name}"
    with tarfile.open(sdist) as archive:
        assert any(n.endswith("pipemlx/demo/model/model.safetensors") for n in archive.getnames())

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert installed.returncode == 0, installed.stderr

    elsewhere = tmp_path / "elsewhere"  # not the checkout: nothing may be imported from there
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
    assert where.returncode == 0, where.stderr
    location = Path(where.stdout.strip()).resolve()
    assert location.is_relative_to(env_dir.resolve()), f"pipemlx was imported from {location}, not the venv"

    result = subprocess.run(
        [str(bin_dir / "pipemlx"), "generate", "--ranks", "2", "--max-tokens", "5"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=elsewhere,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no generated text"
    assert "layers 0-3" in result.stderr and "layers 4-7" in result.stderr and "Traceback" not in result.stderr
