"""Vocab-parallel log-probs / entropy (values and gradients) vs a full-softmax reference."""
import torch

from megaprm.models.logprobs import reference_logprobs, vocab_parallel_logprobs
from megaprm.parallel import launch

V_TRUE, V_PAD = 45, 48  # three padded rows, as Megatron pads the vocabulary


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, V_PAD, generator=g) * 3
    target = torch.randint(0, V_TRUE, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    return logits, target, w_lp, w_ent


def _reference(temperature):
    logits, target, w_lp, w_ent = _inputs()
    full = logits[..., :V_TRUE].clone().requires_grad_(True)
    lp, ent = reference_logprobs(full, target, temperature)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grad = torch.zeros_like(logits)
    grad[..., :V_TRUE] = full.grad
    return lp.detach(), ent.detach(), grad


def _parallel(temperature):
    import torch.distributed as dist

    rank, world = 0, 1
    group = None
    if dist.is_available() and "WORLD_SIZE" in __import__("os").environ:
        dist.init_process_group("gloo")
        rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    logits, target, w_lp, w_ent = _inputs()
    shard = logits.chunk(world, -1)[rank].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(shard, target, tp_group=group, tp_rank=rank,
                                      vocab_size=V_TRUE, with_entropy=True,
                                      temperature=temperature)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), shard.grad


def test_tp1_matches_full_softmax():
    for temperature in (1.0, 0.7):
        lp, ent, grad = _parallel(temperature)
        r_lp, r_ent, r_grad = _reference(temperature)
        assert torch.allclose(lp, r_lp, atol=1e-5)
        assert torch.allclose(ent, r_ent, atol=1e-5)
        assert torch.allclose(grad, r_grad, atol=1e-5)


def test_tp2_matches_full_softmax():
    r_lp, r_ent, r_grad = _reference(1.0)
    results = launch.spawn(_parallel, 2, 1.0)
    for rank, (lp, ent, grad) in enumerate(results):
        assert torch.allclose(lp, r_lp, atol=1e-5)
        assert torch.allclose(ent, r_ent, atol=1e-5)
        assert torch.allclose(grad, r_grad.chunk(2, -1)[rank], atol=1e-5)
