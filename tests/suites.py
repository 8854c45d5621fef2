"""What the unit run (`pytest -m unit`, `make unit`: under a minute on two cores) does with fewer
cases than `make test`: random examples and simulation seeds. conftest.py configures it before any
test module is imported, so decorators read it."""

from __future__ import annotations

from hypothesis import settings

QUICK = False


def configure(quick: bool) -> None:
    global QUICK
    QUICK = quick
    settings.register_profile("quick", max_examples=10)
    settings.load_profile("quick" if quick else "default")


def examples(full: int) -> int:
    """A property test's number of examples: full in `make test`, a tenth (at least 10) in the unit run."""
    return max(10, full // 10) if QUICK else full


def seeds(full: int) -> range:
    """A simulation's seeds: all in `make test`, the first 20 in the unit run."""
    return range(min(full, 20) if QUICK else full)
