"""Micro-batches: fixed rows reproduce the trainer's row split; packed rows respect the token
budget, carry each sequence's real tokens once, and unpack back to the caller's rows; the
attention a packed row gets is block-diagonal causal (checked against per-sequence SDPA)."""
import random

import pytest
import torch

from megaprm.parallel import microbatch, pipeline


def _rows(B=7, L=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (B, L), generator=g)
    lengths = torch.randint(2, L + 1, (B,), generator=g)
    pos = torch.arange(L)[None]
    mask = ((pos < lengths[:, None] - 1) & (torch.rand(B, L, generator=g) > 0.3)).float()
    mask[:, -1] = 1.0  # the last column predicts nothing; callers may leave it set
    payload = {"adv": torch.randn(B, L - 1, generator=g), "o": torch.randn(B, generator=g)}
    return ids, mask, payload, lengths


def _split_reference(ids, mask, payload, size, pp):
    """The trainer's split before this module (loop._split at the time of writing)."""
    out = []
    for s in range(0, ids.shape[0], size):
        mb_ids, mb_mask = ids[s:s + size], mask[s:s + size]
        mb_pay = {k: v[s:s + size] for k, v in payload.items()}
        if pp > 1 and mb_ids.shape[0] < size:
            extra = size - mb_ids.shape[0]
            mb_ids = torch.cat([mb_ids, mb_ids.new_zeros(extra, ids.shape[1])])
            mb_mask = torch.cat([mb_mask, mb_mask.new_zeros(extra, mask.shape[1])])
            mb_pay = {k: torch.cat([v, v.new_zeros(extra, *v.shape[1:])])
                      for k, v in mb_pay.items()}
        out.append((mb_ids, mb_mask, mb_pay))
    return out


@pytest.mark.parametrize("size,pp", [(3, 1), (3, 2), (7, 2), (1, 1)])
def test_fixed_rows_match_the_row_split(size, pp):
    ids, mask, payload, _ = _rows()
    mbs = microbatch.make_micro_batches(ids, mask, payload, micro_batch_size=size, pp_size=pp)
    ref = _split_reference(ids, mask, payload, size, pp)
    assert len(mbs) == len(ref)
    for mb, (r_ids, r_mask, r_pay) in zip(mbs, ref):
        assert torch.equal(mb.input_ids, r_ids) and torch.equal(mb.loss_mask, r_mask)
        assert mb.payload.keys() == r_pay.keys()
        assert all(torch.equal(mb.payload[k], r_pay[k]) for k in r_pay)
        assert mb.layout.cu_seqlens is None
        # unpack keeps the payload's rows (pp padding rows included), as loss code expects
        assert microbatch.unpack(mb, mb.loss_mask).shape[0] == mb.payload["adv"].shape[0]
    lp = [mb.input_ids[:, 1:].float() for mb in mbs]  # any per-token output
    back = microbatch.to_rows(mbs, [microbatch.unpack(mb, x) for mb, x in zip(mbs, lp)], 7)
    assert torch.equal(back, ids[:, 1:].float())


@pytest.mark.parametrize("max_tokens,pp", [(10, 1), (16, 1), (23, 2), (100, 1)])
def test_packed_rows_hold_each_sequence_once_within_budget(max_tokens, pp):
    ids, mask, payload, lengths = _rows(B=9, seed=1)
    mbs = microbatch.make_micro_batches(ids, mask, payload, max_tokens=max_tokens,
                                        lengths=lengths, pp_size=pp)
    seen = torch.cat([mb.layout.rows for mb in mbs])
    assert sorted(seen.tolist()) == list(range(9))
    for mb in mbs:
        T = mb.input_ids.shape[1]
        assert mb.input_ids.shape[0] == 1 and T <= max_tokens
        assert T == max_tokens if pp > 1 else T == int(lengths[mb.layout.rows].sum())
        cu = mb.layout.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == T
        pos = mb.layout.position_ids()[0]
        for i, r in enumerate(mb.layout.rows.tolist()):
            a, n = cu[i], int(lengths[r])
            assert cu[i + 1] - a == n
            assert torch.equal(mb.input_ids[0, a:a + n], ids[r, :n])
            assert torch.equal(mb.loss_mask[0, a:a + n - 1], mask[r, :n - 1])
            assert mb.loss_mask[0, a + n - 1] == 0
            assert torch.equal(pos[a:a + n], torch.arange(n))
        for k in payload:  # payload rows: the sequences' own rows
            assert torch.equal(mb.payload[k], payload[k][mb.layout.rows])
    # shifted per-token outputs come back to [B, L-1], zero past each end
    parts = [microbatch.unpack(mb, mb.input_ids[:, 1:].float()) for mb in mbs]
    back = microbatch.to_rows(mbs, parts, 9)
    real = torch.arange(9)[None] < (lengths[:, None] - 1)
    assert torch.equal(back, torch.where(real, ids[:, 1:].float(), torch.zeros(())))
    # aligned ([1, T]) outputs come back to [B, L]
    back = microbatch.to_rows(mbs, [microbatch.unpack(mb, mb.input_ids.float(), fill=-1.0)
                                    for mb in mbs], 9)
    real = torch.arange(10)[None] < lengths[:, None]
    assert torch.equal(back, torch.where(real, ids.float(), torch.full((), -1.0)))


