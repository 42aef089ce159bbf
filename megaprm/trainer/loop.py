"""The RL step as named phases (ARCHITECTURE.md "One RL step"):

    rollout -> outcome reward -> process reward -> advantages (+ filter) -> old/ref log-probs
    -> PPO update -> implicit-PRM update (PRIME) -> weight sync

Every rank runs the same code on its own data-parallel shard of the prompts; group statistics
are reduced over the dp group inside the estimators; the Megatron models run under tp/pp
through `parallel.pipeline`. Tensor shapes: B rollouts on this rank, R response tokens,
L = prompt+response tokens (right-padded), S steps.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megaprm.algorithms.losses import actor_loss, implicit_prm_ce_loss
from megaprm.algorithms.registry import AdvantageInputs, AdvantageOutputs, compute_advantages
from megaprm.config import Config, ConfigError, save_config, to_dict
from megaprm.models.hf_spec import spec_from_hf
from megaprm.models.logprobs import vocab_parallel_logprobs
from megaprm.models.mapping import load_hf_weights
from megaprm.parallel import pipeline, weight_sync
from megaprm.parallel.groups import Groups
from megaprm.rollout.engine import RightPadded, RolloutBatch, SamplingParams
from megaprm.trainer import checkpoint
from megaprm.trainer.metrics import MetricsLogger, PhaseTimer


@dataclass
class ScoredBatch:
    """A rollout with its rewards. outcome [B] float; group_ids [B] int64 (global prompt index);
    step_scores [B, S] = P(step correct) from the PRM (None without a discriminative PRM);
    seg: the step segmentation of the responses; q [B, R]: PRIME's implicit token rewards;
    step_correct [B, S] bool: exact per-step truth where the task has it (arithmetic)."""

    rollout: RolloutBatch
    outcome: torch.Tensor
    group_ids: torch.Tensor
    seg: object
    step_scores: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    logp_prm: Optional[torch.Tensor] = None
    logp_ref_prm: Optional[torch.Tensor] = None
    correct_with_wrong_step: Optional[torch.Tensor] = None


def dp_mean(values: dict, groups: Groups) -> dict:
    """Average rank-local scalar metrics over the dp group (one all-reduce)."""
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if groups.dp_size > 1:
        dist.all_reduce(t, group=groups.dp)
        t /= groups.dp_size
    return dict(zip(keys, t.tolist()))


def dp_sum(x: float, groups: Groups) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    if groups.dp_size > 1:
        dist.all_reduce(t, group=groups.dp)
    return float(t.item())


def response_to_targets(values: torch.Tensor, rp: RightPadded) -> torch.Tensor:
    """Response-layout values [B, R] -> target-aligned [B, L-1] (index t is input token t+1)."""
    B, L = rp.input_ids.shape
    out = torch.zeros(B, L - 1, dtype=values.dtype)
    R = values.shape[1]
    for i in range(B):
        start = int(rp.response_start[i]) - 1
        n = min(R, L - 1 - start)
        out[i, start:start + n] = values[i, :n]
    return out


def targets_to_response(values: torch.Tensor, rp: RightPadded, width: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(values, (1, 0))  # token-aligned [B, L]
    return rp.to_response(padded, width)


class Policy:
    """A Megatron causal LM on this rank (actor, reference or implicit PRM) + its optimiser."""

    def __init__(self, spec, groups: Groups, model_dir: str, *, trainable: bool,
                 optim=None, dtype=torch.float32):
        self.spec, self.groups = spec, groups
        model = pipeline.build_stage(spec, groups, dtype=dtype)
        load_hf_weights(model, model_dir, spec, tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                        pp=groups.pp_size, pp_rank=groups.pp_rank)
        if trainable:
            self.model = pipeline.wrap_ddp(model, groups)
            self.opt = pipeline.Optimizer(self.model, optim, groups)
        else:
            self.model, self.opt = model.eval(), None
            for p in model.parameters():
                p.requires_grad_(False)

    def _post_logprobs(self, with_entropy=False):
        g = self.groups

        def post(mb, logits):
            out = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp,
                                          tp_rank=g.tp_rank, vocab_size=self.spec.vocab_size,
                                          with_entropy=with_entropy)
            return None, out
        return post

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
        """log p(input_ids[:, t+1] | <=t) [B, L-1] on every rank (forward only)."""
        mbs = _split(input_ids, torch.zeros_like(input_ids, dtype=torch.float32), None,
                     micro_batch_size, self.groups.pp_size)
        parts = pipeline.run(self.model, mbs, groups=self.groups, post=self._post_logprobs(),
                             forward_only=True)
        out = pipeline.broadcast_from_last_stage(torch.cat(parts) if parts else None,
                                                 self.groups)
        return out[: input_ids.shape[0]]


def _split(ids, mask, payload, size, pp) -> List[pipeline.TokenBatch]:
    """Micro-batches of `size` rows; with pp > 1 all the same shape (short one padded)."""
    out = []
    for s in range(0, ids.shape[0], size):
        mb_ids, mb_mask = ids[s:s + size], mask[s:s + size]
        mb_pay = None if payload is None else {k: v[s:s + size] for k, v in payload.items()}
        if pp > 1 and mb_ids.shape[0] < size:
            extra = size - mb_ids.shape[0]
            mb_ids = torch.cat([mb_ids, mb_ids.new_zeros(extra, ids.shape[1])])
            mb_mask = torch.cat([mb_mask, mb_mask.new_zeros(extra, mask.shape[1])])
            if mb_pay is not None:
                mb_pay = {k: torch.cat([v, v.new_zeros(extra, *v.shape[1:])])
                          for k, v in mb_pay.items()}
        out.append(pipeline.TokenBatch(mb_ids, mb_mask, mb_pay))
    return out


class RLTrainer:
    """Builds the models for one rank and runs RL steps. `cfg.model.path` is the policy (HF dir);
    `cfg.prm.path` the discriminative PRM (HF dir) when `prm.kind == discriminative`."""

    def __init__(self, cfg: Config, groups: Groups, tokenizer):
        from megaprm.rewards.steps import separator_token_ids

        self.cfg, self.groups, self.tok = cfg, groups, tokenizer
        if cfg.model.path is None or not os.path.isdir(cfg.model.path):
            raise ConfigError(f"model.path={cfg.model.path!r} is not a directory; point it at an "
                              "HF model directory (config.json + safetensors)")
        if cfg.data.prompts_per_step % groups.dp_size:
            raise ConfigError(f"data.prompts_per_step={cfg.data.prompts_per_step} must be a "
                              f"multiple of dp={groups.dp_size}")
        self.spec = spec_from_hf(cfg.model.path)
        self.spec.check_parallel(groups.tp_size, groups.pp_size)
        dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
        self.actor = Policy(self.spec, groups, cfg.model.path, trainable=True,
                            optim=cfg.actor.optim, dtype=dtype)
        needs_ref = (cfg.actor.kl_coef or cfg.prm.kind == "implicit"
                     or (cfg.advantage.method == "pure" and cfg.advantage.pure.kl_coef))
        self.ref = (Policy(self.spec, groups, cfg.model.path, trainable=False, dtype=dtype)
                    if needs_ref else None)
        self.prm = self.implicit = None
        if cfg.prm.kind == "discriminative":
            self._build_discriminative_prm()
        elif cfg.prm.kind == "implicit":  # PRIME: the implicit PRM starts from the policy
            self.implicit = Policy(self.spec, groups, cfg.prm.path or cfg.model.path,
                                   trainable=True, optim=cfg.prm.optim, dtype=dtype)
        self.engine = self._build_engine()
        self.sep_ids = separator_token_ids(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.data = _make_data(cfg)
        self.run_dir = cfg.trainer.run_dir
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        self.logger = MetricsLogger(self.run_dir, enabled=groups.rank == 0,
                                    wandb_mode=cfg.trainer.wandb, config=to_dict(cfg))
        if groups.rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
        self.skipped_steps = 0
        self.start_step = 0
        self.sync_weights()

    # ------------------------------------------------------------------ construction helpers
    def _build_discriminative_prm(self):
        from megaprm.models.prm import build_prm
        from megaprm.rewards.scoring import PRMInputFormat

        path = self.cfg.prm.path
        if path is None or not os.path.isdir(path):
            raise ConfigError(f"prm.path={path!r} is not a directory; prm.kind=discriminative "
                              "needs a trained PRM (megaprm train-prm writes one)")
        g = self.groups
        spec = spec_from_hf(path)
        model = build_prm(spec, tp=g.tp_size, pp=g.pp_size, pp_rank=g.pp_rank)
        load_hf_weights(model, path, spec, tp_rank=g.tp_rank, tp_size=g.tp_size, pp=g.pp_size,
                        pp_rank=g.pp_rank)
        self.prm, self.prm_spec = model.eval(), spec
        self.prm_fmt = PRMInputFormat.from_hf(spec.hf_config)

    def _build_engine(self):
        if self.cfg.rollout.engine == "vllm":
            from megaprm.rollout.vllm_engine import VLLMEngine

            return VLLMEngine.from_pretrained(self.cfg.model.path)
        from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return HFEngine.from_pretrained(self.cfg.model.path, HFEngineConfig(
            device=dev, pad_token_id=self.tok.pad_token_id, eos_token_ids=(self.tok.eos_token_id,)))

    # ------------------------------------------------------------------ phases
    def sync_weights(self) -> None:
        """Phase: new actor weights -> the colocated rollout engine (HF names, streamed)."""
        self.engine.load_weights(weight_sync.iter_hf_weights(self.actor.model, self.groups))

    def rollout(self, step: int):
        """Phase: this rank's prompts -> n samples each. Same seed on every tp/pp peer."""
        cfg, g = self.cfg, self.groups
        problems, truths = self.data(step)
        per = len(problems) // g.dp_size
        lo = g.dp_rank * per
        local = problems[lo:lo + per]
        ids = [self.tok.encode(p, add_special_tokens=False) for p in local]
        params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                                top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_tokens,
                                stop_token_ids=(self.eos,),
                                seed=(cfg.trainer.seed * 1_000_003 + step * 7919
                                      + g.dp_rank * 104_729) % (2**31))
        batch = self.engine.generate(ids, params)
        group_ids = (step * len(problems) + lo + batch.group_index).long()
        return batch, truths[lo:lo + per], group_ids

    def outcome_reward(self, batch: RolloutBatch, truths: list, group_ids):
        """Phase: verifier. Arithmetic: exact per-step check; math: math-verify."""
        from megaprm.rewards.steps import segment_steps

        texts = batch.decode_responses(self.tok)
        seg = segment_steps(batch.response_ids, batch.response_mask, self.sep_ids)
        truths_b = [truths[int(i)] for i in batch.group_index]
        wrong_step = None
        if self.cfg.data.task == "arithmetic":
            from megaprm.tasks.arithmetic import check_steps

            checks = [check_steps(p, t, ends_with_eos=r == "stop")
                      for p, t, r in zip(truths_b, texts, batch.finish_reason)]
            outcome = torch.tensor([float(c.final_correct) for c in checks])
            wrong_step = torch.tensor([c.correct_with_wrong_step for c in checks])
        else:
            from megaprm.rewards.verifiers import score_outcomes

            outcome = score_outcomes(texts, truths_b, kind="math")
        if not torch.isfinite(outcome).all():
            raise FloatingPointError("verifier returned non-finite rewards")
        return ScoredBatch(batch, outcome, group_ids, seg, correct_with_wrong_step=wrong_step)

    def process_reward(self, sb: ScoredBatch) -> None:
        """Phase: PRM. Discriminative: P(step correct) per step; implicit: q per token."""
        from megaprm.rewards.scoring import implicit_prm_rewards, score_rollouts

        b, mbs = sb.rollout, self.cfg.actor.micro_batch_size
        if self.prm is not None:
            scores, _ = score_rollouts(self.prm, self.groups, b.prompt_ids, b.prompt_mask,
                                       b.response_ids, b.response_mask, sep_ids=self.sep_ids,
                                       fmt=self.prm_fmt, head=self.prm_spec.head,
                                       micro_batch_size=mbs, pad_id=self.pad)
            s = scores.scores
            if self.prm_spec.head == "token_cls":  # PURE's PR = 2p - 1 -> p
                s = torch.where(scores.step_mask, (s + 1) / 2, torch.zeros_like(s))
            sb.step_scores = s
        elif self.implicit is not None:
            imp = implicit_prm_rewards(self.implicit.model, self.ref.model, self.groups,
                                       b.prompt_ids, b.prompt_mask, b.response_ids,
                                       b.response_mask, sep_ids=self.sep_ids,
                                       vocab_size=self.spec.vocab_size, micro_batch_size=mbs,
                                       pad_id=self.pad)
            sb.q = imp.q
            if not torch.isfinite(sb.q).all():
                raise FloatingPointError("implicit PRM produced non-finite rewards")

    def advantages(self, sb: ScoredBatch, logp_old_resp, logp_ref_resp) -> AdvantageOutputs:
        """Phase: estimator from the registry; group statistics reduced over dp."""
        b = sb.rollout
        q_prm = q_ref = None
        if sb.q is not None:  # the registry takes log-probs; q = logp_prm - logp_ref
            q_prm, q_ref = sb.q, torch.zeros_like(sb.q)
        inputs = AdvantageInputs(
            outcome=sb.outcome.float(), group_ids=sb.group_ids,
            response_mask=b.response_mask.float(),
            process_step_scores=sb.step_scores,
            step_mask=sb.seg.step_mask if sb.step_scores is not None else None,
            step_end_index=sb.seg.step_end_index, token_to_step=sb.seg.token_to_step,
            num_steps=sb.seg.num_steps,
            logp_prm=q_prm, logp_ref=q_ref if q_prm is not None else logp_ref_resp,
            logp_old=logp_old_resp)
        gen = torch.Generator().manual_seed(self.cfg.trainer.seed + int(sb.group_ids.min()))
        return compute_advantages(self.cfg.advantage, inputs, group=pipeline.optional_group(
            self.groups.dp), generator=gen)

    def update_actor(self, rp: RightPadded, adv_t, logp_old_t, logp_ref_t, keep) -> dict:
        """Phase: PPO-clip through Megatron's schedule; normalisers are global (all dp ranks,
        all micro-batches) so any layout takes the same step."""
        cfg, g = self.cfg.actor, self.groups
        mask_t = rp.loss_mask[:, :-1] * keep[:, None].float()
        B = rp.input_ids.shape[0]
        metrics = {}
        order = torch.arange(B)
        for mb_rows in order.chunk(cfg.mini_batches):
            m = mask_t[mb_rows]
            tokens = dp_sum(m.sum().item(), g)
            seqs = dp_sum((m.sum(1) > 0).sum().item(), g)
            if tokens == 0:
                continue
            payload = {"adv": adv_t[mb_rows], "old": logp_old_t[mb_rows], "m": m}
            if logp_ref_t is not None:
                payload["ref"] = logp_ref_t[mb_rows]
            mbs = _split(rp.input_ids[mb_rows], m, payload, cfg.micro_batch_size, g.pp_size)

            def post(mb, logits):
                need_ent = cfg.entropy_coef != 0
                lp = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp,
                                             tp_rank=g.tp_rank, vocab_size=self.spec.vocab_size,
                                             with_entropy=need_ent)
                lp, ent = lp if need_ent else (lp, None)
                p = mb.payload
                loss, met = actor_loss(lp, p["old"], p["adv"], p["m"], eps_low=cfg.eps_low,
                                       eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
                                       agg=cfg.loss_agg, entropy=ent,
                                       entropy_coef=cfg.entropy_coef, logp_ref=p.get("ref"),
                                       kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind,
                                       global_tokens=tokens, global_seqs=seqs)
                return loss, {**met, "loss": float(loss.detach())}

            self.actor.opt.zero_grad()
            parts = pipeline.run(self.actor.model, mbs, groups=g, post=post, forward_only=False)
            loss = sum(p.pop("loss") for p in parts) if parts else 0.0
            loss = pipeline.broadcast_from_last_stage(dp_sum(loss, g), g)
            if not math.isfinite(loss):
                self.actor.opt.zero_grad()
                raise FloatingPointError(f"actor loss is {loss}")
            grad_norm, applied = self.actor.opt.step()
            if not applied:
                raise FloatingPointError(f"actor grad norm is {grad_norm}")
            local = {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]} if parts else {}
            local = pipeline.broadcast_from_last_stage(local, g)
            metrics = {**local, "actor/loss": loss, "actor/grad_norm": grad_norm}
        return metrics

    def update_implicit_prm(self, rp: RightPadded, sb: ScoredBatch, logp_ref_t) -> dict:
        """Phase (PRIME): BCE(sigmoid(beta * sum_t q_t), outcome) on the same rollouts (§1.3)."""
        g, beta = self.groups, self.cfg.prm.beta
        mask_t = rp.loss_mask[:, :-1]
        seqs = dp_sum(rp.input_ids.shape[0], g)
        payload = {"ref": logp_ref_t, "m": mask_t,
                   "o": sb.outcome.float()[:, None].expand_as(mask_t)}
        mbs = _split(rp.input_ids, mask_t, payload, self.cfg.actor.micro_batch_size, g.pp_size)

        def post(mb, logits):
            lp = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], tp_group=g.tp,
                                         tp_rank=g.tp_rank, vocab_size=self.spec.vocab_size)
            p = mb.payload
            loss = implicit_prm_ce_loss(lp, p["ref"], p["m"], p["o"][:, 0], beta=beta,
                                        global_seqs=seqs)
            return loss, float(loss.detach())

        self.implicit.opt.zero_grad()
        parts = pipeline.run(self.implicit.model, mbs, groups=g, post=post, forward_only=False)
        loss = pipeline.broadcast_from_last_stage(dp_sum(sum(parts) if parts else 0.0, g), g)
        grad_norm, applied = self.implicit.opt.step()
        return {"prm/loss": loss, "prm/grad_norm": grad_norm, "prm/applied": float(applied)}

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        cfg, g = self.cfg, self.groups
        t = PhaseTimer()
        with t("rollout"):
            batch, truths, group_ids = self.rollout(step)
        with t("outcome_reward"):
            sb = self.outcome_reward(batch, truths, group_ids)
        with t("process_reward"):
            self.process_reward(sb)
        rp = batch.to_right_padded(self.pad)
        mbs = cfg.actor.micro_batch_size
        with t("old_logprobs"):
            logp_old_t = self.actor.logprobs(rp.input_ids, mbs)
            logp_ref_t = self.ref.logprobs(rp.input_ids, mbs) if self.ref is not None else None
        R = batch.response_ids.shape[1]
        logp_old = targets_to_response(logp_old_t, rp, R)
        logp_ref = targets_to_response(logp_ref_t, rp, R) if logp_ref_t is not None else None
        with t("advantages"):
            adv = self.advantages(sb, logp_old, logp_ref)
        adv_t = response_to_targets(adv.advantages, rp)
        metrics = self._rollout_metrics(sb, adv)
        with t("update"):
            metrics.update(self.update_actor(rp, adv_t, logp_old_t,
                                             logp_ref_t if cfg.actor.kl_coef else None,
                                             adv.keep))
        if self.implicit is not None:
            with t("prm_update"):
                metrics.update(self.update_implicit_prm(rp, sb, logp_ref_t))
        with t("weight_sync"):
            self.sync_weights()
        metrics.update(t.times)
        return metrics

    def _rollout_metrics(self, sb: ScoredBatch, adv: AdvantageOutputs) -> dict:
        b = sb.rollout
        lens = b.response_lengths.float()
        m = {"reward/outcome_mean": float(sb.outcome.mean()),
             "response/length_mean": float(lens.mean()),
             "response/truncated_frac": float(sum(r == "length" for r in b.finish_reason)
                                              / max(1, b.batch_size)),
             "response/steps_mean": float(sb.seg.num_steps.float().mean()),
             "response/tokens_per_step": float(lens.sum() / sb.seg.num_steps.sum().clamp(min=1)),
             "filter/keep_frac": float(adv.keep.float().mean()),
             "rollout/sampler_logprob_mean": float(
                 (b.sampler_logprobs * b.response_mask).sum() / b.response_mask.sum().clamp(min=1)),
             }
        if sb.correct_with_wrong_step is not None:
            correct = sb.outcome > 0.5
            m["exact/correct_with_wrong_step_frac"] = float(
                sb.correct_with_wrong_step[correct].float().mean()) if correct.any() else 0.0
        if sb.step_scores is not None:
            s, mask = sb.step_scores, sb.seg.step_mask
            min_score = torch.where(mask, s, torch.ones_like(s)).min(1).values
            prm_ok = min_score >= self.cfg.prm.low_score
            correct = sb.outcome > 0.5
            m["prm/score_mean"] = float(s[mask].mean()) if mask.any() else 0.0
            m["prm/outcome_agreement"] = float((prm_ok == correct).float().mean())
            m["prm/correct_with_low_prm_frac"] = float(
                (~prm_ok[correct]).float().mean()) if correct.any() else 0.0
        if sb.q is not None:
            m["prm/implicit_q_mean"] = float(sb.q.sum() / b.response_mask.sum().clamp(min=1))
        m.update(adv.metrics)
        return m

    # ------------------------------------------------------------------ checkpoints and loop
    def _ckpt_parts(self):
        models = {"actor": self.actor.model}
        optims = {"actor": self.actor.opt}
        if self.implicit is not None:
            models["prm"], optims["prm"] = self.implicit.model, self.implicit.opt
        return models, optims

    def save(self, step: int, crash_after_models: bool = False) -> str:
        models, optims = self._ckpt_parts()
        return checkpoint.save(self.ckpt_root, step, self.groups, models=models,
                               optimizers=optims,
                               trainer_state={"next_step": step + 1,
                                              "skipped_steps": self.skipped_steps},
                               crash_after_models=crash_after_models)

    def maybe_resume(self) -> int:
        path = checkpoint.latest_checkpoint(self.ckpt_root) if self.cfg.trainer.resume else None
        if path is None:
            return 0
        models, optims = self._ckpt_parts()
        state = checkpoint.load(path, self.groups, models=models, optimizers=optims)
        self.skipped_steps = state.get("skipped_steps", 0)
        self.logger.truncate_after(state["step"])
        self.sync_weights()
        if self.groups.rank == 0:
            print(f"[megaprm] resumed from {path} (next step {state['next_step']})", flush=True)
        return state["next_step"]

    def fit(self, on_step=None) -> List[dict]:
        from tqdm import tqdm

        cfg, g = self.cfg.trainer, self.groups
        start = self.maybe_resume()
        crash_at = int(os.environ.get("MEGAPRM_CRASH_DURING_SAVE_AT", "-1"))  # tests only
        history = []
        bar = tqdm(range(start, cfg.steps), desc=f"RL {self.cfg.advantage.method}",
                   disable=not (cfg.progress and g.rank == 0), initial=start, total=cfg.steps)
        for step in bar:
            try:
                metrics = self.step(step)
            except FloatingPointError as e:  # NaN/inf reward or loss: skip, count, log
                self.actor.opt.zero_grad()
                self.skipped_steps += 1
                metrics = {"guard/skipped": 1.0}
                if g.rank == 0:
                    print(f"[megaprm] step {step} skipped: {e}", flush=True)
            metrics = dp_mean(metrics, g)
            metrics["guard/skipped_total"] = float(self.skipped_steps)
            self.logger.log(step, metrics)
            history.append(metrics)
            bar.set_postfix(reward=f"{metrics.get('reward/outcome_mean', float('nan')):.3f}")
            if on_step is not None:
                on_step(step, metrics)
            last = step == cfg.steps - 1
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or last:
                self.save(step, crash_after_models=step == crash_at)
        self.logger.close()
        return history


def _make_data(cfg: Config):
    """step -> (prompt texts, ground truths) of the global prompt batch, deterministic in step
    (the data position is the step number, so resume needs nothing else)."""
    P = cfg.data.prompts_per_step
    if cfg.data.task == "arithmetic":
        from megaprm.tasks.arithmetic import generate_problems

        def arithmetic(step):
            probs = generate_problems(cfg.data.arithmetic, P,
                                      seed=cfg.trainer.seed * 100_003 + step)
            return [p.prompt for p in probs], probs
        return arithmetic
    from megaprm.tasks.datasets import load_prompts

    records, report = load_prompts(cfg.data.path)
    if not records:
        raise ConfigError(f"data.path={cfg.data.path!r}: no usable rows ({report.summary()})")

    def math(step):
        rows = [records[(step * P + i) % len(records)] for i in range(P)]
        return [r.prompt for r in rows], [r.answer for r in rows]
    return math
