"""Packed-row attention: torch's varlen kernel is called right under every release's keywords
(causal, GQA, scale), checked against the per-sequence path and an explicit softmax loop. The
kernel itself is CUDA-only; on the CPU two stand-ins with the old and the new signature take
its place (one SDPA call per sequence, refusing what their release would not accept)."""
import math

import pytest
import torch
import torch.nn.functional as F

from megaprm.models.attention import packed_attention, varlen_call


def _per_sequence(q, k, v, cu, scale, enable_gqa):
    bounds = cu.tolist()
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        kw = {"enable_gqa": True} if enable_gqa else {}
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                  **kw)[0].transpose(0, 1))
    return torch.cat(out)


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                     return_aux=None):
    """torch 2.11's keywords: is_causal, no scale, no GQA (K/V must have q's heads)."""
    assert is_causal and torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert query.shape[1] == key.shape[1] == value.shape[1], "no GQA in this release"
    return _per_sequence(query, key, value, cu_seq_q, None, False)


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None):
    """torch 2.13's keywords: window_size, scale, enable_gqa."""
    assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k)
    assert enable_gqa == (query.shape[1] != key.shape[1])
    return _per_sequence(query, key, value, cu_seq_q, scale, enable_gqa)


def _explicit(q, k, v, cu, scale):
    """softmax(q k^T * scale + causal mask) v, sequence by sequence, head by head."""
    out = torch.zeros_like(q)
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        for h in range(q.shape[1]):
            s = q[a:b, h] @ k[a:b, h // rep].T * scale
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            out[a:b, h] = torch.softmax(s, -1) @ v[a:b, h // rep]
    return out


@pytest.mark.parametrize("kernel", [varlen_attn_2_11, varlen_attn_2_13])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_varlen_call_matches_the_per_sequence_path(kernel, heads, kv_heads, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    t, hn = int(cu[-1]), 8
    q = torch.randn(t, heads, hn, generator=g, dtype=torch.float64)
    k, v = (torch.randn(t, kv_heads, hn, generator=g, dtype=torch.float64) for _ in range(2))
    call = varlen_call(kernel)
    for scale in (None, 0.3):
        out = call(q, k, v, cu.to(torch.int32), int(lengths.max()), scale)
        ref = packed_attention(q, k, v, cu, scale=scale)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(out, _explicit(q, k, v, cu, scale or 1 / math.sqrt(hn)))


def test_a_release_without_causal_keywords_is_not_used():
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("cannot be made causal: must not be called")
    assert varlen_call(varlen_attn) is None


def test_this_torch_varlen_kernel_is_wrapped():
    """The installed torch's own varlen_attn signature is one `varlen_call` can drive."""
    pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")
    from megaprm.models import attention

    assert attention._varlen_attn() is not None


def test_swiglu_equals_megatrons_glu_and_saves_only_its_input():
    """`SwiGLU` (the fast local spec's MLP activation) against Megatron's unfused `glu` as
    autograd sees it (chunk, silu, x_linear + 0.0, mul): equal values and gradients, and while
    waiting for backward it holds no tensor beyond its output (fc1's output, its saved input,
    exists anyway), where `glu` holds silu(gate) and the offset copy of `up`: half of fc1's
    output each."""
    import torch.nn.functional as F

    from megaprm.models.attention import SwiGLU
    from megaprm.models.hf_spec import spec_from_hf, transformer_config
    from megaprm.models.tiny import tiny_config
    from tests.memory_utils import LiveBytes

    config = transformer_config(spec_from_hf(tiny_config("qwen2").to_dict()), impl="sdpa")
    assert config.use_te_activation_func  # Megatron's MLP then calls SwiGLU on fc1's output
    act = SwiGLU(config=config)
    g = torch.Generator().manual_seed(0)
    s, b, f = 16, 3, 24
    x = (torch.randn(s, b, 2 * f, generator=g) * 3).requires_grad_(True)
    w = torch.randn(s, b, f, generator=g)

    def glu(t):
        gate, up = torch.chunk(t, 2, dim=-1)
        return F.silu(gate) * (up + 0.0)

    grads, held = {}, {}
    for name, fn in (("swiglu", act), ("glu", glu)):
        with LiveBytes() as m:
            y = fn(x)
            held[name] = m.live - y.untyped_storage().nbytes()
        (y * w).sum().backward()
        grads[name], x.grad = x.grad, None
        if name == "swiglu":
            out = y.detach()
    torch.testing.assert_close(out, glu(x).detach(), rtol=0, atol=0)
    torch.testing.assert_close(grads["swiglu"], grads["glu"], rtol=1e-6, atol=1e-6)
    half = s * b * f * 4
    assert held["swiglu"] == 0 and held["glu"] == 2 * half, held
