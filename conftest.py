"""Fixtures for every test folder in the workspace."""

import pytest

from prime_testkit import Children, free_port


@pytest.fixture
def children():
    """Start child processes through this; all are killed and reaped when the test ends."""
    c = Children()
    try:
        yield c
    finally:
        c.kill_all()


@pytest.fixture
def port():
    return free_port()
