"""The RL step as named phases (ARCHITECTURE.md "One RL step"), each in its own module:

    rollout (rollout_source, refill) -> outcome and process reward (rewards) -> [agree]
    -> old/ref log-probs (skipped for the actor when it equals the update's, actor_update)
    -> implicit-PRM update + scores (implicit_prm, PRIME) -> advantages (+ filter)
    -> PPO update, all or nothing (actor_update) -> weight sync (rollout_source)
    -> metrics (step_metrics), evaluation (evaluate), checkpoints (resume)

Memory (trainer/lifecycle.py, verl's order): train -> wake the engine's weights -> sync (the end
of a step) -> offload the trainer's state (`*.offload`) -> wake the KV cache -> generate -> sleep
the engine -> reload (the rollout of the next).

Every rank runs the same code on its own data-parallel shard of the prompts; group statistics
are reduced over the dp group inside the estimators; the Megatron models run under tp/pp
through `parallel.pipeline`. Tensor shapes: B rollouts on this rank, R response tokens,
L = prompt+response tokens (right-padded), S steps.

Rules the phases keep:
* Device (parallel/device.py): models and their micro-batches on the rank's device, everything
  else (rollout batches, rewards, advantages, metrics) on the CPU; `pipeline.run` is the one
  crossing into the model, `Policy.logprobs` returns host tensors.
* Sampling distribution: the actor's old/new log-probs, entropy and KL and the reference's
  log-probs are taken at one temperature (`RLTrainer.temperature`, the one place that decides
  it, from `actor.logprob_temperature`): the rollout's by default, as verl's actor does, or
  PURE's released T = 1 while sampling at 0.5. Old and new share it, so the PPO ratio of the
  first mini-batch is exactly 1 either way; the sampler-vs-trainer guard always compares at the
  sampling temperature.
* Faults: a non-finite reward on any rank is agreed on by every rank (`agree`) before the next
  collective, so all skip the step; a non-finite loss or grad norm in any mini-batch rolls the
  whole update back (`Optimizer.all_or_nothing`), so a step is applied wholly or not at all
  and the rollout engine always holds the actor's weights.

The phase functions take the trainer as their first argument and are bound here as methods
(`RLTrainer.outcome_reward = rewards.outcome_reward`), so a test or a recipe can replace one
phase on one trainer.
"""
from __future__ import annotations

import os
import signal
import time
import uuid
from typing import List

import torch

from checkpoint_tools import model_source
from megaprm.config import Config, save_config, to_dict
from megaprm.models.hf_spec import spec_from_hf
from megaprm.parallel.device import resolve_dtype
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import agree, dp_metrics
from megaprm.trainer import (
    actor_update,
    advantages,
    correction,
    evaluate,
    implicit_prm,
    refill,
    resume,
    rewards,
    rollout_source,
    step_metrics,
)
from megaprm.trainer.batch import ScoredBatch, StepSkipped
from megaprm.trainer.data import (
    HELD_OUT_SEED,
    Prompts,
    encode_prompts,
    make_data,
    prompt_formatter,
)
from megaprm.trainer.metrics import MetricsLogger, PhaseTimer
from megaprm.trainer.policy import (
    Batching,
    Policy,
    _split,
    logprob_post,
    response_to_targets,
    targets_to_response,
)
from megaprm.trainer.run_config import (
    LOCK_ENV,
    config_digest_fields,
    logprob_temperature,
)

# names other modules and tests import from here (one place to find the trainer's vocabulary)
__all__ = [
    "HELD_OUT_SEED",
    "LOCK_ENV",
    "Batching",
    "Policy",
    "Prompts",
    "RLTrainer",
    "ScoredBatch",
    "StepSkipped",
    "_make_data",
    "_pick_groups",
    "_split",
    "config_digest_fields",
    "encode_prompts",
    "logprob_post",
    "logprob_temperature",
    "make_data",
    "mini_batch_order",
    "oracle_step_scores",
    "permute_rows",
    "prompt_formatter",
    "response_to_targets",
    "targets_to_response",
]
_make_data = make_data
mini_batch_order, permute_rows = actor_update.mini_batch_order, actor_update.permute_rows
oracle_step_scores, _pick_groups = rewards.oracle_step_scores, refill._pick_groups


