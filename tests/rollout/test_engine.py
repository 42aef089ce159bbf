"""The engine contract: SamplingParams validation, RolloutBatch layouts and helpers."""
import pytest
import torch

from megaprm.rollout.engine import RolloutBatch, SamplingParams, left_pad


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("max_tokens", 0), ("stop_token_ids", (3, -1)), ("seed", -2)])
def test_sampling_params_errors_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_and_greedy():
    p = SamplingParams(stop_token_ids=[4, 5])
    assert p.stop_token_ids == (4, 5) and not p.greedy and SamplingParams(temperature=0).greedy


def test_left_pad_groups_contiguously():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_token_id=0, repeat=2)
    assert ids.tolist() == [[1, 2, 3], [1, 2, 3], [0, 0, 4], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        left_pad([[1], []], 0)


def _batch():
    # prompts [7, 8, 9] and [5], responses [10, 11, EOS=1] and [12] (length-limited at R=3)
    return RolloutBatch(
        prompt_ids=torch.tensor([[7, 8, 9], [0, 0, 5]]),
        prompt_mask=torch.tensor([[1, 1, 1], [0, 0, 1]]),
        response_ids=torch.tensor([[10, 11, 1], [12, 0, 0]]),
        response_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]),
        sampler_logprobs=torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]]),
        finish_reason=["stop", "length"], group_index=torch.tensor([0, 1]), pad_token_id=0)


def test_to_right_padded_puts_real_prompt_first():
    rp = _batch().to_right_padded()
    assert rp.input_ids.tolist() == [[7, 8, 9, 10, 11, 1], [5, 12, 0, 0, 0, 0]]
    assert rp.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert rp.response_mask.tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 0, 0, 0, 0]]
    assert rp.response_start.tolist() == [3, 1]
    # position t predicts t + 1: the loss mask is the response mask shifted left by one
    assert rp.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]
    token_aligned = rp.input_ids.float() * 10
    assert rp.to_response(token_aligned, 3).tolist() == [[100, 110, 10], [120, 0, 0]]


def test_to_right_padded_equals_a_per_row_loop():
    """Random ragged batches (empty responses, full-width prompts) against the per-row copy."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        b, p, r = (int(torch.randint(1, 7, (), generator=g)) for _ in range(3))
        plen = torch.randint(1, p + 1, (b,), generator=g)
        rlen = torch.randint(0, r + 1, (b,), generator=g)
        pmask = (torch.arange(p)[None] >= p - plen[:, None]).long()
        rmask = (torch.arange(r)[None] < rlen[:, None]).long()
        batch = RolloutBatch(
            prompt_ids=torch.randint(2, 50, (b, p), generator=g) * pmask,
            prompt_mask=pmask, response_ids=torch.randint(2, 50, (b, r), generator=g) * rmask,
            response_mask=rmask, sampler_logprobs=torch.zeros(b, r),
            finish_reason=["length"] * b, group_index=torch.arange(b), pad_token_id=0)
        rp = batch.to_right_padded(pad_token_id=99)
        length = int((plen + rlen).max())
        ids = torch.full((b, length), 99)
        attn, resp = torch.zeros(b, length, dtype=torch.long), torch.zeros(b, length, dtype=torch.long)
        for i in range(b):
            pl, rl = int(plen[i]), int(rlen[i])
            ids[i, :pl] = batch.prompt_ids[i, p - pl:]
            ids[i, pl:pl + rl] = batch.response_ids[i, :rl]
            attn[i, :pl + rl] = 1
            resp[i, pl:pl + rl] = 1
        assert torch.equal(rp.input_ids, ids) and torch.equal(rp.attention_mask, attn)
        assert torch.equal(rp.response_mask, resp) and torch.equal(rp.response_start, plen)


def test_decode_with_a_tokenizer():
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    b = _batch()
    texts = b.decode_responses(tok)
    assert len(texts) == 2 and texts[0] == tok.decode([10, 11]) and texts[1] == tok.decode([12])
    assert b.decode_prompts(tok)[1] == tok.decode([5])
    assert b.response_token_lists() == [[10, 11, 1], [12]]
