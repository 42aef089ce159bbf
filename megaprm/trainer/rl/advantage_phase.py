"""Phase: advantages, the estimator of `advantage.method` from the registry (group statistics
reduced over the dp host group)."""
from __future__ import annotations

from typing import Optional

import torch

from megaprm.algorithms.registry import (
    AdvantageConfig,
    AdvantageInputs,
    AdvantageOutputs,
    compute_advantages,
)
from megaprm.parallel import pipeline
from megaprm.trainer.rl.batch import ScoredBatch


def advantages(cfg: AdvantageConfig, seed: int, host_dp, sb: ScoredBatch,
               logp_old_resp: Optional[torch.Tensor],
               logp_ref_resp: Optional[torch.Tensor]) -> AdvantageOutputs:
    """Phase: estimator from the registry; group statistics reduced over `host_dp` (the dp
    host group, None on one rank). logp_old_resp, logp_ref_resp [B, R] or None; `seed`:
    trainer.seed (with the batch's first group, the estimator's random draws)."""
    b = sb.rollout
    q_prm = q_ref = None
    if sb.q is not None:  # the registry takes log-probs; q = logp_prm - logp_ref
        q_prm, q_ref = sb.q, torch.zeros_like(sb.q)
    inputs = AdvantageInputs(
        outcome=sb.outcome.float(), group_ids=sb.group_ids,
        response_mask=b.response_mask.float(),
        process_step_scores=sb.step_scores,
        step_mask=sb.step_mask if sb.step_scores is not None else None,
        step_end_index=sb.seg.step_end_index, token_to_step=sb.seg.token_to_step,
        num_steps=sb.prof_steps if sb.prof_steps is not None else sb.seg.num_steps,
        logp_prm=q_prm, logp_ref=q_ref if q_prm is not None else logp_ref_resp,
        logp_old=logp_old_resp)
    gen = torch.Generator().manual_seed(seed + int(sb.group_ids.min()))
    return compute_advantages(cfg, inputs, group=pipeline.optional_group(host_dp),
                              generator=gen)
