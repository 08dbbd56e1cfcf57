"""The WAN bed itself: namespaces reach each other through rate-limited links and vanish after."""

import signal
import subprocess
import sys

import pytest
from prime_netbed import WanBed, bed_unavailable_reason

from prime_testkit import wait_until

pytestmark = [
    pytest.mark.wan,
    pytest.mark.skipif(bed_unavailable_reason() is not None, reason=str(bed_unavailable_reason())),
]


def test_nodes_talk_over_limited_links_and_bed_is_removed():
    with WanBed(2, rate_mbit=50) as bed:
        names = list(bed._made)
        server = subprocess.Popen(
            bed.exec_prefix(1)
            + [
                sys.executable,
                "-c",
                "import socket; s = socket.create_server(('" + bed.ip(1) + "', 9000)); "
                "c, _ = s.accept(); print(len(c.recv(100)))",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            client = subprocess.run(
                bed.exec_prefix(0)
                + [
                    sys.executable,
                    "-c",
                    "import socket, time\n"
                    "for _ in range(100):\n"
                    "    try:\n"
                    "        s = socket.create_connection(('"
                    + bed.ip(1)
                    + "', 9000), timeout=5); break\n"
                    "    except OSError: time.sleep(0.1)\n"
                    "s.sendall(b'hello'); s.close()",
                ],
                timeout=60,
            )
            assert client.returncode == 0
            assert server.communicate(timeout=30)[0].strip() == "5"
        finally:
            server.kill()
            server.wait(timeout=10)
        qdisc = subprocess.run(
            bed.exec_prefix(0) + ["tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


def ping(bed: WanBed, src: int, dst: int) -> bool:
    """One TCP connect attempt from node src to a closed port of node dst: refused means the
    link carries packets, a timeout means it does not."""
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('{bed.ip(dst)}', 9), timeout=2)\n"
        "except ConnectionRefusedError: print('up')\n"
        "except OSError: print('down')\n"
    )
    r = subprocess.run(
        bed.exec_prefix(src) + [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.stdout.strip() == "up"


def test_cut_and_restore_a_link_and_close_kills_processes_left_inside():
    with WanBed(2, rate_mbit=50) as bed:
        assert ping(bed, 0, 1)
        bed.link_down(1)
        assert not ping(bed, 0, 1)
        bed.link_up(1)
        assert ping(bed, 0, 1)
        # a stopped process left in a namespace (deleting the namespace would not end it)
        sleeper = subprocess.Popen(bed.exec_prefix(1) + ["sleep", "600"])
        wait_until(lambda: sleeper.pid in bed.pids(1), 30, what="sleep inside namespace 1")
        sleeper.send_signal(signal.SIGSTOP)
        bed.close()
        assert sleeper.wait(timeout=30) == -9
        assert bed.namespaces_left() == []
