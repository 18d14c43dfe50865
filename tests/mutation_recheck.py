"""Check mutants again, one plain pytest run each: ``python tests/mutation_recheck.py TESTS... -- NAMES...``.

Run from the repository root after ``tests/mutate.sh`` made ``mutants/``: the current ``tests/`` is copied into
``mutants/tests``, then for each mutant ``pytest -x TESTS`` runs in ``mutants/`` with ``MUTANT_UNDER_TEST`` set
to its name, and its result is written back into mutmut's results (``mutation_score.py`` reports them): a test
failing kills it. ``tests/mutate.sh --survivors`` uses it, after tests were added, with the test files of
``MUTATE_TESTS`` (default: the selection of ``[tool.mutmut]``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def main(tests: list[str], names: list[str]) -> None:
    shutil.copytree("tests", "mutants/tests", dirs_exist_ok=True)
    for name in names:
        module = name.split(".x", 1)[0] if ".x_" in name else name.rsplit(".x\u01c1", 1)[0]
        meta = Path("mutants") / (module.replace(".", "/") + ".py.meta")
        environment = {
            **os.environ,
            "MUTANT_UNDER_TEST": name,
            "PYTHONPATH": str(Path("mutants").resolve()),
            "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "mutate"),
        }
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *tests]
        done = subprocess.run(command, cwd="mutants", env=environment, capture_output=True, timeout=600)
        code = 0 if done.returncode == 0 else 1
        data = json.loads(meta.read_text())  # read again: other rechecks may write the same file meanwhile
        data["exit_code_by_key"][name] = code
        meta.write_text(json.dumps(data))
        print(("survived " if code == 0 else "killed   ") + name, flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    split = arguments.index("--")
    main(arguments[:split], arguments[split + 1 :])
