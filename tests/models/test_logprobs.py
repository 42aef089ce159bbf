"""Vocab-parallel log-probs / entropy (values and gradients) vs a full-softmax reference, and
the chunked path (the default) vs the unchunked one at tp=1 and tp=2."""
import pytest
import torch

from megaprm.models.logprobs import (next_token_logprobs, reference_logprobs,
                                     vocab_parallel_logprobs)
from megaprm.parallel import launch
from tests.memory_utils import peak_bytes

V_TRUE, V_PAD = 45, 48  # three padded rows, as Megatron pads the vocabulary
# 0 = unchunked; 4 < s: token ranges within rows; 7 and 16 >= s: several whole rows per chunk
CHUNKS = (0, 4, 7, 16)


def _inputs(b=3, s=5):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, s + 1, V_PAD, generator=g) * 3
    target = torch.randint(0, V_TRUE, (b, s), generator=g)
    w_lp, w_ent = torch.randn(b, s, generator=g), torch.randn(b, s, generator=g)
    return logits, target, w_lp, w_ent


def _reference(temperature, **shape):
    logits, target, w_lp, w_ent = _inputs(**shape)
    full = logits[:, :-1, :V_TRUE].clone().requires_grad_(True)
    lp, ent = reference_logprobs(full, target, temperature)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grad = torch.zeros_like(logits)
    grad[:, :-1, :V_TRUE] = full.grad
    return lp.detach(), ent.detach(), grad


def _parallel(temperature, chunk_tokens, with_entropy=True, **shape):
    import torch.distributed as dist

    rank, world = 0, 1
    group = None
    if dist.is_available() and "WORLD_SIZE" in __import__("os").environ:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    logits, target, w_lp, w_ent = _inputs(**shape)
    shard = logits.chunk(world, -1)[rank].clone().requires_grad_(True)
    # logits[:, :-1] is a non-contiguous view, as the trainer passes it
    out = vocab_parallel_logprobs(shard[:, :-1], target, tp_group=group, tp_rank=rank,
                                  vocab_size=V_TRUE, with_entropy=with_entropy,
                                  temperature=temperature, chunk_tokens=chunk_tokens)
    lp, ent = out if with_entropy else (out, torch.zeros_like(out))
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), shard.grad


def _parallel_all_chunks(temperature):
    return {c: _parallel(temperature, c) for c in CHUNKS}


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_tp1_matches_full_softmax(chunk_tokens):
    for temperature in (1.0, 0.7):
        lp, ent, grad = _parallel(temperature, chunk_tokens)
        r_lp, r_ent, r_grad = _reference(temperature)
        assert torch.allclose(lp, r_lp, atol=1e-5)
        assert torch.allclose(ent, r_ent, atol=1e-5)
        assert torch.allclose(grad, r_grad, atol=1e-5)


def test_chunked_equals_unchunked_without_entropy_and_odd_shapes():
    """No entropy requested; a shape whose rows split into uneven token ranges."""
    for with_entropy in (False, True):
        ref = _parallel(1.3, 0, with_entropy, b=2, s=11)
        for c in (3, 5, 30):
            got = _parallel(1.3, c, with_entropy, b=2, s=11)
            for a, r in zip(got, ref):
                assert torch.allclose(a, r, atol=1e-6, rtol=1e-6)


def test_chunked_bf16_logits_match_fp32_of_same_values():
    """bf16 logits (the bf16 model's output): computed in fp32 internally, grad comes back bf16."""
    logits, target, w_lp, _ = _inputs()
    x16 = logits.bfloat16().requires_grad_(True)
    lp = vocab_parallel_logprobs(x16[:, :-1], target, vocab_size=V_TRUE, chunk_tokens=4)
    (lp * w_lp).sum().backward()
    x32 = x16.detach().float().requires_grad_(True)
    r_lp, _ = reference_logprobs(x32[:, :-1, :V_TRUE], target)
    (r_lp * w_lp).sum().backward()
    assert lp.dtype == torch.float32 and x16.grad.dtype == torch.bfloat16
    assert torch.allclose(lp, r_lp, atol=1e-5)
    assert torch.allclose(x16.grad.float(), x32.grad, atol=1e-2)


def test_tp2_matches_full_softmax():
    for temperature in (1.0, 0.7):
        r_lp, r_ent, r_grad = _reference(temperature)
        results = launch.spawn(_parallel_all_chunks, 2, temperature)
        for rank, per_chunk in enumerate(results):
            for c, (lp, ent, grad) in per_chunk.items():
                assert torch.allclose(lp, r_lp, atol=1e-5), c
                assert torch.allclose(ent, r_ent, atol=1e-5), c
                assert torch.allclose(grad, r_grad.chunk(2, -1)[rank], atol=1e-5), c


