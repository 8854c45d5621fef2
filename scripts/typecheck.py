"""mypy on the packages pyproject.toml's [tool.mypy] names (`make lint`; arguments go on to mypy).

The repository's top-level folders are the subpackages of `splitserve` (pyproject.toml's package-dir),
and the editable install maps them with an import hook, which mypy cannot follow. So this links them
into build/mypy/splitserve/ (the mypy_path), runs mypy there and prints its paths as repository paths.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREE = REPO / "build" / "mypy" / "splitserve"


def link_tree() -> dict[str, str]:
    """Links build/mypy/splitserve/<name> to each mapped folder; returns {tree path: repo path}."""
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    TREE.mkdir(parents=True, exist_ok=True)
    paths = {}
    for package, folder in package_dir.items():
        link = TREE / package.removeprefix("splitserve.")
        if link.is_symlink() and link.resolve() != (REPO / folder).resolve():
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(REPO / folder, target_is_directory=True)
        paths[f"{link.relative_to(REPO)}/"] = f"{folder}/"
    return paths


def main() -> int:
    paths = link_tree()
    done = subprocess.run([sys.executable, "-m", "mypy", *sys.argv[1:]], cwd=REPO, capture_output=True, text=True)
    for stream, text in ((sys.stdout, done.stdout), (sys.stderr, done.stderr)):
        for tree_path, repo_path in paths.items():
            text = text.replace(tree_path, repo_path)
        stream.write(text)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
