"""A joiner's snapshot comes from several members at once; a donor killed mid-transfer is
replaced by the others; a node with another model setting is refused with a line naming it;
the members report what the join cost them (issue #24). Through the CLI, each node its own
process in its own folder.

Three members cap their serving rate (`mesh.serve_mbit`) so the snapshot takes seconds; a
fourth node joins and listens while the snapshot comes; the member whose checkpoint it takes
is SIGKILLed mid-transfer. It enters with the surviving members' outer weights.
"""

import signal
from pathlib import Path

import pytest

from prime_mesh import Coordinator
from prime_testkit import (
    check_same_outer,
    folder_metrics,
    log_tails,
    outer_by_step,
    start_cli_node,
    start_nodes_in_turn,
    stop_once_contributing,
    wait_until,
)

TOKEN = "join-donors-test-token"
# ~8.7 MB of checkpoint at 3 Mbit/s per donor: the shared ~5 MB from all three, the joiner's
# own ~3.5 MB (inner moments) from one: ~10 s, long enough for its admission to come first and
# a donor to be killed mid-way
NODE = {"host": "127.0.0.1", "token": TOKEN, "steps": 5000, "inner_steps": 10,
        "args": ["--mesh.serve_mbit", "3"]}  # fmt: skip


def transfer_under_way(folder: Path) -> bool:
    """The joiner's snapshot has its first chunks in."""
    return any(
        len((p / ".progress").read_text().splitlines()) >= 2
        for p in folder.rglob(".peer-*.partial")
        if (p / ".progress").exists()
    )


def listens(log: Path) -> bool:
    """The joiner has been admitted and listens."""
    return log.is_file() and "admitted before its snapshot arrived" in log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_listeners_donor_killed_mid_transfer_the_rest_comes_from_the_others(
    tmp_path, token_cache, children
):
    """The joiner listens while its snapshot comes from the three members at once; the one
    whose checkpoint it takes is SIGKILLed mid-transfer. It takes another member's checkpoint
    of the same step, keeping the shared bytes in, and enters with the survivors' outer
    weights; the survivors' rows of the round that admitted it say so. A node with another
    model setting, started meanwhile, is refused with a line naming it. 40-60 s on 2 shared
    cores."""
    coord = Coordinator("127.0.0.1", port=0, token=TOKEN, min_nodes=3).start()
    try:
        members = start_nodes_in_turn(children, [tmp_path / f"node{k}" for k in range(3)], coord,
                                      cache=token_cache, **NODE)  # fmt: skip
        n1, n2, n3 = tmp_path / "node1", tmp_path / "node2", tmp_path / "node3"
        wait_until(lambda: 2 in outer_by_step(folder_metrics(n1)) or members[1].poll() is not None,
                   240, what="the members' second outer step")  # fmt: skip
        joiner = start_cli_node(children, n3, coordinator=coord.address, cache=token_cache, **NODE)
        other = {**NODE, "args": [*NODE["args"], "--model.n_layers", "5"]}
        odd = start_cli_node(children, tmp_path / "odd", coordinator=coord.address,
                             cache=token_cache, **other)  # fmt: skip
        # (its fetch starts when it registers, its admission at the members' next round)
        wait_until(lambda: (listens(tmp_path / "node3.log") and transfer_under_way(n3))
                   or joiner.poll() is not None, 240, interval=0.02,
                   what="the joiner listening while its snapshot comes")  # fmt: skip
        listening = transfer_under_way(n3)  # (still: its snapshot is not all in)
        members[0].send_signal(signal.SIGKILL)  # a donor (the first offered: its checkpoint)
        members[0].wait(timeout=30)
        assert odd.wait(timeout=120) == 1, log_tails(tmp_path)
        survivors = (members[1], members[2], joiner)
        codes = stop_once_contributing(n3, survivors, contributors=3, timeout=240)
    finally:
        coord.close()
    assert codes == [0, 0, 0], log_tails(tmp_path)
    assert listening, "the joiner was not listening when the donor was killed"
    (row,) = [r for r in folder_metrics(n3) if r.get("joined")]
    assert row["listened"] >= 1 and row["snapshots"] == 1, row
    assert len([n for n in row["snapshot_donors"].values() if n > 0]) >= 2, row
    assert "dropped donor" in (tmp_path / "node3.log").read_text(), log_tails(tmp_path)
    refused = (tmp_path / "odd.log").read_text()
    assert "model.n_layers is 5 here, unset in the run" in refused, refused[-2000:]
    for m in (n1, n2):  # what admitting it cost them, on the row of the round that admitted it
        admitting = [r for r in outer_by_step(folder_metrics(m)).values() if r.get("admitted")]
        assert admitting and all(r["admitted"] == ["node3"] for r in admitting), admitting
        assert all(r["join_seconds"] >= 0 for r in admitting), admitting
    mine = check_same_outer(n3, [n1, n2])  # its first committed outer step, and every later
    for m in (n1, n2):  # one, has theirs
        assert min(mine) in outer_by_step(folder_metrics(m)), log_tails(tmp_path)
