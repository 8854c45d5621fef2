"""`splitserve` (and `python -m splitserve`): every command. The one module that sees both the
launcher's commands and the experiments' (which start clusters through the launcher)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from splitserve.experiments.cli import add_commands as add_experiment_commands
    from splitserve.services.launcher.cli import build_parser as launcher_parser

    return launcher_parser(add_experiment_commands)


def main(argv: list[str] | None = None) -> int:
    from splitserve.services.launcher.cli import main as run

    return run(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
