"""Phase: the log-probs of the sampled tokens before the update (the actor's pi_old, the
reference's), and after it the monitor's (sampler vs trainer).

Temperatures: the actor's old/new log-probs, entropy and KL and the reference's log-probs are
taken at one temperature (`run_config.logprob_temperature`, from `actor.logprob_temperature`):
the rollout's by default, as verl's actor does, or PURE's released T = 1 while sampling at 0.5.
Old and new share it, so the PPO ratio of the first mini-batch is exactly 1 either way. The
monitor (and the off-policy correction) compare with the engine at the sampling temperature:
when the two differ, both come from the same forward (`Policy.logprobs(also_at=...)`).

Reuse: when the batch gets exactly one optimiser step (one mini-batch, one epoch) on-policy (the
engine holds the actor's current weights), pi_old is the policy the update's own forward
evaluates, so the ratio is 1 by construction: the update takes `detach()` of its new log-probs
as the old ones (TRL's GRPOTrainer does the same in its loss when num_iterations is 1 and one
generation feeds one optimiser step, grpo_trainer.py `_compute_loss`) and the forward before it
is skipped. The monitor then reads the update forward's log-probs (before its step: the same
policy). Shapes: B rows, R response tokens, L = prompt+response tokens (right-padded)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megaprm.rollout.engine import RightPadded
from megaprm.trainer.rl.batch import UpdateResult
from megaprm.trainer.rl.policy import Policy, targets_to_response


@dataclass
class LogProbs:
    """The actor's and the reference's log-probs of one batch `rp` (lengths [B], `width` = R).
    Target layout [B, L-1] (index t is input token t+1), on the host.

    old_t: the actor's at the update's temperature (pi_old of the PPO ratio);
    sampler_t: the actor's at the sampling temperature (the monitor's and the correction's; the
        same tensor when the temperatures agree);
    ref_t: the reference's at the update's temperature (None without a reference model).
    Before a reusing update (`reuses_new_logprobs`) old_t and sampler_t are None; `after_update`
    fills them from the update's forward."""

    rp: RightPadded
    lengths: torch.Tensor
    width: int
    old_t: Optional[torch.Tensor]
    sampler_t: Optional[torch.Tensor]
    ref_t: Optional[torch.Tensor]

    def response(self, values_t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Target-layout values [B, L-1] of this batch in the response layout [B, R]."""
        return None if values_t is None else targets_to_response(values_t, self.rp, self.width)


def reuses_new_logprobs(cfg, temperature: float, on_policy: bool = True) -> bool:
    """True when the old-log-prob forward equals the update's own (its detach is used instead):
    one mini-batch, on-policy, no estimator reads logp_old before the update (PURE's KL reward
    does) and the update's temperature is the sampler's (the monitor compares at the latter)."""
    a = cfg.advantage
    return (cfg.actor.mini_batches == 1 and on_policy
            and not (a.method == "pure" and a.pure.kl_coef)
            and temperature == float(cfg.rollout.temperature))


def before_update(actor: Policy, ref: Optional[Policy], rp: RightPadded, width: int, *,
                  sampler_temperature: float, reuse: bool) -> LogProbs:
    """Phase: the actor's log-probs at its temperature (`actor.temperature`) and at the
    sampler's (one forward), unless `reuse`; the reference's (when there is one)."""
    lengths = rp.attention_mask.long().sum(1)
    old_t = sampler_t = None
    if reuse:
        pass
    elif actor.temperature == sampler_temperature:
        old_t = sampler_t = actor.logprobs(rp.input_ids, lengths)
    else:
        old_t, sampler_t = actor.logprobs(rp.input_ids, lengths, also_at=sampler_temperature)
    ref_t = ref.logprobs(rp.input_ids, lengths) if ref is not None else None
    return LogProbs(rp, lengths, width, old_t, sampler_t, ref_t)


def after_update(lp: LogProbs, update: UpdateResult, actor: Policy,
                 order: Optional[torch.Tensor]) -> LogProbs:
    """`lp` complete after the update: a reusing update's own forward (rows back from the
    update's `order`) as pi_old and the monitor's log-probs; when no mini-batch had a valid
    token anywhere nothing moved, and one forward now gives them."""
    if lp.old_t is not None:
        return lp
    seen = update.logprobs_t
    if seen is None:
        seen = actor.logprobs(lp.rp.input_ids, lp.lengths)
    elif order is not None:
        seen = seen[order.argsort()]
    return LogProbs(lp.rp, lp.lengths, lp.width, seen, seen, lp.ref_t)