def test_chunked_saves_no_vocab_sized_tensor_but_its_input():
    """Backward memory: the unchunked path saves fp32 [b, s, V] tensors (p, z); the chunked one
    keeps only the logits it was given (plus [b, s] statistics)."""
    logits, target, _, _ = _inputs(b=4, s=16)
    x = logits.bfloat16().requires_grad_(True)
    for chunk, expect_big in ((0, True), (8, False)):
        saved = []

        def pack(t, saved=saved):
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            vocab_parallel_logprobs(x[:, :-1], target[:, :16], vocab_size=V_TRUE,
                                    with_entropy=True, chunk_tokens=chunk)
        big = [t for t in saved if t.numel() >= 4 * 16 * V_TRUE
               and t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()]
        assert bool(big) == expect_big, [tuple(t.shape) for t in big]


def test_next_token_logprobs_backward_holds_one_logits_sized_gradient():
    """The logits' memory bound: forward + backward of the next-token log-probs
    from leaf logits [b, s, V] allocate one [b, s, V] gradient plus a few chunk-sized buffers.
    The sliced call (`logits[:, :-1]`, the old convention) needs a second full-size gradient in
    autograd's slice backward: the measure sees it. Values and grads equal the reference."""
    b, s, v, chunk = 2, 256, 512, 16
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, s, v, generator=g).requires_grad_(True)
    ids = torch.randint(0, v, (b, s), generator=g)
    full = b * s * v * 4
    chunk_bytes = chunk * v * 4

    def new():
        lp, ent = next_token_logprobs(logits, ids, with_entropy=True, chunk_tokens=chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()

    def sliced():
        lp, ent = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], with_entropy=True,
                                          chunk_tokens=chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()

    peak = peak_bytes(new)
    grad, logits.grad = logits.grad, None
    assert full <= peak <= full + 8 * chunk_bytes + 64 * b * s, (peak / full, chunk_bytes / full)
    assert peak_bytes(sliced) >= 2 * full - 8 * chunk_bytes
    torch.testing.assert_close(grad, logits.grad)
    r_lp, r_ent = reference_logprobs(logits[:, :-1].detach(), ids[:, 1:])
    lp, ent = next_token_logprobs(logits.detach(), ids, with_entropy=True, chunk_tokens=chunk)
    torch.testing.assert_close(lp, r_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, r_ent, atol=1e-5, rtol=1e-5)


def test_the_cpu_default_chunk_is_bounded_in_bytes_and_exact():
    """On the CPU the default chunk holds at most CHUNK_BYTES_CPU of fp32 softmax (1024 tokens
    of a 32k vocabulary would be a second logits-sized temporary here, re-mapped by the C
    allocator each call); on an accelerator it stays 1024 tokens. Values and grads equal the
    full-softmax reference."""
    from megaprm.models.logprobs import CHUNK_BYTES_CPU, default_chunk_tokens

    b, s, v = 2, 256, 32768
    assert default_chunk_tokens(v, torch.device("cuda")) == 1024
    assert default_chunk_tokens(v, torch.device("cpu")) * v * 4 <= CHUNK_BYTES_CPU
    assert default_chunk_tokens(8, torch.device("cpu")) * 8 * 4 == CHUNK_BYTES_CPU
    assert default_chunk_tokens(10**9, torch.device("cpu")) == 16
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, s, v, generator=g).requires_grad_(True)
    ids = torch.randint(0, v, (b, s), generator=g)
    full = b * s * v * 4

    def step():
        lp, ent = next_token_logprobs(logits, ids, with_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()

    peak = peak_bytes(step)
    assert full <= peak <= full + 8 * CHUNK_BYTES_CPU + 64 * b * s, peak / full
    ref = logits.detach().clone().requires_grad_(True)
    r_lp, r_ent = reference_logprobs(ref[:, :-1], ids[:, 1:])
    (r_lp.sum() + 0.1 * r_ent.sum()).backward()
    torch.testing.assert_close(logits.grad[:, :-1], ref.grad[:, :-1], atol=1e-6, rtol=1e-5)
    lp, ent = next_token_logprobs(logits.detach(), ids, with_entropy=True)
    torch.testing.assert_close(lp, r_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, r_ent.detach(), atol=1e-5, rtol=1e-5)
