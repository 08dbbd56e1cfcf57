import os
import signal
import sys
import time

from prime_testkit import Children, wait_until


def test_children_are_killed_and_reaped():
    c = Children()
    p = c.python(["-c", "import time; time.sleep(600)"])
    wait_until(lambda: os.getpgid(p.pid) == p.pid, 10, what="child in its own group")
    c.kill_all()
    assert p.returncode == -signal.SIGKILL


def test_grandchildren_die_with_the_group(tmp_path):
    c = Children()
    pidfile = tmp_path / "pid"
    code = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pidfile)!r}, 'w').write(str(g.pid)); time.sleep(600)"
    )
    c.python(["-c", code])
    wait_until(lambda: pidfile.exists() and pidfile.read_text(), 20, what="grandchild pid")
    gpid = int(pidfile.read_text())
    c.kill_all()

    def gone():
        try:
            os.kill(gpid, 0)
        except ProcessLookupError:
            return True
        # a zombie awaiting its (dead) parent's reaper also counts as gone
        with open(f"/proc/{gpid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"

    wait_until(gone, 10, what="grandchild to die")
    assert sys.platform.startswith("linux") and time.monotonic() > 0
