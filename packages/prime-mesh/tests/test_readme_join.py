"""The README's examples run as written: nodes form a job, then a node joins it mid-run.

Each node is its own `python example.py` (or `joiner.py`) process against a real
`prime-mesh coordinator`; the members run until the test ends them, the joiner runs a few
steps and leaves. After the join every node's committed results must agree step by step.
"""

import re
import sys
import time
from pathlib import Path

import pytest

from prime_mesh.status import format_status, query_status
from prime_testkit import LineProc, start_mesh_coordinator, wait_until

README = Path(__file__).parents[1] / "README.md"
TOKEN = "test-token-readme"
STEP = re.compile(r"^step (\d+): epoch (\d+), rank (\d+)/(\d+), \[(.*)\]$")
JOINER_STEPS = 6
WAIT = 120  # bound on every wait for a process (a torch import on a loaded machine is slow)


def write_examples(folder: Path) -> None:
    """Each README block that starts with "# Save as NAME.py", saved as NAME.py."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(# Save as (\w+\.py).*?)```", text, re.S)
    assert {name for _, name in blocks} == {"example.py", "joiner.py"}
    for code, name in blocks:
        (folder / name).write_text(code)


class Proc(LineProc):
    """An example's process (its output lines collected with their times)."""

    def __init__(self, children, args, cwd: Path) -> None:
        super().__init__(children, args, TOKEN, cwd)

    def steps(self, since: float = 0.0) -> list[tuple[int, int, int, int, list[float]]]:
        """Committed steps printed: (step, epoch, rank, world, values)."""
        out = []
        for t, line in list(self.lines):
            m = STEP.match(line)
            if m and t >= since:
                values = [float(v) for v in m.group(5).split(",")]
                out.append((*map(int, m.groups()[:4]), values))
        return out


def form(children, tmp_path: Path, n: int) -> tuple[str, list[Proc]]:
    """A coordinator with --min-nodes n and n members running example.py (steps unbounded)."""
    write_examples(tmp_path)
    _, address = start_mesh_coordinator(children, TOKEN, "--min-nodes", str(n), cwd=tmp_path)
    members = [
        Proc(children, [sys.executable, "example.py", address, "100000"], tmp_path)
        for _ in range(n)
    ]
    wait_until(lambda: all(m.steps() for m in members), WAIT, what="the members' first steps")
    assert {m.steps()[0][3] for m in members} == {n}
    return address, members


def check_join(members: list[Proc], joiner: Proc) -> int:
    """The joiner's steps and the members' agree in the epoch that admitted it; returns it."""
    assert joiner.p.wait(timeout=WAIT) == 0, joiner.text()
    n = len(members)
    mine = joiner.steps()
    # every step of the joiner was committed, from its very first collective, in one epoch
    assert [s[0] for s in mine] == list(range(JOINER_STEPS)), joiner.text()
    epoch = mine[0][1]
    assert {(s[1], s[2], s[3]) for s in mine} == {(epoch, n, n + 1)}, joiner.text()
    # the members go on without it once it left (a graceful leave is a new epoch at once)
    wait_until(
        lambda: all(any(s[1] > epoch and s[3] == n for s in m.steps()) for m in members),
        WAIT,
        what="the members' steps after the joiner left",
    )
    for m in members:
        before = [s for s in m.steps() if s[1] < epoch]
        during = [s for s in m.steps() if s[1] == epoch]
        assert len(during) == JOINER_STEPS, m.text()
        # no step was lost at the join: the members' first step with the joiner follows on
        assert during[0][0] == before[-1][0] + 1, m.text()
        for (step, _, _, world, values), (j_step, *_, j_values) in zip(during, mine, strict=True):
            # the same collective on every node: the average of n members' steps and the
            # joiner's own step
            assert world == n + 1 and values == j_values
            assert values == [pytest.approx((n * step + j_step) / (n + 1))] * 4
    return epoch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 2])
def test_readme_loop_with_a_node_joining_a_formed_job(children, tmp_path, n):
    _, members = form(children, tmp_path, n)
    address = members[0].p.args[2]
    # the same command again: blocks until admitted, then runs the README loop as written
    joiner = Proc(children, [sys.executable, "example.py", address, str(JOINER_STEPS)], tmp_path)
    check_join(members, joiner)
    assert "'state': 'member'" in joiner.text()  # it printed members() before leaving


@pytest.mark.timeout(300)
def test_readme_joiner_waits_without_blocking_the_members(children, tmp_path):
    address, members = form(children, tmp_path, 2)
    joiner = Proc(children, [sys.executable, "joiner.py", address, str(JOINER_STEPS)], tmp_path)

    wait_until(lambda: "waiting" in joiner.text(), WAIT, what="the joiner to register")
    seen = time.monotonic()
    # what `prime-mesh status` prints (in-process: the joiner waits only 2 s; test_waiting.py
    # runs the command itself on joiners that wait for as long as the test likes)
    table = format_status(query_status(address, token=TOKEN), address)
    assert "2 members, 0 joining, 1 waiting" in table, table
    assert re.search(r"node-3 +waiting +rank -", table), table
    # it saw both members as donors, through members()
    assert "waiting: fetching from ['http://...', 'http://...']" in joiner.text()
    # while it "fetches", the members keep committing steps on their own
    wait_until(
        lambda: all(len([s for s in m.steps(since=seen) if s[3] == 2]) >= 2 for m in members),
        WAIT,
        what="the members' steps while the joiner waits",
    )
    epoch = check_join(members, joiner)
    for m in members:  # not admitted until it said ready(): members kept epoch 1 meanwhile
        assert {s[1] for s in m.steps() if s[1] < epoch} == {1}


@pytest.mark.timeout(300)
def test_readme_examples_alone(children, tmp_path):
    """`python example.py` with its own coordinator; `joiner.py` forming a job by itself."""
    write_examples(tmp_path)
    alone = Proc(children, [sys.executable, "example.py"], tmp_path)
    assert alone.p.wait(timeout=WAIT) == 0, alone.text()
    assert [(s[0], s[1], s[3], s[4]) for s in alone.steps()] == [
        (step, 1, 1, [float(step)] * 4) for step in range(3)
    ], alone.text()
    assert "'state': 'member'" in alone.text()

    _, address = start_mesh_coordinator(children, TOKEN, "--min-nodes", "1", cwd=tmp_path)
    first = Proc(children, [sys.executable, "joiner.py", address, "3"], tmp_path)
    assert first.p.wait(timeout=WAIT) == 0, first.text()
    # no members to fetch from: it says ready() and forms the job (min_nodes 1) by itself
    assert "waiting: fetching from []" in first.text()
    assert [(s[0], s[1], s[3]) for s in first.steps()] == [(step, 1, 1) for step in range(3)]
