"""The step's metrics beyond the update's: rollout, reward and PRM statistics with the
sampler-vs-trainer log-prob guard, a few samples per step to samples.jsonl, and the drift
warning."""
from __future__ import annotations

import json
import os

import torch

from megaprm.algorithms.registry import AdvantageOutputs
from megaprm.config import Config
from megaprm.trainer.rl.batch import ScoredBatch
from megaprm.trainer.rl.reward_phase import oracle_step_scores

# on the mean |sampler - trainer| over response tokens: fp32 engines agree to ~1e-6; in bf16 the
# max alone reaches 0.09-0.57 from rounding (H200, the demo's model: docs/rollout.md), the mean
# stays far below this; a wrong temperature or stale weights move every token
LOGPROB_DIFF_WARN = 1e-2


def rollout_metrics(cfg: Config, temperature: float, sb: ScoredBatch, adv: AdvantageOutputs,
                    logp_old, logp_sampler) -> dict:
    """Rank-local means (averaged over dp by `fit`) and the sampler-vs-trainer guard.
    temperature: the update's log-prob temperature (`run_config.logprob_temperature`).
    logp_old [B, R]: the actor's at the log-prob temperature (what the update uses);
    logp_sampler [B, R]: the actor's at the sampling temperature (what the guard compares
    with the engine's; the same tensor when the two temperatures agree)."""
    b = sb.rollout
    lens = b.response_lengths.float()
    mask = b.response_mask.float()
    diff = (b.sampler_logprobs - logp_sampler).abs() * mask
    m = {"reward/outcome_mean": float(sb.outcome.mean()),
         "response/length_mean": float(lens.mean()),
         "response/length_max": float(lens.max()),
         "response/length_min": float(lens.min()),
         "response/truncated_frac": float(sum(r == "length" for r in b.finish_reason)
                                          / max(1, b.batch_size)),
         "response/steps_mean": float(sb.seg.num_steps.float().mean()),
         "response/tokens_per_step": float(lens.sum() / sb.seg.num_steps.sum().clamp(min=1)),
         "filter/keep_frac": float(adv.keep.float().mean()),
         "rollout/sampler_logprob_mean": float((b.sampler_logprobs * mask).sum()
                                               / mask.sum().clamp(min=1)),
         "rollout/trainer_logprob_mean": float((logp_sampler * mask).sum()
                                               / mask.sum().clamp(min=1)),
         # the two temperatures: sampling (engine, guard) and log-probs (the update)
         "rollout/sampling_temperature": float(cfg.rollout.temperature),
         "rollout/logprob_temperature": float(temperature),
         "rollout/update_logprob_mean": float((logp_old * mask).sum()
                                              / mask.sum().clamp(min=1)),
         # verl's training/rollout_probs_diff: the engine and the trainer must agree
         "rollout/logprob_diff_mean": float(diff.sum() / mask.sum().clamp(min=1)),
         "rollout/logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
         }
    if sb.correct_with_wrong_step is not None:
        correct = sb.outcome > 0.5
        m["exact/correct_with_wrong_step_frac"] = float(
            sb.correct_with_wrong_step[correct].float().mean()) if correct.any() else 0.0
    if sb.step_scores is not None:
        s, smask = sb.step_scores, sb.step_mask
        min_score = torch.where(smask, s, torch.ones_like(s)).min(1).values
        prm_ok = min_score >= cfg.prm.low_score
        correct = sb.outcome > 0.5
        m["prm/score_mean"] = float(s[smask].mean()) if smask.any() else 0.0
        m["prm/outcome_agreement"] = float((prm_ok == correct).float().mean())
        m["prm/correct_with_low_prm_frac"] = float(
            (~prm_ok[correct]).float().mean()) if correct.any() else 0.0
    if sb.q is not None:
        m["prm/implicit_q_mean"] = float(sb.q.sum() / b.response_mask.sum().clamp(min=1))
    if sb.checks is not None:
        m.update(step_aurocs(sb))
    m.update(adv.metrics)
    return m


AUROC_KEYS = ("prm/step_auroc", "prm/implicit_step_auroc")


