"""Packaging: ``python -m build`` makes a wheel and an sdist, and the wheel works on its own.

The wheel is installed into a fresh venv (``--system-site-packages`` so that MLX and mlx-lm need not be
downloaded again; ``pip install --no-deps`` so that pipemlx itself comes from the wheel, not from this
checkout), and ``pipemlx generate --ranks 2`` runs from that venv's ``bin`` in a folder outside the checkout:
the session's one demo run (``demo_run`` in tests/conftest.py), whose text must be single-process mlx-lm's
(tests/test_cli.py checks the same run's progress bar and summary).
"""

from __future__ import annotations

import tarfile
import zipfile

import pytest
from conftest import DEMO_RUN_TIMEOUT, DemoRun, check_demo_run


@pytest.mark.timeout(DEMO_RUN_TIMEOUT)
def test_the_wheel_installs_and_generates_mlx_lms_text(demo_run: DemoRun) -> None:
    failed = demo_run.wheel_failure
    assert failed is None, f"{failed.why}:\n{failed.stdout}\n{failed.stderr}"
    if demo_run.source != "wheel":
        pytest.skip(f"no wheel: {demo_run.why}")
    assert demo_run.wheel is not None and demo_run.sdist is not None and demo_run.venv is not None
    names = set(zipfile.ZipFile(demo_run.wheel).namelist())
    for required in (
        "pipemlx/py.typed",
        "pipemlx/demo/prompt.txt",
        "pipemlx/demo/model/config.json",
        "pipemlx/demo/model/model.safetensors",
        "pipemlx/demo/model/tokenizer.json",
        "pipemlx/runtime/prefill.py",
        "pipemlx/cli/__init__.py",
    ):
        assert required in names, f"{required} is not in {demo_run.wheel.name}"
    with tarfile.open(demo_run.sdist) as archive:
        assert any(n.endswith("pipemlx/demo/model/model.safetensors") for n in archive.getnames())
    location = demo_run.imported_from
    assert location is not None and location.is_relative_to(demo_run.venv.resolve()), (
        f"pipemlx was imported from {location}, not the venv"
    )
    check_demo_run(demo_run)
