"""PRM input layout and step-score math against slow, obvious loops (random shapes and seeds).

The model side (any tp/pp vs transformers) is tests/models/test_prm.py.
"""
import pytest
import torch

from megaprm.models.prm import (gather_positions, head_step_scores, implicit_step_scores,
                                implicit_token_rewards)
from megaprm.rewards.scoring import PRMInputFormat, batch_from_rollouts, micro_batches

SEP, MARK = 4, 5


def _random_rollouts(seed, B=6, P=7, T=15):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(6, 30, (B, P), generator=g)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    response_ids = torch.randint(6, 30, (B, T), generator=g)
    response_ids[torch.rand(B, T, generator=g) < 0.25] = SEP
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        n_p = int(torch.randint(1, P + 1, (1,), generator=g))
        n_r = int(torch.randint(0 if i == 0 else 1, T + 1, (1,), generator=g))
        prompt_mask[i, P - n_p:] = True  # left-padded prompt
        response_mask[i, :n_r] = True     # right-padded response
    return prompt_ids, prompt_mask, response_ids, response_mask


def _loop_layout(prompt_ids, prompt_mask, response_ids, response_mask, marker):
    """Per row: PRM input ids and the positions of each step's closing token, by hand."""
    rows = []
    for i in range(prompt_ids.shape[0]):
        prompt = prompt_ids[i][prompt_mask[i]].tolist()
        resp = response_ids[i][response_mask[i]].tolist()
        ends = [t for t, tok in enumerate(resp) if tok == SEP or t == len(resp) - 1]
        if marker is not None:
            resp = [marker if t in ends else tok for t, tok in enumerate(resp)]
        rows.append((prompt + resp, [len(prompt) + t for t in ends]))
    return rows


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("marker", [None, MARK])
def test_prm_batch_matches_loop(seed, marker):
    rollouts = _random_rollouts(seed)
    batch, seg = batch_from_rollouts(*rollouts, {SEP}, PRMInputFormat(marker), pad_id=0)
    for i, (ids, ends) in enumerate(_loop_layout(*rollouts, marker)):
        assert batch.lengths[i] == len(ids)
        assert batch.input_ids[i, : len(ids)].tolist() == ids
        assert (batch.input_ids[i, len(ids):] == 0).all()
        assert batch.step_mask[i].sum() == len(ends)
        assert batch.score_index[i, : len(ends)].tolist() == ends
        assert seg.num_steps[i] == len(ends)


def test_micro_batches_pad_rows_for_pipeline():
    batch, _ = batch_from_rollouts(*_random_rollouts(0, B=5), {SEP}, PRMInputFormat())
    labels = torch.ones_like(batch.step_mask, dtype=torch.long)
    mbs = micro_batches(batch, 2, pp=2, labels=labels)
    assert [mb.input_ids.shape[0] for mb in mbs] == [2, 2, 2]
    assert not mbs[-1].payload[1][1].any()  # the padding row has no steps
    assert [mb.input_ids.shape[0] for mb in micro_batches(batch, 2, pp=1)] == [2, 2, 1]


@pytest.mark.parametrize("head", ["token_cls", "prm_mlp"])
def test_head_step_scores(head):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 9, 2, generator=g)
    mask = torch.rand(4, 9, generator=g) < 0.7
    out = head_step_scores(logits, mask, head, keep_logits=True)
    for i in range(4):
        for k in range(9):
            p0, p1 = torch.softmax(logits[i, k], -1).tolist()
            expected = (p1 - p0 if head == "token_cls" else p1) if mask[i, k] else 0.0
            assert abs(float(out.scores[i, k]) - expected) < 1e-6
    assert torch.equal(out.logits, logits)


def test_gather_positions():
    x = torch.randn(3, 8, 2)
    index = torch.tensor([[0, 7], [3, 3], [5, 1]])
    out = gather_positions(x, index)
    for i in range(3):
        for k in range(2):
            assert torch.equal(out[i, k], x[i, index[i, k]])


@pytest.mark.parametrize("seed", range(3))
def test_implicit_step_scores_sum_q_over_each_step(seed):
    rollouts = _random_rollouts(seed)
    _, _, response_ids, response_mask = rollouts
    _, seg = batch_from_rollouts(*rollouts, {SEP}, PRMInputFormat())
    g = torch.Generator().manual_seed(seed)
    lp_a, lp_b = torch.randn(2, *response_ids.shape, generator=g)
    q = implicit_token_rewards(lp_a, lp_b, response_mask)
    steps = implicit_step_scores(q, seg.token_to_step, seg.step_mask)
    for i in range(response_ids.shape[0]):
        n = int(response_mask[i].sum())
        assert torch.allclose(q[i, :n], lp_a[i, :n] - lp_b[i, :n])
        assert (q[i, n:] == 0).all()
        sums, acc = [], 0.0
        for t in range(n):  # a step closes at a separator or at the last token
            acc += float(q[i, t])
            if int(response_ids[i, t]) == SEP or t == n - 1:
                sums.append(acc)
                acc = 0.0
        assert steps.step_mask[i].sum() == len(sums)
        assert torch.allclose(steps.scores[i, : len(sums)], torch.tensor(sums), atol=1e-5)


def test_input_format_round_trips_through_hf_config():
    for fmt in (PRMInputFormat(), PRMInputFormat(MARK)):
        assert PRMInputFormat.from_hf(fmt.to_hf()) == fmt
    assert PRMInputFormat.from_hf({"architectures": ["Qwen2ForTokenClassification"]}) \
        == PRMInputFormat()
