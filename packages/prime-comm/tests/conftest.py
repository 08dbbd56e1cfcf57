"""The all-reduce tests run their cases (comm_worker.py) in the session's rank pool."""

from __future__ import annotations

from pathlib import Path

import pytest

CASES = Path(__file__).with_name("comm_worker.py")


@pytest.fixture
def pool4(rank_pool):
    """The session's four rank processes (root conftest.py), running comm_worker's cases."""
    return rank_pool.cases(CASES)
