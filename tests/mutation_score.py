"""Mutation score per module from mutmut's results in ``mutants/`` (``tests/mutate.sh`` prints it at the end).

``python tests/mutation_score.py ['pipemlx.runtime.stops.*' ...]``: for each module (only those the patterns
match, if given), mutants killed / checked, then every survivor's name (``mutmut show NAME`` prints its diff).
With ``--names`` first: only the names of the mutants not killed (survived or run by no test), one a line, for
``tests/mutate.sh --survivors`` to check again after tests were added.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 36, 24, -24, 152, 255, 37}  # test failures, pytest internal errors, timeouts, type-check catches
UNCHECKED = {None, 2}  # not run yet, or interrupted


def main(patterns: list[str], names_only: bool = False) -> None:
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        module = str(meta.relative_to("mutants"))[: -len(".py.meta")].replace("/", ".")
        codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
        if patterns:
            codes = {k: v for k, v in codes.items() if any(fnmatch.fnmatch(k, p) for p in patterns)}
        checked = {k: v for k, v in codes.items() if v not in UNCHECKED}
        if names_only:
            for name in (k for k, v in sorted(checked.items()) if v not in KILLED):
                print(name)
            continue
        if not checked:
            continue
        counts = Counter(
            "killed" if v in KILLED else "no tests" if v in (5, 33) else "survived" for v in checked.values()
        )
        total = len(checked)
        print(
            f"{module}: {counts['killed']}/{total} killed ({100 * counts['killed'] / total:.0f}%), "
            f"{counts['survived']} survived, {counts['no tests']} not run by any test, "
            f"{len(codes) - total} not checked"
        )
        for name, code in sorted(checked.items()):
            if code not in KILLED:
                print(f"    {'no tests' if code in (5, 33) else 'survived'}: {name}")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    names = arguments[:1] == ["--names"]
    main(arguments[names:], names)
