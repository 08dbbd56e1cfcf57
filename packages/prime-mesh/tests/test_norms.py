"""The coordinator's comparison of the nodes' pseudo-gradient norms (`prime_mesh.norms`)."""

import pytest

from prime_mesh.norms import norm_outliers


def test_a_node_far_above_the_median_of_the_others_is_told_why():
    norms2 = {("a", 0): 1.0, ("b", 0): 1.21, ("c", 0): 0.81, ("d", 0): 400.0}  # d: norm 20
    found = norm_outliers(norms2, 10.0)
    assert list(found) == ["d"]
    assert "L2 norm 20" in found["d"] and "10 x the median of the other 3" in found["d"]


def test_a_nodes_ranks_add_up_and_one_rank_alone_does_not_decide():
    # node a's two shards: 3^2 + 4^2 = 5^2; b and c hold norm 1: a is within 10x
    norms2 = {("a", 0): 9.0, ("a", 1): 16.0, ("b", 0): 1.0, ("c", 0): 1.0}
    assert norm_outliers(norms2, 10.0) == {}
    assert list(norm_outliers(norms2, 4.0)) == ["a"]


def test_two_nodes_the_larger_is_left_out_and_the_bound_0_turns_it_off():
    norms2 = {("a", 0): 1.0, ("b", 0): 121.0}
    assert list(norm_outliers(norms2, 10.0)) == ["b"]
    assert norm_outliers(norms2, 0.0) == {}
    assert norm_outliers({("a", 0): 1e6}, 10.0) == {}  # nobody to compare with


@pytest.mark.parametrize("bound", [2.0, 10.0])
def test_equal_norms_are_never_outliers(bound):
    assert norm_outliers({(k, 0): 4.0 for k in "abcde"}, bound) == {}