def step_aurocs(sb: ScoredBatch) -> dict:
    """How well the batch's process scores rank its steps against the exact labels (the
    arithmetic task's checker), as the Mann-Whitney counts `KEY_u` (pairs of a correct and a
    wrong step where the correct one scores higher, ties half) and `KEY_pairs` (all such pairs)
    of this rank, which the dp reduction averages alike; `finish_aurocs` turns them into the
    AUROC `KEY` = u / pairs after it (absent where no pair was seen: a batch with no wrong step
    or no right one). `prm/step_auroc`: the discriminative PRM's P(step correct);
    `prm/implicit_step_auroc`: PRIME's implicit PRM, a step's score being the sum of its
    tokens' q = log pi_prm - log pi_ref (beta > 0 scales every score alike, so the ranking is
    beta's); only rows the implicit PRM scored (the accuracy filter's rows: the others have
    q = 0)."""
    from megaprm.trainer.prm_training import step_auroc  # deferred: the PRM trainer is heavy

    seg = sb.seg
    B, S = seg.step_mask.shape
    labels = oracle_step_scores(sb.checks, seg.step_mask)[0].bool()  # the exact labels [B, S]

    def counts(key, scores, good):
        pairs = float(int(good.sum()) * int((~good).sum()))
        return {f"{key}_u": step_auroc(scores, good) * pairs if pairs else 0.0,
                f"{key}_pairs": pairs}

    out = {}
    if sb.step_scores is not None and sb.step_mask is not None \
            and sb.step_scores.shape == labels.shape:
        sel = sb.step_mask & seg.step_mask
        out.update(counts(AUROC_KEYS[0], sb.step_scores[sel].float(), labels[sel]))
    if sb.q is not None:
        slot = torch.where(seg.token_to_step >= 0, seg.token_to_step, S)
        step_q = torch.zeros(B, S + 1, dtype=torch.float64).scatter_add_(
            1, slot, sb.q.double())[:, :S]
        sel = seg.step_mask & (sb.q != 0).any(1, keepdim=True)
        out.update(counts(AUROC_KEYS[1], step_q[sel], labels[sel]))
    return out


def finish_aurocs(metrics: dict) -> dict:
    """`metrics` (reduced over dp) with each AUROC's counts replaced by the AUROC u / pairs,
    left out where no pair of a right and a wrong step was seen (`step_aurocs`)."""
    for key in AUROC_KEYS:
        u, pairs = metrics.pop(f"{key}_u", None), metrics.pop(f"{key}_pairs", None)
        if pairs:
            metrics[key] = u / pairs
    return metrics


def log_samples(run_dir: str, n: int, rank: int, tok, step: int, sb: ScoredBatch) -> None:
    """The first `n` generations of the step to run_dir/samples.jsonl (rank 0's rollouts)."""
    if rank != 0 or n <= 0:
        return
    b = sb.rollout
    texts = b.decode_responses(tok)
    prompts = b.decode_prompts(tok, skip_special_tokens=True)
    with open(os.path.join(run_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
        for i in range(min(n, b.batch_size)):
            row = {"step": step, "prompt": prompts[i], "response": texts[i],
                   "outcome": float(sb.outcome[i]), "finish_reason": b.finish_reason[i]}
            if sb.step_scores is not None:
                k = int(sb.seg.num_steps[i])
                row["step_scores"] = [round(float(x), 4) for x in sb.step_scores[i, :k]]
            f.write(json.dumps(row) + "\n")


def warn_on_drift(rank: int, step: int, metrics: dict) -> None:
    """The engine and the trainer disagree on the sampled tokens' log-probs: a wrong
    temperature, stale engine weights, or a numerics problem (docs/rollout.md)."""
    d = metrics.get("rollout/logprob_diff_mean")
    if metrics.get("rollout/staleness_max", 0.0) > 0:  # stale samples differ by design
        return
    if d is not None and d > LOGPROB_DIFF_WARN and rank == 0:
        print(f"[megaprm] warning: step {step}: sampler vs trainer log-prob mean |diff| "
              f"{d:.3g} > {LOGPROB_DIFF_WARN} (max {metrics.get('rollout/logprob_diff_max', 0):.3g};"
              " see docs/rollout.md)", flush=True)

