"""The RL step as named phases (docs/architecture.md "One RL step"), each a function in its own
module from typed inputs to a typed output:

    rollout (rollout_source, refill) -> RolloutBatch -> outcome and process reward
    (reward_phase) -> ScoredBatch -> [agree] -> old/ref log-probs (logprob_phase) -> LogProbs
    -> implicit-PRM update + scores (implicit_prm, PRIME) -> advantages (advantage_phase)
    -> off-policy correction (correction) -> PPO update, all or nothing (actor_update)
    -> UpdateResult -> weight sync (rollout_source) -> metrics (step_metrics), evaluation
    (evaluate), checkpoints (resume)

`RLTrainer` owns the models (the actor, the reference, one PRM slot whose `.kind` says which
parts it has), the rollout source and the run's position (`state`, a `resume.TrainState` value
replaced as the run goes, what a checkpoint saves and a resume returns); its phase methods
(`rollout`, `outcome_reward`, `process_reward`, `prime_prm`, `advantages`, `update_actor`) hand
a phase function what it reads and return what it produced, so a test or a recipe can replace
one phase on one trainer. `step` is the list of phases. No phase or source module takes the
trainer: each is given the parts it reads (tests/trainer/test_structure.py holds the rule).
After `fit`, `evaluate_with_engine` and `export_implicit_prm` are what experiments use.

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
* Sampling distribution: one log-prob temperature (`RLTrainer.temperature`, the one place that
  decides it, from `actor.logprob_temperature`) for the actor's and the reference's log-probs;
  the sampler-vs-trainer guard always compares at the sampling temperature (logprob_phase).
* Faults: a non-finite reward on any rank is agreed on by every rank (`agree`) before the next
  collective, so all skip the step; a non-finite loss or grad norm in any mini-batch rolls the
  whole update back (`Optimizer.all_or_nothing`), so a step is applied wholly or not at all
  and the rollout engine always holds the actor's weights.
"""
from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Any, Callable, List, Optional

from checkpoint_tools import model_source
from megaprm import faults
from megaprm.config import Config, save_config, to_dict
from megaprm.models.hf_spec import spec_from_hf
from megaprm.parallel.device import resolve_dtype
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import agree, dp_metrics
from megaprm.rewards.steps import separator_token_ids
from megaprm.trainer.rl import actor_update, advantage_phase, correction, implicit_prm, logprob_phase, refill, resume, reward_phase, rollout_source, step_metrics
from megaprm.trainer.rl.batch import ScoredBatch, StepSkipped, UpdateResult
from megaprm.trainer.checkpoint.run_dir import start_fresh
from megaprm.trainer.rl.data import make_data
from megaprm.trainer.export import save_hf
from megaprm.trainer.metrics import MetricsLogger, PhaseTimer
from megaprm.trainer.rl.policy import Batching, Policy, response_to_targets
from megaprm.trainer.preflight import check_batch
from megaprm.trainer.run_config import config_digest_fields, logprob_temperature


