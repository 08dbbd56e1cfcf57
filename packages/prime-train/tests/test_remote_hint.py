"""A node's start asks a remote for the other nodes' prefixes (a hint for a node restarted
under a new name): an S3 endpoint that never answers must not hold the start. Unbounded,
`benchmarks/real_size.py --remote hung` had both members idle past five minutes there."""

import pytest

from prime_testkit import CREDENTIALS, DeadS3
from prime_train.checkpointing import other_node_prefixes
from prime_train.config import Config


@pytest.mark.timeout(60)  # (unbounded, the listing hangs for minutes: botocore's retries)
def test_listing_a_hung_remote_for_the_hint_is_bounded(monkeypatch):
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    with DeadS3("hung") as dead:
        cfg = Config.model_validate({"ckpt": {"remote": "s3://bucket/run",
                                              "remote_options": {"endpoint_url": dead.endpoint}}})  # fmt: skip
        assert other_node_prefixes(cfg, "node0") == []
