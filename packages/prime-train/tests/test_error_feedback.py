"""Error feedback in the outer step (`[diloco] error_feedback`), over a real 2-process gloo
group with a scripted mesh: the residual is carried into the next round, a retried attempt
starts from the same values, a failed vote leaves it untouched, a joiner starts from zero, and
it travels with the node's checkpointed state."""

import pytest
import torch
import torch.distributed as dist

from prime_testkit import WorldMesh, gloo_world
from prime_train.config import Config, DilocoConfig
from prime_train.diloco import Diloco, make_outer_step
from prime_train.diloco.average import average_pseudo_gradient


class ScriptedMesh(WorldMesh):
    """The gloo world's mesh (`votes` scripted); each vote also records the node's residual
    as it stands."""

    def __init__(self, outer_ref: list, votes: list[bool]):
        super().__init__(votes)
        self.outer_ref = outer_ref
        self.residual_at_vote: list[torch.Tensor] = []

    def should_commit(self, ok: bool, contributed: bool = True) -> bool:
        self.residual_at_vote.append(self.outer_ref[0].feedback.residual.clone())
        return super().should_commit(ok, contributed)


def _mean(t: torch.Tensor) -> torch.Tensor:
    t = t.double()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _move(model: torch.nn.Module, rank: int, rnd: int) -> None:
    """A round's inner steps: a fixed, different update on each rank."""
    g = torch.Generator().manual_seed(100 * rnd + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _worker(rank, world, port, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(400, 300)  # 120K parameters: two 64K codebook blocks
        cfg = DilocoConfig(inner_steps=1, compression="uint2", error_feedback=True)
        ref: list = []
        mesh = ScriptedMesh(ref, votes=[True, False, True, True])  # round 2 retried once
        outer = Diloco(cfg, mesh, list(model.parameters()))
        ref.append(outer)
        out: dict = {"identity": [], "residual_rms": []}
        for rnd in (1, 2):
            _move(model, rank, rnd)
            raw = outer.optimizer.weights.clone()
            raw -= torch.cat([p.detach().flatten() for p in model.parameters()])
            before = outer.feedback.residual.clone()
            outer.start(rnd)
            report = outer.finish()
            after = outer.feedback.residual
            # what every node applied: the average of what each meant to send (its
            # pseudo-gradient plus its old residual) minus its new residual
            want = _mean(raw + before - after)
            got = outer.optimizer.pseudo_gradient.double()
            out["identity"].append(((got - want).abs().max() / want.abs().max()).item())
            out["residual_rms"].append(after.norm().item() / after.numel() ** 0.5)
            out[f"attempts{rnd}"] = report.attempts
        # the failed attempt of round 2 left the residual of round 1 in place for the retry
        votes = mesh.residual_at_vote
        out["untouched_by_failed_vote"] = torch.equal(votes[1], votes[2])
        out["carried"] = not torch.equal(votes[0], votes[1])
        # the node's checkpointed state holds its residual; a fresh node loads it exactly
        state = outer.state_dict()
        out["in_state"] = state["error_feedback"]["residual"] is outer.feedback.residual
        other = Diloco(cfg, ScriptedMesh([], []), list(torch.nn.Linear(400, 300).parameters()))
        other.load_state_dict(state)
        out["loaded"] = torch.equal(other.feedback.residual, outer.feedback.residual)
        # a joiner (rank 1) loaded a donor's state, residual included: it enters with zero
        # and keeps zero (its entry round counts nothing of its own); the member keeps a new one
        mesh.regroup = True
        member_before = outer.feedback.residual.clone()
        if rank == 1:
            outer.optimizer.load_into_model()  # a joiner's model is the outer weights
            outer.enter(3)
            out["joiner_zero"] = bool((outer.feedback.residual == 0).all())
        else:
            _move(model, rank, 3)
            outer.start(3)
            outer.finish()
            out["member_changed"] = not torch.equal(outer.feedback.residual, member_before)
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_residual_is_carried_kept_on_retry_checkpointed_and_zero_for_a_joiner(children):
    results = children.ranks(_worker, 2)
    for rank, out in results.items():
        assert max(out["identity"]) < 1e-4, (rank, out["identity"])
        assert min(out["residual_rms"]) > 0, "no residual was kept"
        assert out["attempts1"] == 1 and out["attempts2"] == 2
        assert out["carried"] and out["untouched_by_failed_vote"]
        assert out["in_state"] and out["loaded"]
    assert results[1]["joiner_zero"] and results[0]["member_changed"]


def _delayed_worker(rank, world, port, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(400, 300)
        cfg = DilocoConfig(
            inner_steps=1, compression="uint4", error_feedback=True, overlap="delayed"
        )
        ref: list = []
        mesh = ScriptedMesh(ref, votes=[True, False, True])  # round 2 is dropped
        outer = make_outer_step(cfg, mesh, list(model.parameters()))
        ref.append(outer)
        for rnd in (1, 2, 3):
            _move(model, rank, rnd)
            outer.start(rnd)  # applies the previous round, starts this one in the background
        outer.finish()
        votes = mesh.residual_at_vote  # as each round's vote began, in the background thread
        state = outer.state_dict()
        q.put((rank, {
            "carried": bool(votes[1].abs().sum() > 0),
            "untouched_by_dropped_round": torch.equal(votes[1], votes[2]),
            "kept_at_commit": not torch.equal(outer.feedback.residual, votes[2]),
            "in_state": state["error_feedback"]["residual"] is outer.feedback.residual,
            "digest": outer.optimizer.digest(),
            "outer_steps": outer.rounds.outer_steps,
        }))  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_delayed_overlap_keeps_a_committed_rounds_residual_and_not_a_dropped_ones(children):
    """`overlap = "delayed"`: the background round sends P + residual and keeps the new
    residual when its vote commits; a dropped round leaves it; the nodes stay identical."""
    results = children.ranks(_delayed_worker, 2)
    for out in results.values():
        assert out["carried"] and out["untouched_by_dropped_round"] and out["kept_at_commit"]
        assert out["in_state"] and out["outer_steps"] == 2
    assert results[0]["digest"] == results[1]["digest"]


def _weighted_worker(rank, world, port, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        g = torch.Generator().manual_seed(7 + rank)
        pg = torch.randn(120_000, generator=g)
        carried = torch.randn(120_000, generator=g) * 0.05  # the residual of an earlier round
        reads = [3, 0] if rank == 0 else [1, 0]  # weights 2 * 3/4 and 2 * 1/4
        sent = pg * (2 * sum(reads) / 4) + carried  # what this node means to send
        new = torch.zeros_like(pg)
        got = average_pseudo_gradient(ScriptedMesh([], []), pg, "uint2", 0, reads=reads,
                                      feedback=(carried, new), weighted=True)  # fmt: skip
        # error feedback's identity: the average is the mean of what each node meant to send
        # minus the error it keeps
        off = (pg.double() - _mean(sent.double() - new.double())).abs().max().item()
        q.put((rank, {"error": got.error, "off": off, "kept": new.abs().sum().item()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_weighted_rounds_add_the_carried_residual_after_the_weight(children):
    """Time-budgeted rounds weigh each node's pseudo-gradient by its reads; a carried residual
    is added after that weight (it is already in sent units): w x P + residual, not
    w x (P + residual)."""
    results = children.ranks(_weighted_worker, 2)
    for out in results.values():
        assert out["error"] is None and out["kept"] > 0
        assert out["off"] < 1e-4, out


def test_off_by_default_and_out_of_the_hash_when_off():
    """Off: the config hash of the runs made before the setting existed, nothing added to the
    node's state; on: a different hash; with compression 'none' a clear error."""
    base = Config()
    assert "error_feedback" not in base.fingerprint()["diloco"]
    on = Config.model_validate({"diloco": {"error_feedback": True, "compression": "uint2"}})
    assert on.fingerprint()["diloco"]["error_feedback"] is True
    assert on.fingerprint_hash() != base.fingerprint_hash()
    with pytest.raises(ValueError, match="needs a quantized compression"):
        DilocoConfig(error_feedback=True, compression="none")