class RLTrainer:
    """Builds the models for one rank and runs RL steps. `cfg.model.path`: the policy (an HF
    directory or a megaprm checkpoint); `cfg.prm.path`: the discriminative PRM."""

    def __init__(self, cfg: Config, groups: Groups, tokenizer):
        self.cfg, self.groups, self.tok = cfg, groups, tokenizer
        check_batch(cfg, groups.dp_size)
        self.lock = resume.lock_run_dir(cfg.trainer.run_dir, groups)
        if not cfg.trainer.resume:  # an earlier run there: refused, or moved aside (replace_run)
            start_fresh(cfg.trainer.run_dir, groups, replace=cfg.trainer.replace_run,
                        log=print if groups.rank == 0 else (lambda _m: None))
        # the data first: a bad prompt file fails before any model is built
        self.data = make_data(cfg, tokenizer, log=print if groups.rank == 0 else None)
        self.src = model_source.resolve(cfg.model.path, "model.path")
        self.spec = spec_from_hf(self.src.hf_dir)
        self.spec.check_parallel(groups.tp_size, groups.pp_size, groups.ep_size)
        self.temperature = logprob_temperature(cfg)  # the one place: actor, ref, PURE's KL
        dtype = resolve_dtype(cfg.model.dtype)
        self.batching = Batching(cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch,
                                 groups.pp_size)
        # The engine first, then asleep: vLLM's start-up check wants utilisation x total memory
        # free, which the actor, reference and PRM would no longer leave; the first
        # `sync_weights` wakes its weights with the actor's.
        say = print if cfg.trainer.progress and groups.rank == 0 else (lambda *_a, **_k: None)
        t_build = time.perf_counter()
        say(f"[train] building the rollout engine and the models (actor{', reference' if ref_needed(cfg) else ''}"
            f"{', PRM' if cfg.prm.kind in ('discriminative', 'implicit') else ''}) ...", flush=True)
        # None: the rollout ranks hold it
        self.engine = rollout_source.build_engine(cfg.rollout, cfg.trainer.seed, self.src.hf_dir,
                                                  tokenizer, groups)
        kw = dict(dtype=dtype, batching=self.batching,
                  build={"impl": cfg.model.impl, "compile": cfg.model.compile,
                         "recompute": cfg.model.recompute,
                         "moe_aux_loss_coef": cfg.model.moe_aux_loss_coef,
                         "moe_z_loss_coef": cfg.model.moe_z_loss_coef})
        self.actor = Policy(self.spec, groups, self.src, trainable=True, optim=cfg.actor.optim,
                            temperature=self.temperature, **kw)
        self.ref = (Policy(self.spec, groups, self.src, trainable=False,
                           temperature=self.temperature, **kw) if ref_needed(cfg) else None)
        # the one PRM slot: its kind says which parts it has (the oracle and the judge: none)
        self.prm: Optional[reward_phase.DiscriminativePRM | implicit_prm.ImplicitPRM] = None
        if cfg.prm.kind == "discriminative":
            self.prm = reward_phase.build_discriminative_prm(cfg, groups)
        elif cfg.prm.kind == "implicit":
            # PRIME: the implicit PRM starts from the policy and, with its reference, scores at
            # T = 1 (q = log pi_prm - log pi_ref of the sampled tokens; PRIME samples at T = 1)
            imp_src = model_source.resolve(cfg.prm.path or cfg.model.path, "prm.path")
            self.prm = implicit_prm.ImplicitPRM(
                Policy(self.spec, groups, imp_src, trainable=True, optim=cfg.prm.optim, **kw),
                self.ref if self.temperature == 1.0 else
                Policy(self.spec, groups, self.src, trainable=False, **kw))
        self.grader = self.grader_tok = None
        if cfg.prm.kind == "judge":
            grader = reward_phase.build_grader(cfg, groups)
            self.grader, self.grader_tok = grader.engine, grader.tok
        say(f"[train] models built ({time.perf_counter() - t_build:.0f} s)", flush=True)
        # the run's position (step, data position, refill queue, ...): one value, replaced as
        # the run goes, saved in checkpoints (so a resume draws the same prompts; its run id
        # is the checkpoint's)
        self.state = resume.TrainState(run_id=uuid.uuid4().hex[:12])
        self.sep_ids = separator_token_ids(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.run_dir = cfg.trainer.run_dir
        self.digest_fields = config_digest_fields(cfg)
        self.logger = MetricsLogger(self.run_dir, enabled=groups.rank == 0,
                                    wandb_mode=cfg.trainer.wandb, config=to_dict(cfg))
        if groups.rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
        self.lifecycle, self.source = rollout_source.make_source(
            cfg, groups, self.engine, self.actor.model, self.data, tokenizer, self.eos,
            rollout_source.offloads(cfg, self.actor, self.ref, self.prm))
        self.sync_weights()

    @staticmethod
    def tokenizer_dir(model_path: str) -> str:
        """Where the tokenizer of `model.path` lives (the HF dir, or a checkpoint's hf/)."""
        return model_source.resolve(model_path, "model.path").hf_dir

    def _prm_of(self, kind: str):
        """The PRM slot where it is of `kind` (discriminative, implicit), else None."""
        return self.prm if self.prm is not None and self.prm.kind == kind else None

    # ------------------------------------------------------------------ the phases
    def sync_weights(self) -> dict:
        """Phase: new actor weights -> the rollout engine (HF names, one collective per bucket;
        the engine wakes its weights, loads and resets its prefix cache; its KV cache wakes when
        it next generates, after the trainer's state is offloaded). Returns its metrics."""
        return self.source.sync()

    def rollout(self, block: int, requeued: tuple = ()):
        return rollout_source.rollout(self.source, self.data, self.tok, self.cfg, self.groups,
                                      self.eos, block, requeued)

    def _reward_context(self, step: int) -> reward_phase.RewardContext:
        """What the reward phases read; `step` seeds the judge and places the NaN hook."""
        grader = (reward_phase.Grader(self.grader, self.grader_tok) if self.grader is not None
                  else None)
        return reward_phase.RewardContext(self.cfg, self.groups, self.tok, self.sep_ids,
                                          self.pad, step, self._prm_of("discriminative"),
                                          grader)

    def outcome_reward(self, batch, prompts, group_ids, step: int) -> ScoredBatch:
        return reward_phase.outcome_reward(self._reward_context(step), batch, prompts,
                                           group_ids)

    def process_reward(self, sb: ScoredBatch, step: int) -> ScoredBatch:
        return reward_phase.process_reward(self._reward_context(step), sb)

    def prime_prm(self, sb: ScoredBatch, lp: logprob_phase.LogProbs) -> tuple:
        """PRIME's implicit PRM (its reference at T = 1: the actor's reference when that is
        at T = 1 too, else its own forward)."""
        prm = self.prm
        ref_t = (lp.ref_t if prm.ref is self.ref
                 else prm.ref.logprobs(lp.rp.input_ids, lp.lengths))
        return implicit_prm.prime_prm(prm.policy, self.cfg.prm, self.cfg.advantage.prime, sb,
                                      lp.rp, lp.lengths, ref_t)

    def advantages(self, sb: ScoredBatch, logp_old, logp_ref):
        return advantage_phase.advantages(self.cfg.advantage, self.cfg.trainer.seed,
                                          self.groups.host_dp, sb, logp_old, logp_ref)

    def update_actor(self, rp, adv_t, logp_old_t, logp_ref_t, keep) -> UpdateResult:
        return actor_update.update_actor(self.actor, self.cfg.actor, self.cfg.rollout.max_tokens,
                                         rp, adv_t, logp_old_t, logp_ref_t, keep)

    def evaluate(self) -> dict:
        """Held-out greedy accuracy of the policy through the rollout source's engine."""
        return {f"eval/{k}": float(v) for k, v in self.source.evaluate().items()}

    def _checkpoint_parts(self) -> resume.CheckpointParts:
        implicit = self._prm_of("implicit")
        return resume.checkpoint_parts(self.actor,
                                       implicit.policy if implicit is not None else None)

    def save(self, crash_after_models: bool = False) -> str:
        """Checkpoint the models and `self.state` (step `state.step - 1`, the last step done)."""
        return resume.save(self.cfg, self.groups, self.state, self._checkpoint_parts(),
                           self.digest_fields, crash_after_models=crash_after_models)

    def maybe_resume(self) -> int:
        """Resume from the newest intact checkpoint where trainer.resume asks (the models,
        `self.state`, the metrics file cut back to it, the engine fed the loaded weights).
        Returns the step to run next (0: a fresh start)."""
        self.state = resume.maybe_resume(self.cfg, self.groups, self.state,
                                         self._checkpoint_parts(), self.digest_fields)
        if self.state.step > 0:
            self.logger.truncate_after(self.state.step - 1, self.state.last_row)
            self.sync_weights()
        return self.state.step

    def _scored_rollout(self, step: int, t: PhaseTimer) -> tuple:
        """Phases rollout, outcome and process reward: (ScoredBatch, refill's metrics). A
        non-finite reward on any rank skips the step on every rank (StepSkipped)."""
        fault, sb, metrics = None, None, {}
        try:
            if self.cfg.rollout.refill == "none":
                self.state = dataclasses.replace(self.state, next_block=step + 1)
                with t("rollout"):
                    batch, prompts, group_ids = self.rollout(step)
                with t("outcome_reward"):
                    sb = self.outcome_reward(batch, prompts, group_ids, step)
            else:
                r = refill.refill_rollout(
                    self.cfg, self.groups, self.sep_ids, t, self.state.next_block,
                    self.state.requeue, self.rollout,
                    lambda batch, prompts, group_ids: self.outcome_reward(batch, prompts,
                                                                          group_ids, step))
                sb, metrics = r.batch, r.metrics
                self.state = dataclasses.replace(self.state, next_block=r.next_block,
                                                 requeue=tuple(r.requeue))
            with t("process_reward"):
                sb = self.process_reward(sb, step)
        except FloatingPointError as e:
            fault = str(e)
        fault = agree(fault, self.groups)  # every rank skips, or none does
        if fault is not None:
            raise StepSkipped(fault)
        return sb, metrics

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        """One RL step on this rank: its rank-local metrics (step_or_skip reduces them)."""
        cfg, g, t, t0 = self.cfg, self.groups, PhaseTimer(), time.perf_counter()
        sb, refill_metrics = self._scored_rollout(step, t)
        batch = sb.rollout
        lag = correction.row_lag(batch, self.source.version)  # versions behind the trainer's
        reuse = logprob_phase.reuses_new_logprobs(
            cfg, self.temperature, on_policy=not correction.off_policy(cfg.rollout))
        with t("old_logprobs"):
            lp = logprob_phase.before_update(self.actor, self.ref,
                                             batch.to_right_padded(self.pad),
                                             batch.response_ids.shape[1],
                                             sampler_temperature=cfg.rollout.temperature,
                                             reuse=reuse)
        prm_metrics: dict = {}
        if self._prm_of("implicit") is not None:  # PRIME: train the PRM (filtered, ...), score
            with t("prm_update"):
                sb, prm_metrics = self.prime_prm(sb, lp)
        with t("advantages"):
            adv = self.advantages(sb, lp.response(lp.old_t), lp.response(lp.ref_t))
        adv, off_metrics = correction.correct(adv, lp.response(lp.sampler_t), batch,
                                              cfg.rollout)
        # refill's top-up groups (the cap was hit) did not pass: no gradient from them
        keep = adv.keep if sb.passed is None else adv.keep & sb.passed
        order = (actor_update.mini_batch_order(lp.rp.input_ids.shape[0], cfg.trainer.seed, step,
                                               g.dp_rank)
                 if cfg.actor.shuffle_mini_batches else None)
        with t("update"):
            update = self.update_actor(*actor_update.update_inputs(
                lp.rp, response_to_targets(adv.advantages, lp.rp), lp.old_t,
                lp.ref_t if cfg.actor.kl_coef else None, keep, order))
        lp = logprob_phase.after_update(lp, update, self.actor, order)
        logp_old, logp_sampler = lp.response(lp.old_t), lp.response(lp.sampler_t)
        off_metrics.update(correction.lag_metrics(lag, logp_sampler, batch.sampler_logprobs,
                                                  batch.response_mask.float()))
        metrics = {**step_metrics.rollout_metrics(cfg, self.temperature, sb, adv, logp_old,
                                                  logp_sampler),
                   **off_metrics, **prm_metrics, **refill_metrics, **sb.metrics,
                   **update.metrics}
        with t("weight_sync"):
            metrics.update(self.sync_weights())
        metrics.update(t.times)
        elapsed = time.perf_counter() - t0
        tokens = float(batch.response_mask.sum() + batch.prompt_mask.sum())
        metrics["timing/step_s"] = elapsed
        # the sum over dp of each rank's tokens / s once step_or_skip takes the dp mean (no
        # collective of its own)
        metrics["throughput/tokens_per_s"] = tokens * g.dp_size / max(elapsed, 1e-9)
        step_metrics.log_samples(self.run_dir, cfg.trainer.log_samples, g.rank, self.tok, step,
                                 sb)
        return metrics

    def step_or_skip(self, step: int) -> dict:
        """One step's metrics, the same on every rank: the rank-local ones reduced over dp in
        one all-reduce (`host.dp_metrics`: maxima as maxima, minima as minima, the rest
        averaged), the update's already global; or {'guard/skipped': 1} when every rank agreed
        to skip."""
        try:
            metrics = self.step(step)
            metrics = {**step_metrics.finish_aurocs(dp_metrics(
                           {k: v for k, v in metrics.items() if not k.startswith("actor/")},
                           self.groups)),
                       **{k: v for k, v in metrics.items() if k.startswith("actor/")}}
        except StepSkipped as e:  # agreed on by every rank; nothing was applied
            self.actor.opt.zero_grad()
            self.state = dataclasses.replace(self.state,
                                             skipped_steps=self.state.skipped_steps + 1)
            metrics = {"guard/skipped": 1.0}
            if self.groups.rank == 0:
                print(f"[megaprm] step {step} skipped: {e}", flush=True)
        metrics["guard/skipped_total"] = float(self.state.skipped_steps)
        return metrics

    # ------------------------------------------------------------------ the run
    def fit(self, on_step=None) -> List[dict]:
        from tqdm import tqdm

        cfg, g = self.cfg.trainer, self.groups
        start = self.maybe_resume()
        if start == 0:  # a fresh start (or a kill before the first checkpoint): no old rows
            self.logger.truncate_after(-1)
        history = []
        if cfg.progress and g.rank == 0 and start < cfg.steps:  # the bar moves only after it
            print(f"[train] step {start}: generating, scoring and updating (the bar below moves "
                  "when the step ends)", flush=True)
        bar = tqdm(range(start, cfg.steps), desc=f"RL {self.cfg.advantage.method}",
                   disable=not (cfg.progress and g.rank == 0), initial=start, total=cfg.steps)
        for step in bar:
            metrics = self.step_or_skip(step)
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
                metrics.update(self.evaluate())
            step_metrics.warn_on_drift(g.rank, step, metrics)
            # the run is past `step`; a save of this step keeps its row
            self.state = dataclasses.replace(self.state, step=step + 1,
                                             last_row=self.logger.log(step, metrics))
            faults.kill_at(step, "after_log")
            history.append(metrics)
            bar.set_postfix(reward=f"{metrics.get('reward/outcome_mean', float('nan')):.3f}")
            if on_step is not None:
                on_step(step, metrics)
            last = step == cfg.steps - 1
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or last:
                self.save(crash_after_models=faults.crash_during_save(step))
                faults.kill_at(step, "after_save")
        if cfg.export_hf:
            out = save_hf(self.actor.model, g, os.path.join(self.run_dir, "hf"),
                          side_files_from=self.src.hf_dir)
            if g.rank == 0:
                print(f"[megaprm] final policy exported to {out}", flush=True)
        self.source.stop()
        self.logger.close()
        if self.lock is not None:
            self.lock.release()
        return history

    # ------------------------------------------------------------------ after the run
    def evaluate_with_engine(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on this rank's colocated rollout engine, which holds the actor's newest
        weights, with the trainer's models off the device as in a rollout (the experiments'
        own evaluations after `fit`). Returns what `fn` returned."""
        if self.lifecycle is None:
            raise ValueError("evaluate_with_engine needs the engine on the trainer's ranks "
                             "(rollout.placement=colocated); under rollout.placement=separate "
                             "the rollout ranks hold it")
        return self.source.with_engine(fn)

    def export_implicit_prm(self, path: str, side_files_from: Optional[str] = None) -> str:
        """PRIME's implicit PRM as an HF directory at `path` (collective: every rank calls it),
        its tokenizer and config files copied from `side_files_from` (default: the directory
        it started from). Returns the directory written."""
        if self._prm_of("implicit") is None:
            raise ValueError(f"export_implicit_prm: this run has no implicit PRM "
                             f"(prm.kind={self.cfg.prm.kind!r}; PRIME's is prm.kind=implicit)")
        return save_hf(self.prm.policy.model, self.groups, path,
                       side_files_from=side_files_from or self.prm.policy.src.hf_dir)


def ref_needed(cfg: Config) -> bool:
    """A reference policy is built for the KL penalty, PRIME's implicit PRM and PURE's KL."""
    return bool(cfg.actor.kl_coef or cfg.prm.kind == "implicit"
                or (cfg.advantage.method == "pure" and cfg.advantage.pure.kl_coef))