def test_unpack_passes_gradients_to_packed_positions():
    ids, mask, payload, lengths = _rows(B=5, seed=2)
    mb = microbatch.make_micro_batches(ids, mask, payload, max_tokens=100, lengths=lengths)[0]
    x = torch.randn(1, mb.input_ids.shape[1] - 1, requires_grad=True)
    w = torch.randn(5, 9)
    (microbatch.unpack(mb, x) * w).sum().backward()
    expect = torch.zeros_like(x)
    for i, r in enumerate(mb.layout.rows.tolist()):
        a = int(mb.layout.cu_seqlens[i])
        n = int(lengths[r]) - 1
        expect[0, a:a + n] = w[i, :n]
    assert torch.equal(x.grad, expect)


def test_pack_bins_first_fit_decreasing():
    rnd = random.Random(0)
    for _ in range(50):
        lengths = [rnd.randint(1, 20) for _ in range(rnd.randint(1, 30))]
        budget = rnd.randint(20, 60)
        bins = microbatch.pack_bins(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= budget for b in bins)
        # first fit: no two bins could be merged into one
        loads = sorted(sum(lengths[i] for i in b) for b in bins)
        assert len(loads) < 2 or loads[0] + loads[1] > budget


def test_errors_name_the_problem():
    ids, mask, _, lengths = _rows()
    with pytest.raises(ValueError, match="exactly one of micro_batch_size / max_tokens"):
        microbatch.make_micro_batches(ids, mask)
    with pytest.raises(ValueError, match="needs `lengths`"):
        microbatch.make_micro_batches(ids, mask, max_tokens=20)
    with pytest.raises(ValueError, match=r"max_tokens=5 is below the longest sequence"):
        microbatch.make_micro_batches(ids, mask, max_tokens=5, lengths=lengths)
    r = int((lengths < ids.shape[1]).nonzero()[0])
    bad = mask.clone()
    bad[r, int(lengths[r]) - 1] = 1.0
    with pytest.raises(ValueError, match=f"loss_mask row {r} counts a prediction"):
        microbatch.make_micro_batches(ids, bad, max_tokens=20, lengths=lengths)


def test_packed_attention_is_block_diagonal_causal():
    """Packed attention == one SDPA call over the whole row with an explicit block-diagonal
    causal mask (K/V repeated by hand for GQA)."""
    from megaprm.models.attention import packed_attention

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 8, generator=g)
    k, v = torch.randn(16, 2, 8, generator=g), torch.randn(16, 2, 8, generator=g)
    doc = torch.repeat_interleave(torch.arange(4), cu[1:] - cu[:-1])
    pos = torch.arange(16)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qs, ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1), attn_mask=allowed)
    got = packed_attention(q, k, v, cu, scale=8 ** -0.5)  # [t, np, hn]
    assert torch.allclose(got, ref[0].transpose(0, 1), atol=1e-6)


def test_token_batch_defaults_keep_right_padded_rows():
    mb = pipeline.TokenBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))
    assert mb.layout is None and microbatch.unpack(mb, mb.loss_mask) is mb.loss_mask
