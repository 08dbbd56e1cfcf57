"""The outer step against a hand-written Nesterov reference, over a real 2-process gloo group."""

import pytest
import torch
import torch.distributed as dist

from prime_testkit import free_port, gloo_world
from prime_train.diloco import OuterOptimizer


def reference_outer(start, currents, lr, mu, steps):
    """torch.optim.SGD(nesterov) on the averaged pseudo-gradient, applied `steps` times."""
    outer = [t.clone().requires_grad_(True) for t in start]
    opt = torch.optim.SGD(outer, lr=lr, momentum=mu, nesterov=True)
    for s in range(steps):
        for o, parts in zip(outer, zip(*[c[s] for c in currents], strict=True), strict=True):
            o.grad = torch.stack([o.detach() - p for p in parts]).mean(0)
        opt.step()
    return [o.detach() for o in outer]


def _worker(rank, world, port, q):
    torch.set_num_threads(1)
    gloo_world(rank, world, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        start = [p.detach().clone() for p in model.parameters()]
        outer = OuterOptimizer(model.parameters(), lr=0.7, momentum=0.9)
        seen = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
            seen.append([p.detach().clone() for p in model.parameters()])

            g = outer.compute_pseudo_gradient()
            dist.all_reduce(g)
            g.div_(world)
            outer.apply()
        # numpy, not tensors: torch would share tensor storage by fd, gone once this child exits
        q.put(
            (
                rank,
                [t.numpy() for t in start],
                [[t.numpy() for t in s] for s in seen],
                [p.detach().numpy().copy() for p in model.parameters()],
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_outer_nesterov_matches_torch_sgd_and_is_identical_on_ranks(children):
    world, port = 2, free_port()
    q = children.queue()
    for r in range(world):
        children.process(_worker, r, world, port, q)
    results = sorted((q.get(timeout=90) for _ in range(world)), key=lambda r: r[0])
    as_t = lambda xs: [torch.from_numpy(x) for x in xs]  # noqa: E731
    finals = [as_t(r[3]) for r in results]
    for a, b in zip(*finals, strict=True):
        assert torch.equal(a, b)
    ref = reference_outer(
        as_t(results[0][1]), [[as_t(s) for s in r[2]] for r in results], 0.7, 0.9, 3
    )
    for got, want in zip(finals[0], ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_pseudo_gradient_is_recomputed_after_a_failed_average():
    """A failed all-reduce may leave garbage in the buffer: nothing is applied, and the retry's
    pseudo-gradient is outer - current again."""
    model = torch.nn.Linear(3, 2)
    outer = OuterOptimizer(model.parameters())
    before = outer.weights.clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    outer.compute_pseudo_gradient().fill_(float("nan"))  # what a torn all-reduce leaves
    assert torch.equal(outer.weights, before)
    assert torch.equal(outer.momentum_buffer, torch.zeros_like(before))
    current = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(outer.compute_pseudo_gradient(), before - current)


def test_bad_state_is_a_clear_error():
    outer = OuterOptimizer(torch.nn.Linear(3, 2).parameters())
    with pytest.raises(ValueError, match="another model"):
        outer.load_state_dict({"outer": torch.zeros(5), "momentum": torch.zeros(5)})
