"""Check mutants again, one plain pytest run each: ``python tests/mutation_recheck.py TESTS... -- NAMES...``.

Run from the repository root after ``tests/mutate.sh`` made ``mutants/``: the current ``tests/`` is copied into
``mutants/tests`` (and the documents some tests read, :data:`DOCUMENTS`), then for each mutant ``pytest -x TESTS``
runs in ``mutants/`` with ``MUTANT_UNDER_TEST`` set to its name, and its result is written back into mutmut's
results (``mutation_score.py`` reports them): a test failing kills it. ``tests/mutate.sh --survivors`` uses it,
after tests were added, with the test files of ``MUTATE_TESTS`` (default: the selection of ``[tool.mutmut]``).

``MUTATE_IN_PROCESS=1``: every mutant's pytest run in this one process (``pytest.main`` again and again, the
mutant chosen by ``MUTANT_UNDER_TEST``, which mutmut's trampolines read at each call): no interpreter, MLX and test
collection start-up per mutant, for a loaded machine. Module-level state of the tests is shared between the runs,
and a mutant applied at import time (a module-level call of the mutated function) is not seen: check those without
it. ``MUTATE_TIMEOUT_S`` (default 60) bounds each mutant's run (a timeout kills it, as in mutmut).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def record(name: str, code: int, root: Path) -> None:
    """Write mutant ``name``'s result (0: survived, 1: killed) into mutmut's results (``root/...py.meta``)."""
    module = name.split(".x", 1)[0] if ".x_" in name else name.rsplit(".x\u01c1", 1)[0]
    meta = root / (module.replace(".", "/") + ".py.meta")
    data = json.loads(meta.read_text())  # read again: other rechecks may write the same file meanwhile
    data["exit_code_by_key"][name] = code
    meta.write_text(json.dumps(data))
    print(("survived " if code == 0 else "killed   ") + name, flush=True)


def in_process(tests: list[str], names: list[str]) -> None:
    """Every mutant's pytest run in this process, from inside ``mutants/`` (its package shadows the real one)."""
    os.chdir("mutants")
    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("HYPOTHESIS_PROFILE", "mutate")
    import pytest

    def too_long(signum: int, frame: object) -> None:
        raise TimeoutError("the mutant's tests ran past MUTATE_TIMEOUT_S")  # fails the test: killed, as mutmut's

    signal.signal(signal.SIGALRM, too_long)
    for name in names:
        os.environ["MUTANT_UNDER_TEST"] = name
        signal.alarm(int(os.environ.get("MUTATE_TIMEOUT_S", "60")))  # a mutated loop may never end
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                code = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *tests])
        except TimeoutError:
            code = 1
        finally:
            signal.alarm(0)
        record(name, 0 if code == 0 else 1, Path("."))


DOCUMENTS = ("docs", "examples", "benchmarks", "README.md", "CHANGELOG.md")
"""Copied into ``mutants/`` beside the tests: test_docs.py and test_planning_doc.py read them."""


def main(tests: list[str], names: list[str]) -> None:
    shutil.copytree("tests", "mutants/tests", dirs_exist_ok=True)
    for path in map(Path, DOCUMENTS):
        if path.is_dir():
            shutil.copytree(path, "mutants" / path, dirs_exist_ok=True)
        elif path.exists():
            shutil.copy(path, "mutants" / path)
    if os.environ.get("MUTATE_IN_PROCESS") == "1":
        in_process(tests, names)
        return
    for name in names:
        environment = {
            **os.environ,
            "MUTANT_UNDER_TEST": name,
            "PYTHONPATH": str(Path("mutants").resolve()),
            "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "mutate"),
        }
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *tests]
        done = subprocess.run(command, cwd="mutants", env=environment, capture_output=True, timeout=600)
        record(name, 0 if done.returncode == 0 else 1, Path("mutants"))


if __name__ == "__main__":
    arguments = sys.argv[1:]
    split = arguments.index("--")
    main(arguments[:split], arguments[split + 1 :])
