"""Peer transfer between network namespaces over rate-limited links (the WAN bed, root only):
donors on real interfaces behind 0.0.0.0 + advertise_host, one SIGKILLed mid-transfer."""

import os
import select
import shutil
import signal
import subprocess
import sys

import pytest
from prime_netbed import WanBed, bed_unavailable_reason

from prime_ckpt.manifest import (
    read_manifest,
    step_dirname,
    verify_dir,
)
from prime_ckpt.peer.fetch import partial_dirname
from prime_ckpt.peer.journal import JOURNAL
from prime_testkit import make_checkpoint, wait_until

pytestmark = [
    pytest.mark.wan,
    pytest.mark.skipif(bed_unavailable_reason() is not None, reason=str(bed_unavailable_reason())),
]
TOKEN = "wan-secret"


def test_fetch_across_namespaces_survives_a_killed_donor(tmp_path, children):
    digest = make_checkpoint(
        tmp_path / "a", 2, {f"w{i}.bin": os.urandom(4 << 20) for i in range(3)}
    )
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    env = dict(os.environ, PRIME_TOKEN=TOKEN)
    peer = [sys.executable, "-m", "prime_ckpt.peer"]
    with WanBed(3, rate_mbit=40) as bed:
        donors, urls = [], []
        for k, d in enumerate(["a", "b"]):
            p = children.popen(
                bed.exec_prefix(k)
                + peer
                + ["serve", str(tmp_path / d), "--host", "0.0.0.0", "--advertise-host", bed.ip(k)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
            )
            assert select.select([p.stdout], [], [], 30)[0], "donor did not start in 30 s"
            donors.append(p)
            urls.append(p.stdout.readline().decode().strip())
        assert urls[0].startswith(f"http://{bed.ip(0)}:")
        dest = tmp_path / "dest"
        fetcher = children.popen(
            bed.exec_prefix(2)
            + peer
            + ["fetch", *urls, "--dest", str(dest), "--chunk-mb", "0.5", "--timeout", "10"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        journal = dest / partial_dirname(2, digest) / JOURNAL
        wait_until(
            lambda: journal.exists() and len(journal.read_text().splitlines()) >= 3,
            timeout=60,
            what="the first chunks over the WAN links",
        )
        donors[0].send_signal(signal.SIGKILL)
        out, err = fetcher.communicate(timeout=120)
        assert fetcher.returncode == 0, err.decode()
        assert b"fetched step 2" in out
        assert b"dropped donor" in err  # the kill did land mid-transfer
    assert verify_dir(dest / step_dirname(2)) == []
    assert read_manifest(dest / step_dirname(2)).digest() == digest
