"""A node's start asks a remote for the other nodes' prefixes (a hint for a node restarted
under a new name): an S3 endpoint that never answers must not hold the start. Unbounded,
`benchmarks/real_size.py --remote hung` had both members idle past five minutes there; bounded
but asked apart from the node's own listing, a hung remote cost a start 20 s and then 10 s."""

import pytest
import torch

import prime_ckpt.loading
from prime_testkit import CREDENTIALS, DeadS3, MotoS3
from prime_train import checkpointing
from prime_train.checkpointing import Checkpointer, other_node_prefixes, remote_hint
from prime_train.config import Config


def remote_config(url: str, endpoint: str) -> Config:
    return Config.model_validate(
        {"ckpt": {"remote": url, "remote_options": {"endpoint_url": endpoint}}}
    )


@pytest.fixture
def credentials(monkeypatch):
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)


@pytest.mark.timeout(60)  # (unbounded, the listing hangs for minutes: botocore's retries)
def test_listing_a_hung_remote_for_the_hint_is_bounded(credentials):
    with DeadS3("hung") as dead:
        cfg = remote_config("s3://bucket/run", dead.endpoint)
        assert other_node_prefixes(cfg, "node0") == []


@pytest.mark.timeout(60)
def test_a_remote_whose_own_listing_hung_is_not_listed_again_for_the_hint(
    tmp_path, credentials, monkeypatch
):
    monkeypatch.setattr(prime_ckpt.loading, "REMOTE_LIST_TIMEOUT_S", 1.0)
    asked = []
    real = checkpointing.other_node_prefixes
    monkeypatch.setattr(
        checkpointing, "other_node_prefixes", lambda *a: asked.append(a) or real(*a)
    )
    with DeadS3("hung") as dead:
        cfg = remote_config("s3://bucket/run", dead.endpoint)
        ckpt = Checkpointer(
            tmp_path / "ckpt", 0, 1, remote=checkpointing.remote_prefix(cfg, "node0"),
            remote_options=cfg.ckpt.remote_options, ram="off",
        )  # fmt: skip
        try:
            with pytest.warns(Warning, match="cannot list"):
                assert remote_hint(cfg, "node0", ckpt) is None
            assert "took more than 1 s" in (ckpt.remote_unreachable or "")
            assert asked == [], "the hint listed a remote that had just hung"
        finally:
            ckpt.close()


@pytest.mark.timeout(120)
def test_a_node_without_checkpoints_is_told_which_names_the_remote_holds(
    tmp_path, credentials, children
):
    s3 = MotoS3(children)
    bucket = s3.bucket()
    cfg = remote_config(f"s3://{bucket}/run", s3.endpoint)
    remote = checkpointing.remote_prefix(cfg, "old-name")
    for name, folder in (("old-name", tmp_path / "old"), ("new-name", tmp_path / "new")):
        ckpt = Checkpointer(folder, 0, 1, remote=checkpointing.remote_prefix(cfg, name),
                            remote_options=cfg.ckpt.remote_options, ram="off")  # fmt: skip
        try:
            if name == "old-name":
                ckpt.save(10, {"w": torch.ones(4)})
                ckpt.wait_durable()
                assert ckpt.manager.wait_remote(60), f"the upload to {remote} did not end"
                assert remote_hint(cfg, name, ckpt) is None  # it holds its own
            else:
                hint = remote_hint(cfg, name, ckpt)
                assert ckpt.remote_unreachable is None
                assert hint and "['old-name']" in hint and "'new-name'" in hint, hint
        finally:
            ckpt.close()
