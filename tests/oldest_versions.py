"""Print pip requirements pinning mlx and mlx-lm to the lower bounds pyproject.toml declares for this platform.

tests/run.sh installs them, so the suite (and CI) runs on exactly the oldest versions the package admits.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PINNED = ("mlx", "mlx-lm")


def main() -> None:
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    pins: list[str] = []
    for dependency in project["dependencies"]:
        spec, _, marker = dependency.partition(";")
        platform = re.search(r"sys_platform\s*(==|!=)\s*'(\w+)'", marker)
        if platform and (sys.platform == platform.group(2)) != (platform.group(1) == "=="):
            continue
        match = re.fullmatch(r"\s*([\w-]+)(\[\w+\])?\s*>=\s*([\w.]+)\s*", spec)
        if match and match.group(1) in PINNED:
            pins.append(f"{match.group(1)}{match.group(2) or ''}=={match.group(3)}")
    print(" ".join(pins))


if __name__ == "__main__":
    main()