class RLTrainer:
    """Builds the models for one rank and runs RL steps. `cfg.model.path`: the policy (an HF
    directory or a megaprm checkpoint); `cfg.prm.path`: the discriminative PRM."""

    def __init__(self, cfg: Config, groups: Groups, tokenizer):
        from megaprm.rewards.steps import separator_token_ids
        from megaprm.trainer.preflight import check_batch

        self.cfg, self.groups, self.tok = cfg, groups, tokenizer
        check_batch(cfg, groups.dp_size)
        self.lock = resume.lock_run_dir(cfg.trainer.run_dir, groups)
        if not cfg.trainer.resume:  # an earlier run there: refused, or moved aside (replace_run)
            from megaprm.trainer.checkpoint.run_dir import start_fresh

            start_fresh(cfg.trainer.run_dir, groups, replace=cfg.trainer.replace_run,
                        log=print if groups.rank == 0 else (lambda _m: None))
        self.run_id = uuid.uuid4().hex[:12]  # a resume takes the checkpoint's
        # the data first: a bad prompt file fails before any model is built
        self.data = make_data(cfg, tokenizer, log=print if groups.rank == 0 else None)
        self.src = model_source.resolve(cfg.model.path, "model.path")
        self.spec = spec_from_hf(self.src.hf_dir)
        self.spec.check_parallel(groups.tp_size, groups.pp_size)
        self.temperature = logprob_temperature(cfg)  # the one place: actor, ref, PURE's KL
        dtype = resolve_dtype(cfg.model.dtype)
        self.batching = Batching(cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch,
                                 groups.pp_size)
        # The engine first, then asleep: vLLM's start-up check wants utilisation x total memory
        # free, which the actor, reference and PRM would no longer leave; the first
        # `sync_weights` wakes its weights with the actor's.
        self.engine = rollout_source.build_engine(self)  # None: the rollout ranks hold it
        kw = dict(dtype=dtype, batching=self.batching,
                  build={"impl": cfg.model.impl, "compile": cfg.model.compile,
                         "recompute": cfg.model.recompute})
        self.actor = Policy(self.spec, groups, self.src, trainable=True, optim=cfg.actor.optim,
                            temperature=self.temperature, **kw)
        needs_ref = (cfg.actor.kl_coef or cfg.prm.kind == "implicit"
                     or (cfg.advantage.method == "pure" and cfg.advantage.pure.kl_coef))
        self.ref = (Policy(self.spec, groups, self.src, trainable=False,
                           temperature=self.temperature, **kw) if needs_ref else None)
        self.prm = self.implicit = None
        if cfg.prm.kind == "discriminative":
            rewards.build_discriminative_prm(self)
        elif cfg.prm.kind == "implicit":
            # PRIME: the implicit PRM starts from the policy and, with its reference, scores at
            # T = 1 (q = log pi_prm - log pi_ref of the sampled tokens; PRIME samples at T = 1)
            imp_src = model_source.resolve(cfg.prm.path or cfg.model.path, "prm.path")
            self.implicit = Policy(self.spec, groups, imp_src, trainable=True,
                                   optim=cfg.prm.optim, **kw)
            self.implicit_ref = (self.ref if self.temperature == 1.0 else
                                 Policy(self.spec, groups, self.src, trainable=False, **kw))
        self.grader = self.grader_tok = None
        if cfg.prm.kind == "judge":
            rewards.build_grader(self)
        # data position: block b = the b-th batch of prompts_per_step prompts. Without refill a
        # step uses block `step`; with refill a step uses one block per generation round and the
        # next unused block is trainer state (saved in checkpoints, so resume draws the same).
        self.next_block = 0
        self.requeue: list = []  # rollout.refill_surplus=requeue: global prompt ids to redo
        self.sep_ids = separator_token_ids(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.run_dir = cfg.trainer.run_dir
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        self.digest_fields = config_digest_fields(cfg)
        self.logger = MetricsLogger(self.run_dir, enabled=groups.rank == 0,
                                    wandb_mode=cfg.trainer.wandb, config=to_dict(cfg))
        if groups.rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
        self.skipped_steps = 0
        self.start_step = 0
        self.last_sync: dict = {}
        self.update_logprobs_t = None
        self.lifecycle, self.source = rollout_source.make_source(self)
        self.sync_weights()

    @staticmethod
    def tokenizer_dir(model_path: str) -> str:
        """Where the tokenizer of `model.path` lives (the HF dir, or a checkpoint's hf/)."""
        return model_source.resolve(model_path, "model.path").hf_dir

    # ------------------------------------------------------------------ the phases
    sync_weights = rollout_source.sync_weights
    _stream_weights = rollout_source.stream_weights
    rollout = rollout_source.rollout
    refill_rollout = refill.refill_rollout
    outcome_reward = rewards.outcome_reward
    process_reward = rewards.process_reward
    prime_prm = implicit_prm.prime_prm
    _prm_minibatch = implicit_prm._prm_minibatch
    advantages = advantages.advantages
    update_actor = actor_update.update_actor
    _update_minibatch = actor_update._update_minibatch
    evaluate = evaluate.evaluate_trainer
    save = resume.save
    maybe_resume = resume.maybe_resume

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        cfg, g = self.cfg, self.groups
        self._step = step
        t = PhaseTimer()
        t0 = time.perf_counter()
        fault = None
        refill_metrics: dict = {}
        self._judge_metrics = {}
        self._fallback_metrics = {}
        try:
            if cfg.rollout.refill == "none":
                self.next_block = step + 1
                with t("rollout"):
                    batch, prompts, group_ids = self.rollout(step)
                with t("outcome_reward"):
                    sb = self.outcome_reward(batch, prompts, group_ids)
            else:
                sb, refill_metrics = self.refill_rollout(t)
                batch = sb.rollout
            with t("process_reward"):
                self.process_reward(sb)
        except FloatingPointError as e:
            fault = str(e)
        fault = agree(fault, g)  # every rank skips, or none does
        if fault is not None:
            raise StepSkipped(fault)
        rp = batch.to_right_padded(self.pad)
        lengths = rp.attention_mask.long().sum(1)
        R = batch.response_ids.shape[1]
        # one update on-policy: the old log-probs are the update's own (actor_update's doc)
        stale = cfg.rollout.max_staleness > 0  # off-policy: pi_old recomputed, corrected
        reuse = actor_update.reuses_new_logprobs(cfg, self.temperature, on_policy=not stale)
        logp_old_t = logp_sampler_t = None
        with t("old_logprobs"):
            # the monitor compares with the sampler at its own temperature (PURE: T=0.5 while
            # the update's log-probs are at T=1), from the same forward
            sampler_t = cfg.rollout.temperature
            if reuse:
                pass
            elif self.temperature == sampler_t:
                logp_old_t = logp_sampler_t = self.actor.logprobs(rp.input_ids, lengths)
            else:
                logp_old_t, logp_sampler_t = self.actor.logprobs(rp.input_ids, lengths,
                                                                 also_at=sampler_t)
            logp_ref_t = (self.ref.logprobs(rp.input_ids, lengths) if self.ref is not None
                          else None)
        logp_old = None if reuse else targets_to_response(logp_old_t, rp, R)
        logp_ref = targets_to_response(logp_ref_t, rp, R) if logp_ref_t is not None else None
        prm_metrics = {}
        if self.implicit is not None:  # PRIME: train the PRM (filtered, mini-batched), score
            with t("prm_update"):
                imp_ref_t = (logp_ref_t if self.implicit_ref is self.ref
                             else self.implicit_ref.logprobs(rp.input_ids, lengths))
                prm_metrics = self.prime_prm(sb, rp, lengths, imp_ref_t)
        with t("advantages"):
            adv = self.advantages(sb, logp_old, logp_ref)
        drawn = getattr(batch, "row_versions", None)  # the weight version of each row
        lag = (self.source.version - drawn if drawn is not None
               else torch.zeros(rp.input_ids.shape[0], dtype=torch.long))
        off_metrics = {}
        if stale and cfg.rollout.correction != "none":  # correction.py: weights on advantages
            w, off_metrics = correction.tis_weights(
                targets_to_response(logp_sampler_t, rp, R), batch.sampler_logprobs,
                batch.response_mask.float(), cfg.rollout.tis_cap, cfg.rollout.correction)
            adv.advantages = adv.advantages * w
        adv_t = response_to_targets(adv.advantages, rp)
        # refill's top-up groups (the cap was hit) did not pass: no gradient from them
        keep = adv.keep if sb.passed is None else adv.keep & sb.passed
        update = (rp, adv_t, logp_old_t, logp_ref_t if cfg.actor.kl_coef else None, keep)
        order = None
        if cfg.actor.shuffle_mini_batches:
            order = mini_batch_order(rp.input_ids.shape[0], cfg.trainer.seed, step, g.dp_rank)
            update = permute_rows(update, order)
        with t("update"):
            update_metrics = self.update_actor(*update)
        if reuse:  # the monitor reads the update forward's log-probs (before its one step)
            logp_sampler_t = self.update_logprobs_t
            if logp_sampler_t is None:  # no valid token anywhere: nothing moved, forward now
                logp_sampler_t = self.actor.logprobs(rp.input_ids, lengths)
            elif order is not None:
                logp_sampler_t = logp_sampler_t[order.argsort()]
            logp_old = targets_to_response(logp_sampler_t, rp, R)
        logp_sampler = targets_to_response(logp_sampler_t, rp, R)
        off_metrics.update(correction.lag_metrics(lag, logp_sampler, batch.sampler_logprobs,
                                                  batch.response_mask.float()))
        metrics = {**step_metrics.rollout_metrics(self, sb, adv, logp_old, logp_sampler),
                   **off_metrics,
                   **prm_metrics, **refill_metrics, **self._judge_metrics,
                   **self._fallback_metrics, **update_metrics}
        with t("weight_sync"):
            self.sync_weights()
        metrics.update(self.last_sync)
        metrics.update(t.times)
        elapsed = time.perf_counter() - t0
        tokens = float(batch.response_mask.sum() + batch.prompt_mask.sum())
        metrics["timing/step_s"] = elapsed
        # the sum over dp of each rank's tokens / s once step_or_skip takes the dp mean (no
        # collective of its own)
        metrics["throughput/tokens_per_s"] = tokens * g.dp_size / max(elapsed, 1e-9)
        step_metrics.log_samples(self, step, sb)
        return metrics

    def step_or_skip(self, step: int) -> dict:
        """One step's metrics, the same on every rank: the rank-local ones reduced over dp in
        one all-reduce (`host.dp_metrics`: maxima as maxima, minima as minima, the rest
        averaged), the update's already global; or {'guard/skipped': 1} when every rank agreed
        to skip."""
        try:
            metrics = self.step(step)
            metrics = {**dp_metrics({k: v for k, v in metrics.items()
                                     if not k.startswith("actor/")}, self.groups),
                       **{k: v for k, v in metrics.items() if k.startswith("actor/")}}
        except StepSkipped as e:  # agreed on by every rank; nothing was applied
            self.actor.opt.zero_grad()
            self.skipped_steps += 1
            metrics = {"guard/skipped": 1.0}
            if self.groups.rank == 0:
                print(f"[megaprm] step {step} skipped: {e}", flush=True)
        metrics["guard/skipped_total"] = float(self.skipped_steps)
        return metrics

    # ------------------------------------------------------------------ the run
    def fit(self, on_step=None) -> List[dict]:
        from tqdm import tqdm

        cfg, g = self.cfg.trainer, self.groups
        start = self.maybe_resume()
        if start == 0:  # a fresh start (or a kill before the first checkpoint): no old rows
            self.logger.truncate_after(-1)
        crash_at = int(os.environ.get("MEGAPRM_CRASH_DURING_SAVE_AT", "-1"))  # tests only
        kill_at = os.environ.get("MEGAPRM_KILL_AT", "")  # tests only: "step:after_log|after_save"
        history = []
        bar = tqdm(range(start, cfg.steps), desc=f"RL {self.cfg.advantage.method}",
                   disable=not (cfg.progress and g.rank == 0), initial=start, total=cfg.steps)
        for step in bar:
            metrics = self.step_or_skip(step)
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
                metrics.update(self.evaluate())
            step_metrics.warn_on_drift(self, step, metrics)
            self.logger.log(step, metrics)
            if kill_at == f"{step}:after_log":
                os.kill(os.getpid(), signal.SIGKILL)
            history.append(metrics)
            bar.set_postfix(reward=f"{metrics.get('reward/outcome_mean', float('nan')):.3f}")
            if on_step is not None:
                on_step(step, metrics)
            last = step == cfg.steps - 1
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or last:
                self.save(step, crash_after_models=step == crash_at)
                if kill_at == f"{step}:after_save":
                    os.kill(os.getpid(), signal.SIGKILL)
        if cfg.export_hf:
            from megaprm.trainer.export import save_hf

            out = save_hf(self.actor.model, g, os.path.join(self.run_dir, "hf"),
                          side_files_from=self.src.hf_dir)
            if g.rank == 0:
                print(f"[megaprm] final policy exported to {out}", flush=True)
        self.source.stop()
        self.logger.close()
        if self.lock is not None:
            self.lock.release()
        return history

