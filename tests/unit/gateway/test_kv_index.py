"""The prefix index's contract (tests/kv_index_cases.py) on the in-memory backend."""

import pytest
from kv_index_cases import *  # noqa: F403  (the cases and their fixtures)


@pytest.fixture
def backend_name() -> str:
    return "memory"
