"""The sampler-vs-trainer drift warning reads the mean |diff| over response tokens: a bf16 run's
max reaches 0.1-0.6 from rounding alone (H200, the demo's model, mean 1.6-1.9e-3:
scripts/results/gpu_h200/metrics_*.jsonl), while a wrong temperature or stale weights move
every token's log-prob."""
import pytest

from megaprm.trainer.rl import step_metrics


def _warned(capsys, rank=0, **metrics) -> str:
    step_metrics.warn_on_drift(rank, 3, metrics)
    return capsys.readouterr().out


def test_bf16_rounding_max_alone_does_not_warn(capsys):
    # the H200 demo's step 1 (grpo): mean 1.93e-3, max 0.571
    assert _warned(capsys, **{"rollout/logprob_diff_mean": 1.93e-3,
                              "rollout/logprob_diff_max": 0.571}) == ""


def test_a_mean_above_the_threshold_warns_once_on_rank_0(capsys):
    m = {"rollout/logprob_diff_mean": 0.05, "rollout/logprob_diff_max": 0.9}
    out = _warned(capsys, **m)
    assert "step 3" in out and "mean |diff| 0.05 > 0.01" in out and "max 0.9" in out
    assert out.count("\n") == 1
    assert _warned(capsys, rank=1, **m) == ""


def test_stale_samples_never_warn(capsys):
    assert _warned(capsys, **{"rollout/logprob_diff_mean": 0.5, "rollout/logprob_diff_max": 2.0,
                              "rollout/staleness_max": 1.0}) == ""


def _pairwise_auroc(good, bad):
    """P(good > bad) + half P(tie), over every pair: the definition, as a loop."""
    wins = sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
    return wins / (len(good) * len(bad))


def test_step_aurocs_rank_the_batch_steps_against_the_exact_labels():
    """The per-step monitors `prm/step_auroc` (discriminative P(good)) and
    `prm/implicit_step_auroc` (PRIME: a step's summed token q) against the arithmetic checker's
    labels, on real step segmentation of tokenised solutions, checked by a pairwise loop; rows
    the implicit PRM did not score (q = 0 everywhere: filtered out) are left out."""
    import random

    import torch

    from megaprm.rewards.steps import segment_steps, separator_token_ids
    from megaprm.tasks.arithmetic import (
        ArithmeticConfig,
        check_steps,
        corrupt_solution,
        generate_problems,
        reference_solution,
    )
    from megaprm.tasks.tokenizer import build_char_tokenizer
    from megaprm.trainer.rl.batch import ScoredBatch

    tok = build_char_tokenizer()
    rng = random.Random(0)
    probs = generate_problems(ArithmeticConfig(num_ops=(3, 5)), 12, seed=5)
    texts = [reference_solution(p) if i % 3 == 0 else
             corrupt_solution(p, rng, ("wrong_result", "wrong_operand")[i % 2])
             for i, p in enumerate(probs)]
    ids = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    R = max(map(len, ids))
    resp = torch.tensor([x + [tok.pad_token_id] * (R - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (R - len(x)) for x in ids])
    seg = segment_steps(resp, mask, separator_token_ids(tok))
    checks = [check_steps(p, t) for p, t in zip(probs, texts)]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(resp.shape, generator=gen) * mask
    q[5] = 0.0  # a row the accuracy filter dropped: never scored
    S = seg.step_mask.shape[1]
    scores = torch.rand(len(probs), S, generator=gen)
    sb = ScoredBatch(rollout=None, outcome=torch.zeros(len(probs)), group_ids=None, seg=seg,
                     step_scores=scores, q=q, step_mask=seg.step_mask, checks=checks)
    got = step_metrics.finish_aurocs(step_metrics.step_aurocs(sb))

    disc, imp = ([], []), ([], [])
    for i, c in enumerate(checks):
        n = int(seg.num_steps[i])
        assert n == len(c.step_correct)
        for k in range(n):
            tokens = (seg.token_to_step[i] == k)
            summed = float(q[i][tokens].sum())
            bucket = 0 if c.step_correct[k] else 1
            disc[bucket].append(float(scores[i, k]))
            if i != 5:
                imp[bucket].append(summed)
    assert disc[1] and imp[1]  # wrong steps are there
    assert got["prm/step_auroc"] == pytest.approx(_pairwise_auroc(*disc))
    assert got["prm/implicit_step_auroc"] == pytest.approx(_pairwise_auroc(*imp))
    # a PRM that knows the labels ranks them perfectly
    exact = torch.zeros(len(probs), S)
    for i, c in enumerate(checks):
        exact[i, :len(c.step_correct)] = torch.tensor(c.step_correct, dtype=torch.float32)
    perfect = step_metrics.finish_aurocs(step_metrics.step_aurocs(ScoredBatch(
        None, sb.outcome, None, seg, step_scores=exact, step_mask=seg.step_mask,
        checks=checks)))
    assert perfect == {"prm/step_auroc": 1.0}
    # no wrong step in the batch: counts of 0 pairs, and no AUROC after the reduction (never
    # a nan, which no two runs compare equal on); two ranks' counts pool by their mean
    right = [c for c in checks if all(c.step_correct)]
    rows = [i for i, c in enumerate(checks) if all(c.step_correct)]
    only_right = ScoredBatch(None, sb.outcome[rows], None, type(seg)(
        **{k: getattr(seg, k)[rows] for k in seg.__dataclass_fields__}),
        step_scores=scores[rows], step_mask=seg.step_mask[rows], checks=right)
    counts = step_metrics.step_aurocs(only_right)
    assert counts == {"prm/step_auroc_u": 0.0, "prm/step_auroc_pairs": 0.0}
    assert step_metrics.finish_aurocs(dict(counts)) == {}
    a, b = step_metrics.step_aurocs(sb), step_metrics.step_aurocs(only_right)
    mean = {k: (a[k] + b.get(k, 0.0)) / 2 for k in a}  # what dp_metrics makes of two ranks
    assert step_metrics.finish_aurocs(mean)["prm/step_auroc"] == pytest.approx(
        got["prm/step_auroc"])
