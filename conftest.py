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


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    """A token cache folder (`--data.cache_dir`) shared by the tests of one module: the first
    run tokenizes the corpus, the later ones reuse it."""
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="session")
def rank_pool():
    """Four rank processes in one gloo world, started at first use and shared by every test
    of the session (prime_testkit.RankPool): startup, not the cases, dominates such tests."""
    from prime_testkit import RankPool

    pool = RankPool(4)
    try:
        yield pool
    finally:
        pool.close()
