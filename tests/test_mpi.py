"""The pipeline under MLX's MPI backend, ranks started by Open MPI's ``mpirun`` (as on a cluster).

``mpirun -np S python tests/ranks/equivalence.py SPEC`` with ``PIPEMLX_BACKEND=mpi``:
every rank must match single-device mlx-lm. ``mpirun`` runs under a hard wall-clock
bound; on a timeout it and every rank it started are killed and each rank's output
is shown. Skips, naming the reason, when Open MPI is not installed (tests/run.sh
installs it where apt-get works).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from test_equivalence import check_reports
from test_multihost import scenario

RANKS_DIR = Path(__file__).parent / "ranks"
# Open MPI's shared-memory transport copies with process_vm_readv, which container sandboxes often forbid.
MPI_OPTIONS = ("--allow-run-as-root", "--oversubscribe", "--mca", "btl_vader_single_copy_mechanism", "none")


def mpi_setup() -> tuple[str, dict[str, str]] | str:
    """``(mpirun path, extra environment)``, or why MLX's MPI backend cannot run here."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "mpirun is not installed (tests/run.sh installs openmpi-bin libopenmpi-dev where apt-get works)"
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "Open MPI" not in version:
        return f"MLX's MPI backend needs Open MPI; {mpirun} is {version.strip()[:80]!r}"
    try:
        ctypes.CDLL("libmpi.so")  # the name MLX opens unless MLX_MPI_LIBNAME says otherwise
        return mpirun, {}
    except OSError:
        versioned = ctypes.util.find_library("mpi")  # e.g. libmpi.so.40 without the -dev package's link
        if versioned is None:
            return "libmpi is not installed (apt-get install libopenmpi-dev)"
        return mpirun, {"MLX_MPI_LIBNAME": versioned}


def require_mpi() -> tuple[str, dict[str, str]]:
    """:func:`mpi_setup`, or skip the test naming why, or fail it under ``PIPEMLX_REQUIRE_HOSTS=1`` (CI)."""
    setup = mpi_setup()
    if isinstance(setup, str):
        if os.environ.get("PIPEMLX_REQUIRE_HOSTS") == "1":
            pytest.fail(f"PIPEMLX_REQUIRE_HOSTS=1 but MPI is unavailable: {setup}")
        pytest.skip(f"MPI unavailable: {setup}")
    return setup


@pytest.fixture
def mpi() -> tuple[str, dict[str, str]]:
    return require_mpi()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def rank_output(directory: Path, rank: int, stream: str) -> str:
    """What rank ``rank`` wrote to ``stream``, from ``mpirun --output-filename directory``."""
    return "".join(f.read_text(errors="replace") for f in sorted(directory.glob(f"*/rank.{rank}/{stream}")))


def run_mpi(
    mpi: tuple[str, dict[str, str]], num_ranks: int, program: str, spec: dict[str, Any], timeout: float
) -> list[dict[str, Any]]:
    """``mpirun -np num_ranks python tests/ranks/<program> SPEC``; each rank's last JSON stdout line.

    Fails the test, with each rank's stdout and stderr, when mpirun fails or
    ``timeout`` seconds pass (then mpirun and every process below it are killed).
    """
    mpirun, extra_env = mpi
    with tempfile.TemporaryDirectory(prefix="pipemlx-mpi-") as tmp:
        ranks_dir = Path(tmp) / "ranks"
        command = [
            mpirun, *MPI_OPTIONS, "--output-filename", str(ranks_dir), "-np", str(num_ranks),
            sys.executable, str(RANKS_DIR / program), json.dumps(spec),
        ]  # fmt: skip
        env = {**os.environ, **extra_env, "PIPEMLX_BACKEND": "mpi", "PYTHONUNBUFFERED": "1"}
        with open(Path(tmp) / "mpirun.out", "w+") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout)
                failure = None if proc.returncode == 0 else f"mpirun exited with status {proc.returncode}"
            except subprocess.TimeoutExpired:
                failure = f"timed out after {timeout:g} s; killed mpirun and every rank"
            finally:
                for pid in [*descendants(proc.pid), proc.pid]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait()
            out.seek(0)
            own = out.read()
        stdouts = [rank_output(ranks_dir, r, "stdout") for r in range(num_ranks)]
        stderrs = [rank_output(ranks_dir, r, "stderr") for r in range(num_ranks)]
    if failure is not None:
        shown = "\n".join(
            f"--- rank {r} stdout:\n{stdouts[r][-1000:]}\n--- stderr:\n{stderrs[r][-4000:] or '(empty)'}"
            for r in range(num_ranks)
        )
        pytest.fail(
            f"{program} under mpirun -np {num_ranks}: {failure}\n{shown}\n--- mpirun:\n{own[-3000:]}", pytrace=False
        )
    reports: list[dict[str, Any]] = []
    for rank in range(num_ranks):
        lines = [line for line in stdouts[rank].splitlines() if line.startswith("{")]
        assert lines, f"rank {rank} printed no report; stderr:\n{stderrs[rank][-4000:]}"
        reports.append(json.loads(lines[-1]))
    return reports


@pytest.mark.parametrize(
    "num_ranks,arch", [(2, "qwen3"), pytest.param(3, "llama", marks=pytest.mark.slow)]
)  # the suite's time budget: run with -m slow
def test_pipeline_matches_single_device_under_mpi(mpi: tuple[str, dict[str, str]], num_ranks: int, arch: str) -> None:
    spec = {"arch": arch, "seed": 4, "max_tokens": 6, "steps": scenario()}
    reports = run_mpi(mpi, num_ranks, "equivalence.py", spec, timeout=180)
    assert [r["size"] for r in reports] == [num_ranks] * num_ranks
    assert check_reports(reports, num_ranks) == num_ranks * (len(scenario()) - 1)


def test_mpirun_timeout_kills_every_rank(mpi: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    """The hard bound works: ranks that never finish are killed, and the failure shows their output."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(
        "import os, sys, time\nprint('pid', os.getpid(), file=sys.stderr, flush=True)\ntime.sleep(600)\n"
    )
    with pytest.raises(pytest.fail.Exception, match="timed out after 6 s") as failed:
        run_mpi(mpi, 2, str(sleeper), {}, timeout=6)
    message = str(failed.value)
    pids = sorted({int(p) for p in re.findall(r"pid (\d+)", message)})
    assert len(pids) == 2, message
    assert not [pid for pid in pids if running(pid)], f"ranks {pids} outlived the timeout"


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
