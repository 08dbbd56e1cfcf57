import pytest

from prime_mesh import CollectiveDeadline


def test_deadline_follows_a_bounded_moving_average():
    d = CollectiveDeadline(initial=60, factor=4, margin=3.5, floor=5, ceiling=100, window=4)
    assert d.timeout() == 60  # before any observation
    d.record(0.1)
    assert d.timeout() == 5  # 4 * 0.1 + 3.5 is under the floor
    for s in (2.0, 2.0, 2.0, 2.0):
        d.record(s)
    assert d.timeout() == pytest.approx(4 * 2.0 + 3.5)  # the 0.1 left the window
    for _ in range(4):
        d.record(1000.0)
    assert d.timeout() == 100  # ceiling
    with pytest.raises(ValueError, match="floor"):
        CollectiveDeadline(floor=10, ceiling=5)
