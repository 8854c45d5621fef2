"""mypy on the packages pyproject.toml's [tool.mypy] names (`make lint`; arguments go on to mypy).

The repository's root is the `splitserve` package (pyproject.toml's package-dir), which the editable
install maps with an import hook that mypy cannot follow; so this links the root as
build/mypy/splitserve (the mypy_path), runs mypy and prints its paths as repository paths.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = REPO / "build" / "mypy" / "splitserve"


def link_root() -> None:
    LINK.parent.mkdir(parents=True, exist_ok=True)
    if LINK.is_symlink() and LINK.resolve() != REPO:
        LINK.unlink()
    if LINK.is_dir() and not LINK.is_symlink():  # the old layout's folder of links
        for child in LINK.iterdir():
            child.unlink()
        LINK.rmdir()
    if not LINK.is_symlink():
        LINK.symlink_to(REPO, target_is_directory=True)


def main() -> int:
    link_root()
    done = subprocess.run([sys.executable, "-m", "mypy", *sys.argv[1:]], cwd=REPO, capture_output=True, text=True)
    prefix = f"{LINK.relative_to(REPO)}/"
    for stream, text in ((sys.stdout, done.stdout), (sys.stderr, done.stderr)):
        stream.write(text.replace(prefix, ""))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
