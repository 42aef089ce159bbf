"""The RL step as named phases (ARCHITECTURE.md "One RL step"):

    rollout -> outcome reward -> process reward -> [agree] -> old/ref log-probs
    -> implicit-PRM update + scores (PRIME) -> advantages (+ filter) -> PPO update (all or
    nothing) -> weight sync

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
"""
from __future__ import annotations

import functools
import json
import math
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import List, Optional

import torch

from megaprm.algorithms.losses import actor_loss, guard_ratio_mean, implicit_prm_ce_loss
from megaprm.algorithms.registry import AdvantageInputs, AdvantageOutputs, compute_advantages
from megaprm.config import Config, ConfigError, save_config, to_dict
from megaprm.models.hf_spec import spec_from_hf
from megaprm.models.logprobs import next_token_logprobs
from megaprm.parallel import microbatch, pipeline, weight_sync
from megaprm.parallel.device import resolve_dtype, to_host
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import agree, dp_mean, dp_reduce, dp_sum
from megaprm.parallel.offload import Offload
from megaprm.rollout.engine import RightPadded, RolloutBatch, SamplingParams
from megaprm.trainer import checkpoint, model_source
from megaprm.trainer.lifecycle import Lifecycle
from megaprm.trainer.metrics import MetricsLogger, PhaseTimer


class StepSkipped(Exception):
    """A step every rank agreed to skip (non-finite reward, loss or grad norm on some rank)."""


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
    step_mask: Optional[torch.Tensor] = None   # [B, S] bool: the PRM's steps (step_scores')
    prof_steps: Optional[torch.Tensor] = None  # [B] PROF's H_i as released (text steps)
    problems: Optional[list] = None    # B problem statements (a generative judge reads them)
    references: Optional[list] = None  # B reference solutions or None (ditto)
    passed: Optional[torch.Tensor] = None  # [B] bool: passed rollout.refill's filter (None: off)


@dataclass
class Prompts:
    """One block of `data.prompts_per_step` prompts (global, before the dp split): the prompt
    texts, the verifier's truths (arithmetic: `Problem`s; math: answer strings), and what a
    generative judge is shown (problem statement, reference solution or None)."""

    texts: list
    truths: list
    problems: list
    references: list

    def shard(self, lo: int, hi: int) -> "Prompts":
        return Prompts(self.texts[lo:hi], self.truths[lo:hi], self.problems[lo:hi],
                       self.references[lo:hi])

    @staticmethod
    def cat(parts: list) -> "Prompts":
        return Prompts(*([x for p in parts for x in getattr(p, f)]
                         for f in ("texts", "truths", "problems", "references")))


# ----------------------------------------------------------------------------- config digest

_NOT_DIGESTED = {"trainer": ("steps", "save_every", "resume", "resume_fallback", "replace_run",
                             "eval_every",
                             "eval_problems",
                             "wandb", "progress", "keep_last", "allow_config_change",
                             "export_hf", "log_samples", "run_dir"),
                 # where the state sits while the engine generates, not what is computed: a run
                 # may resume with offload switched on or off (bit-exact either way)
                 "actor": ("offload",), "ref": ("offload",), "prm": ("offload",)}


def config_digest_fields(cfg: Config) -> dict:
    """The flattened config a checkpoint must match to be resumed: method, model, data, rollout,
    update and seed (not run length, logging or checkpoint cadence)."""
    flat = {}

    def walk(prefix, node):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                walk(key, v)
            else:
                flat[key] = list(v) if isinstance(v, tuple) else v
    d = to_dict(cfg)
    d.pop("parallel", None)  # the layout is checked separately (world, tp, pp)
    for section, keys in _NOT_DIGESTED.items():
        for k in keys:
            d.get(section, {}).pop(k, None)
    walk("", d)
    return flat


# ----------------------------------------------------------------------------- layout helpers

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


def logprob_post(spec, groups: Groups, temperature: float, with_entropy: bool = False,
                 also_at: Optional[float] = None):
    """`post` for pipeline.run: token log-probs [n, L-1] (and entropy) at `temperature`, one row
    per sequence of the micro-batch (packed rows unpacked). `also_at` (no entropy): the same
    logits' log-probs at a second temperature too, stacked last: [n, L-1, 2]."""
    def logprobs(mb, logits, t, entropy=False):
        return next_token_logprobs(logits, mb.input_ids, tp_group=groups.tp,
                                   tp_rank=groups.tp_rank, vocab_size=spec.vocab_size,
                                   with_entropy=entropy, temperature=t)

    def post(mb, logits):
        out = logprobs(mb, logits, temperature, with_entropy)
        if with_entropy:
            return None, (microbatch.unpack(mb, out[0]), microbatch.unpack(mb, out[1]))
        if also_at is not None:
            out = torch.stack([out, logprobs(mb, logits, also_at)], dim=-1)
        return None, microbatch.unpack(mb, out)
    return post


class Policy:
    """A Megatron causal LM on this rank (actor, reference or implicit PRM) + its optimiser.
    `temperature`: the distribution its log-probs describe (actor and ref: `logprob_temperature`,
    the rollout's unless a recipe says otherwise)."""

    def __init__(self, spec, groups: Groups, src: model_source.ModelSource, *, trainable: bool,
                 optim=None, dtype=torch.float32, temperature: float = 1.0, batching=None,
                 build: Optional[dict] = None):
        self.spec, self.groups, self.src, self.temperature = spec, groups, src, temperature
        self.batching = batching or Batching(16, None, groups.pp_size)
        model = pipeline.build_stage(spec, groups, dtype=dtype, **(build or {}))
        model_source.load_weights(model, src, spec, groups)
        if trainable:
            self.model = pipeline.wrap_ddp(model, groups)
            self.opt = pipeline.Optimizer(self.model, optim, groups)
        else:
            self.model, self.opt = model.eval(), None
            for p in model.parameters():
                p.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                 also_at: Optional[float] = None):
        """log p_T(input_ids[:, t+1] | <=t) [B, L-1] on every rank, on the host (forward only).
        `lengths` [B]: real tokens per row (needed to pack; 0 past them when packed).
        `also_at`: a second temperature (the sampler's, for the monitor) from the same forward:
        returns (log-probs at T, log-probs at also_at)."""
        B = input_ids.shape[0]
        mbs = self.batching.split(input_ids, torch.zeros(input_ids.shape[0],
                                                         input_ids.shape[1] - 1), None, lengths)
        parts = pipeline.run(self.model, mbs, groups=self.groups, forward_only=True,
                             post=logprob_post(self.spec, self.groups, self.temperature,
                                               also_at=also_at))
        out = to_host(microbatch.to_rows(mbs, parts, B)) if parts else None
        out = pipeline.broadcast_from_last_stage(out, self.groups)
        return out if also_at is None else (out[..., 0], out[..., 1])


@dataclass(frozen=True)
class Batching:
    """How a phase's rows become micro-batches: `micro_batch_size` padded rows, or packed rows
    of at most `max_tokens` tokens (then `lengths` are needed). Payload and outputs stay one row
    per sequence (`microbatch.unpack` / `to_rows`)."""

    micro_batch_size: int
    max_tokens: Optional[int]
    pp_size: int

    def split(self, ids, mask_t, payload, lengths=None) -> List[pipeline.TokenBatch]:
        """ids [B, L]; mask_t [B, L-1] target-aligned (position t predicts t+1)."""
        mask = torch.nn.functional.pad(mask_t, (0, 1))
        if self.max_tokens is not None and lengths is not None:
            return microbatch.make_micro_batches(ids, mask, payload, max_tokens=self.max_tokens,
                                                 lengths=lengths, pp_size=self.pp_size)
        return microbatch.make_micro_batches(ids, mask, payload,
                                             micro_batch_size=self.micro_batch_size,
                                             pp_size=self.pp_size)


def _split(ids, mask, payload, size, pp) -> List[pipeline.TokenBatch]:
    """Micro-batches of `size` padded rows (mask [B, L-1]); with pp > 1 all the same shape."""
    return Batching(size, None, pp).split(ids, mask, payload)


# Per micro-batch sums the update reports; the step's value of each is sum / count over every
# micro-batch, mini-batch and dp rank ("tokens" counts valid tokens, "minibatches" updates).
_TOKEN_MEANS = ("actor/clip_frac", "actor/dual_clip_frac", "actor/approx_kl", "actor/ratio_mean",
                "actor/entropy_token_mean")
_MINIBATCH_MEANS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/loss")


class RLTrainer:
    """Builds the models for one rank and runs RL steps. `cfg.model.path`: the policy (an HF
    directory or a megaprm checkpoint); `cfg.prm.path`: the discriminative PRM."""

    def __init__(self, cfg: Config, groups: Groups, tokenizer):
        from megaprm.rewards.steps import separator_token_ids
        from megaprm.trainer.preflight import check_batch

        self.cfg, self.groups, self.tok = cfg, groups, tokenizer
        check_batch(cfg, groups.dp_size)
        self.lock = _lock_run_dir(cfg.trainer.run_dir, groups)
        if not cfg.trainer.resume:  # an earlier run there: refused, or moved aside (replace_run)
            checkpoint.start_fresh(cfg.trainer.run_dir, groups, replace=cfg.trainer.replace_run,
                                   log=print if groups.rank == 0 else (lambda _m: None))
        self.run_id = uuid.uuid4().hex[:12]  # a resume takes the checkpoint's
        # the data first: a bad prompt file fails before any model is built
        self.data = _make_data(cfg, tokenizer, log=print if groups.rank == 0 else None)
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
        self.engine = self._build_engine()
        self.engine.sleep()
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
            self._build_discriminative_prm()
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
            self._build_grader()
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
        self.lifecycle = Lifecycle(self.engine, self._stream_weights, self._offloads())
        self.sync_weights()

    @staticmethod
    def tokenizer_dir(model_path: str) -> str:
        """Where the tokenizer of `model.path` lives (the HF dir, or a checkpoint's hf/)."""
        return model_source.resolve(model_path, "model.path").hf_dir

    # ------------------------------------------------------------------ construction helpers
    def _build_discriminative_prm(self):
        from megaprm.models.prm import build_prm
        from megaprm.rewards.scoring import ChatStepFormat, resolve_prm_input_format

        src = model_source.resolve(self.cfg.prm.path, "prm.path")
        g = self.groups
        spec = spec_from_hf(src.hf_dir)
        # prm.forward=released also runs it in bf16 (prof_dp_rm.py:255 autocast); else the
        # run's dtype (model.dtype, resolved: bf16 on CUDA, fp32 on the CPU by default)
        dtype = (torch.bfloat16 if self.cfg.prm.forward == "released"
                 else resolve_dtype(self.cfg.model.dtype))
        model = build_prm(spec, tp=g.tp_size, pp=g.pp_size, pp_rank=g.pp_rank, dtype=dtype)
        model_source.load_weights(model, src, spec, g)
        self.prm, self.prm_spec = model.eval(), spec
        self.prm_fmt = resolve_prm_input_format(self.cfg.prm.input_format, src.hf_dir,
                                                hf_config=spec.hf_config)
        if isinstance(self.prm_fmt, ChatStepFormat) and self.cfg.advantage.method == "pure":
            raise ConfigError("advantage.method=pure needs token positions of the steps; "
                              f"prm.input_format={self.prm_fmt.name} scores text steps. Use a "
                              "token-classification PRM (prm.input_format=pure)")

    def _build_grader(self):
        """prm.kind=judge: the grader LLM at prm.path on its own engine (the rollout factory;
        transformers on CPU, vLLM on GPU), with its own tokenizer and chat template."""
        from transformers import AutoTokenizer

        from megaprm.config import RolloutConfig
        from megaprm.parallel.device import rank_device
        from megaprm.rollout.factory import build_engine

        from checkpoint_tools.layout import has_weights

        src = model_source.resolve(self.cfg.prm.path, "prm.path")
        if not has_weights(src.hf_dir):
            raise ConfigError(f"prm.path={self.cfg.prm.path!r}: prm.kind=judge needs the grader's "
                              "HF weights (config.json + safetensors); export a checkpoint with "
                              "checkpoint_tools export-hf first")
        jc, g = self.cfg.prm.judge, self.groups
        self.grader_tok = AutoTokenizer.from_pretrained(src.hf_dir)
        rc = RolloutConfig(engine=jc.engine, temperature=max(jc.temperature, 1e-6),
                           top_p=jc.top_p, max_tokens=jc.max_tokens,
                           gpu_memory_utilization=self.cfg.rollout.gpu_memory_utilization,
                           sleep_level=1)  # woken (not reloaded) before each grading
        self.grader = build_engine(rc, src.hf_dir, self.grader_tok, world_size=g.world_size,
                                   tp_size=g.tp_size, seed=self.cfg.trainer.seed,
                                   device=rank_device())

    def _offloads(self) -> List[Offload]:
        """The models whose `*.offload` switch is on, with their optimizers (PRIME's second
        reference at T = 1 follows ref.offload)."""
        cfg, out = self.cfg, []
        if cfg.actor.offload:
            out.append(Offload("actor", self.actor.model, self.actor.opt))
        if cfg.ref.offload:
            refs = [self.ref, getattr(self, "implicit_ref", None)]
            out += [Offload("ref", r.model) for i, r in enumerate(refs)
                    if r is not None and r not in refs[:i]]
        if cfg.prm.offload and self.prm is not None:
            out.append(Offload("prm", self.prm))
        if cfg.prm.offload and self.implicit is not None:
            out.append(Offload("prm", self.implicit.model, self.implicit.opt))
        return out

    def _build_engine(self):
        """The colocated rollout engine on this rank's device (vLLM: external_launcher when
        world > 1, the trainer's tp, one seed per tp group); it starts from the policy's HF
        config and holds the actor's weights after the first sync (it reads no weights: the
        actor's are checked and loaded once, by the actor)."""
        from megaprm.parallel.device import rank_device
        from megaprm.rollout.factory import build_engine

        g = self.groups
        return build_engine(self.cfg.rollout, self.src.hf_dir, self.tok,
                            world_size=g.world_size, tp_size=g.tp_size,
                            seed=self.cfg.trainer.seed, device=rank_device(), load_weights=False)

    # ------------------------------------------------------------------ phases
    def sync_weights(self) -> None:
        """Phase: new actor weights -> the colocated rollout engine (HF names, one collective
        per bucket; the engine wakes its weights, loads and resets its prefix cache; its KV
        cache wakes when it next generates, after the trainer's state is offloaded)."""
        self.lifecycle.sync()

    def _stream_weights(self) -> None:
        load = functools.partial(self.engine.update_weights, wake_kv_cache=False)
        s = weight_sync.sync_into(load, self.actor.model, self.groups)
        self.last_sync = {"weight_sync/seconds": s["seconds"],
                          "weight_sync/gbytes": s["bytes"] / 1e9, "weight_sync/gbps": s["gbps"]}

    def rollout(self, block: int, requeued: tuple = ()):
        """Phase: this rank's share of prompt block `block` (= the step without refill) -> n
        samples each, between the trainer's state leaving the device and coming back
        (`Lifecycle.generate`: the engine sleeps after it). Same seed on every
        tp/pp peer. `requeued`: global prompt ids (block * P + index) generated first, before
        the block's share (rollout.refill_surplus=requeue). Returns (batch, this rank's
        `Prompts`, global group ids [B])."""
        cfg, g = self.cfg, self.groups
        prompts = self.data(block)
        P = len(prompts.texts)
        per = P // g.dp_size
        lo = g.dp_rank * per
        local = prompts.shard(lo, lo + per)
        ids_of_groups = torch.tensor([*requeued, *range(block * P + lo, block * P + lo + per)])
        if requeued:
            local = Prompts.cat([self.data(gid // P).shard(gid % P, gid % P + 1)
                                 for gid in requeued] + [local])
        ids = encode_prompts(self.tok, local.texts)
        params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature,
                                top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_tokens,
                                stop_token_ids=(self.eos,),
                                seed=(cfg.trainer.seed * 1_000_003 + block * 7919
                                      + g.dp_rank * 104_729) % (2**31))
        batch = self.lifecycle.generate(lambda: self.engine.generate(ids, params))
        group_ids = ids_of_groups[batch.group_index].long()
        return batch, local, group_ids

    def refill_rollout(self, t) -> tuple:
        """Phases rollout + outcome reward with dynamic sampling (`rollout.refill`; PRIME's
        released loop, ray_trainer.py:467-542: generate, verify, filter, until the filtered
        batch holds train_batch_size prompts; DAPO / verl's filter_groups likewise).

        Each round generates one fresh prompt block (`self.next_block`) on every rank; each dp
        rank fills its own share P/dp of the step's P groups with the groups of its rounds that
        pass the filter, first come first taken (groups never move between ranks, so the batch
        keeps today's shape [P/dp * n rows] on every rank). Whether another round is needed is
        agreed over dp (the largest shortfall), so every rank runs the same number of rounds.
        After `rollout.max_refill_rounds` extra rounds the shares are topped up with filtered-out
        groups marked `passed = False` (no gradient: the update masks them): the step trains
        on what passed. Surplus passing groups are dropped (verl's DAPO recipe), or with
        `rollout.refill_surplus: requeue` their prompts are generated again at the head of the
        next step's first round (PRIME's add_to_buffer / get_from_buffer, ray_trainer.py:460-480,
        per rank here). Returns (ScoredBatch with `passed`, metrics)."""
        cfg, g = self.cfg, self.groups
        n = cfg.rollout.n
        share = cfg.data.prompts_per_step // g.dp_size
        rounds: list = []  # (ScoredBatch, oracle checks, passed per local group [share])
        taken = 0
        requeued, self.requeue = tuple(self.requeue), []
        while True:
            block = self.next_block
            self.next_block += 1
            with t("rollout"):
                batch, prompts, group_ids = (self.rollout(block, requeued) if requeued
                                             else self.rollout(block))
            requeued = ()
            fault = None
            with t("outcome_reward"):
                try:
                    sb = self.outcome_reward(batch, prompts, group_ids)
                except FloatingPointError as e:
                    fault = str(e)
                fault = agree(fault, g)  # before the filter's collective: all skip, or none
                if fault is not None:
                    raise StepSkipped(fault)
                ok = self._refill_filter(sb).view(-1, n)[:, 0]  # groups are n contiguous rows
            rounds.append((sb, getattr(self, "_checks", None), ok))
            taken = min(share, taken + int(ok.sum()))
            short = dp_reduce({"short": share - taken}, g, op="max")["short"]
            if short == 0 or len(rounds) > cfg.rollout.max_refill_rounds:
                break
        picks = _pick_groups([ok for _, _, ok in rounds], share)
        if cfg.rollout.refill_surplus == "requeue":
            self.requeue = [int(r_sb.group_ids[gi * n])
                            for (r_sb, _, ok), pick in zip(rounds, picks)
                            for gi in range(ok.numel()) if ok[gi] and gi not in pick]
        sb = self._take_groups(rounds, picks)
        metrics = {"rollout/refill_rounds": float(len(rounds) - 1),
                   "rollout/groups_generated": float(len(rounds) * cfg.data.prompts_per_step),
                   "rollout/groups_kept": dp_sum(float(sb.passed.sum()) / n, g),
                   "rollout/refill_capped": float(short > 0),
                   "rollout/requeued": dp_sum(float(len(self.requeue)), g)}
        return sb, metrics

    def _refill_filter(self, sb: ScoredBatch) -> torch.Tensor:
        """[B] bool: the sample's group passes `rollout.refill` (accuracy: mean outcome in
        [advantage.prime.acc_low, acc_high], filters.accuracy as PRIME's ray_trainer.filter;
        std: the outcomes of the group are not all equal, verl's filter_groups std > 0)."""
        from megaprm.algorithms import filters
        from megaprm.parallel.reductions import group_index, group_moments

        grp = pipeline.optional_group(self.groups.host_dp)
        o = sb.outcome.to(torch.float64)
        if self.cfg.rollout.refill == "accuracy":
            pc = self.cfg.advantage.prime
            return filters.accuracy(o, sb.group_ids, low=pc.acc_low, high=pc.acc_high, group=grp)
        index = group_index(sb.group_ids, grp, o.shape[0])
        # two-pass moments: a group of equal outcomes has exactly zero spread
        return index.per_sample(group_moments(o[:, None], index).m2)[:, 0] > 0

    def _take_groups(self, rounds: list, picks: list) -> ScoredBatch:
        """The picked groups of every round as one ScoredBatch (rows regrouped in pick order;
        steps re-segmented on the joined padding; oracle checks kept row by row)."""
        from megaprm.rewards.steps import segment_steps

        n = self.cfg.rollout.n
        rows = [torch.cat([torch.arange(gi * n, gi * n + n) for gi in gs]) if gs else
                torch.zeros(0, dtype=torch.long) for gs in picks]
        parts = [(sb, checks, r) for (sb, checks, _), r in zip(rounds, rows)]
        batch = _join_rollouts([(sb.rollout, r) for sb, _, r in parts], n)
        passed = torch.cat([ok.repeat_interleave(n)[r] for (_, _, ok), r in zip(rounds, rows)])

        def cat(f):
            return torch.cat([getattr(sb, f)[r] for sb, _, r in parts])

        def pick(f):
            return [getattr(sb, f)[i] for sb, _, r in parts for i in r.tolist()]
        wrong = (cat("correct_with_wrong_step") if parts[0][0].correct_with_wrong_step
                 is not None else None)
        if parts[0][1] is not None:
            self._checks = [c[i] for _, c, r in parts for i in r.tolist()]
        seg = segment_steps(batch.response_ids, batch.response_mask, self.sep_ids)
        return ScoredBatch(batch, cat("outcome"), cat("group_ids"), seg,
                           correct_with_wrong_step=wrong, problems=pick("problems"),
                           references=pick("references"), passed=passed)

    def outcome_reward(self, batch: RolloutBatch, prompts: Prompts, group_ids):
        """Phase: verifier. Arithmetic: exact per-step check; math: math-verify."""
        from megaprm.rewards.steps import segment_steps

        texts = batch.decode_responses(self.tok)
        seg = segment_steps(batch.response_ids, batch.response_mask, self.sep_ids)
        rows = [int(i) for i in batch.group_index]
        truths_b = [prompts.truths[i] for i in rows]
        wrong_step = None
        if self.cfg.data.task == "arithmetic":
            from megaprm.tasks.arithmetic import check_steps

            checks = [check_steps(p, t, ends_with_eos=r == "stop")
                      for p, t, r in zip(truths_b, texts, batch.finish_reason)]
            outcome = torch.tensor([float(c.final_correct) for c in checks])
            wrong_step = torch.tensor([c.correct_with_wrong_step for c in checks])
            self._checks = checks  # the oracle PRM's labels
        else:
            from megaprm.rewards.verifiers import score_outcomes

            outcome = score_outcomes(texts, truths_b, kind="math",
                                     verifier=self.cfg.reward.verifier)
            if self.cfg.reward.llm_fallback:
                outcome = self._llm_fallback(texts, truths_b,
                                             [prompts.problems[i] for i in rows], outcome)
        outcome = self._fault_hook("outcome", outcome)
        if not torch.isfinite(outcome).all():
            raise FloatingPointError("verifier returned non-finite rewards")
        return ScoredBatch(batch, outcome, group_ids, seg, correct_with_wrong_step=wrong_step,
                           problems=[prompts.problems[i] for i in rows],
                           references=[prompts.references[i] for i in rows])

    def _llm_fallback(self, texts, truths, problems, outcome):
        """reward.llm_fallback (PAPO): the prm.kind=judge grader re-grades the answers the
        verifier called wrong (rewards.judge.llm_answer_fallback); its shares are logged."""
        import dataclasses

        from megaprm.rewards.judge import llm_answer_fallback

        jc = self.cfg.prm.judge
        jc = dataclasses.replace(jc, seed=(jc.seed + 7919 * self._step + 104_729
                                           * self.groups.dp_rank + 1) % (2**31))
        if self.grader.asleep:
            self.grader.wake()
        outcome, m = llm_answer_fallback(self.grader, self.grader_tok, problems, truths, texts,
                                         outcome, jc)
        self.grader.sleep()
        self._fallback_metrics = m
        return outcome

    def _fault_hook(self, where: str, t: torch.Tensor) -> torch.Tensor:
        """Fault injection for the reliability tests: MEGAPRM_FAULT=where:rank:step puts a NaN
        into `where` on that rank at that step. Inert unless the variable is set."""
        spec = os.environ.get("MEGAPRM_FAULT")
        if not spec:
            return t
        w, r, s = spec.split(":")
        if w == where and int(r) == self.groups.rank and int(s) == self._step:
            t = t.clone().float()
            t.view(-1)[0] = float("nan")
        return t

    def process_reward(self, sb: ScoredBatch) -> None:
        """Phase: discriminative PRM, P(step correct) per step (PRIME's implicit PRM scores
        inside its update, `prime_prm`)."""
        from megaprm.rewards.scoring import ChatStepFormat, score_rollouts
        from megaprm.rewards.steps import prof_num_steps

        b, mbs = sb.rollout, self.cfg.actor.micro_batch_size
        if self.cfg.prm.kind == "judge":
            self._judge_scores(sb)
            return
        if self.cfg.prm.kind == "oracle":
            sb.step_scores, sb.step_mask = oracle_step_scores(self._checks, sb.seg.step_mask)
            sb.prof_steps = prof_num_steps(b.decode_responses(self.tok))
            return
        if self.prm is not None:
            scores, _ = score_rollouts(self.prm, self.groups, b.prompt_ids, b.prompt_mask,
                                       b.response_ids, b.response_mask, sep_ids=self.sep_ids,
                                       fmt=self.prm_fmt, head=self.prm_spec.head,
                                       micro_batch_size=mbs, pad_id=self.pad,
                                       forward=self.cfg.prm.forward)
            s = to_host(scores.scores)
            if self.prm_spec.head == "token_cls":  # PURE's PR = 2p - 1 -> p
                s = torch.where(to_host(scores.step_mask), (s + 1) / 2, torch.zeros_like(s))
            sb.step_scores, sb.step_mask = s, to_host(scores.step_mask).bool()
            # PROF's H_i: the released text split (prof_dp_rm.py), or the chat format's own
            # step count, which is the same split after the PRM's truncation
            sb.prof_steps = (sb.step_mask.sum(1) if isinstance(self.prm_fmt, ChatStepFormat)
                             else prof_num_steps(b.decode_responses(self.tok)))

    def _judge_scores(self, sb: ScoredBatch) -> None:
        """prm.kind=judge (PAPO's released process score, reward_score/__init__.py:150-163):
        the grader grades the correct responses against their reference solutions; the grade
        is one [B, 1] "step" score, so PAPO's (and Blend's, PROF's) sequence process score is
        it. Incorrect responses, missing references and unparseable grades score 0 (counted;
        the counts are summed over dp ranks)."""
        import dataclasses

        from megaprm.rewards.judge import judge_process_scores
        from megaprm.rewards.steps import prof_num_steps

        b, g = sb.rollout, self.groups
        texts = b.decode_responses(self.tok)
        jc = self.cfg.prm.judge
        jc = dataclasses.replace(jc, seed=(jc.seed + 7919 * self._step + 104_729 * g.dp_rank)
                                 % (2**31))
        if self.grader.asleep:  # the grader sleeps (level 1, weights kept) between steps
            self.grader.wake()
        res = judge_process_scores(self.grader, self.grader_tok, sb.problems, sb.references,
                                   texts, sb.outcome, jc)
        self.grader.sleep()
        sb.step_scores, sb.step_mask = res.as_step_scores()
        sb.prof_steps = prof_num_steps(texts)
        # global counts (the same on every rank, so step_or_skip's dp mean keeps them)
        m = res.metrics
        counts = dp_reduce({**{k: v for k, v in m.items() if k != "judge/grade_mean"},
                            "graded": m["judge/grade_mean"] * m["judge/judged"]}, g)
        graded = counts.pop("graded")
        counts["judge/grade_mean"] = graded / counts["judge/judged"] if counts["judge/judged"] \
            else 0.0
        self._judge_metrics = counts

    def advantages(self, sb: ScoredBatch, logp_old_resp, logp_ref_resp) -> AdvantageOutputs:
        """Phase: estimator from the registry; group statistics reduced over dp (host group)."""
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
        gen = torch.Generator().manual_seed(self.cfg.trainer.seed + int(sb.group_ids.min()))
        return compute_advantages(self.cfg.advantage, inputs, group=pipeline.optional_group(
            self.groups.host_dp), generator=gen)

    def update_actor(self, rp: RightPadded, adv_t, logp_old_t, logp_ref_t, keep) -> dict:
        """Phase: PPO-clip through Megatron's schedule, `actor.mini_batches` optimiser steps.
        Normalisers are global (all dp ranks, all micro-batches) so any layout takes the same
        step. All or nothing: a non-finite loss or grad norm in any mini-batch restores the
        parameters and optimiser state of before the first one and raises StepSkipped."""
        cfg = self.cfg.actor
        mask_t = rp.loss_mask[:, :-1] * keep[:, None].float()
        lengths = rp.attention_mask.long().sum(1)
        B = rp.input_ids.shape[0]
        rows_per = B // cfg.mini_batches  # check_batch: mini_batches divides B
        sums: dict = {}
        maxes = {"actor/ratio_max": 0.0, "actor/grad_norm_max": 0.0}
        updates = 0
        try:  # one mini-batch needs no rollback: its step is skipped before anything moves
            with self.actor.opt.all_or_nothing(enabled=cfg.mini_batches > 1):
                for k in range(cfg.mini_batches):
                    rows = slice(k * rows_per, (k + 1) * rows_per)
                    mb_metrics = self._update_minibatch(
                        rp.input_ids[rows], mask_t[rows], adv_t[rows], logp_old_t[rows],
                        None if logp_ref_t is None else logp_ref_t[rows],
                        lengths=lengths[rows])
                    if mb_metrics is None:  # no valid token in this mini-batch on any rank
                        continue
                    updates += 1
                    if updates == 1:  # live guard: 1 when the trainer sees the sampler's policy
                        first = mb_metrics["actor/ratio_mean"] / mb_metrics["tokens"]
                    for key, v in mb_metrics.items():
                        if key in maxes:
                            maxes[key] = max(maxes[key], v)
                        else:
                            sums[key] = sums.get(key, 0.0) + v
        except StepSkipped:
            self.actor.opt.zero_grad()
            raise
        out = {"actor/updates": float(updates), **maxes}
        tokens = max(sums.get("tokens", 0.0), 1.0)
        for key in _TOKEN_MEANS:
            if key in sums:
                out[key] = sums[key] / tokens
        for key in _MINIBATCH_MEANS:
            if key in sums:
                out[key] = sums[key] / max(updates, 1)
        if updates:
            out["actor/ratio_first_minibatch"] = first
        out["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) / max(updates, 1)
        out["actor/lr"] = self.cfg.actor.optim.lr
        if self.cfg.actor.skip_ratio_above is not None:
            out["actor/ratio_skipped_microbatches"] = sums.get(
                "actor/ratio_skipped_microbatches", 0.0)
        return out

    def _update_minibatch(self, ids, m, adv, old, ref, lengths=None) -> Optional[dict]:
        """One optimiser step on one mini-batch; returns dp-reduced sums (token-weighted means
        as sums x tokens) or None when the mini-batch has no valid token anywhere."""
        cfg, g = self.cfg.actor, self.groups
        local_tokens = float(m.sum())
        tokens = dp_sum(local_tokens, g)
        seqs = dp_sum(float((m.sum(1) > 0).sum()), g)
        if tokens == 0:
            return None
        payload = {"adv": adv, "old": old, "m": m}
        if ref is not None:
            payload["ref"] = ref
        mbs = self.batching.split(ids, m, payload, lengths)
        temperature = self.temperature

        def post(mb, logits):
            lp, ent = next_token_logprobs(
                logits, mb.input_ids, tp_group=g.tp, tp_rank=g.tp_rank,
                vocab_size=self.spec.vocab_size, with_entropy=True, temperature=temperature)
            lp, ent = microbatch.unpack(mb, lp), microbatch.unpack(mb, ent)  # rows of payload
            p = mb.payload
            loss, met = actor_loss(lp, p["old"], p["adv"], p["m"], eps_low=cfg.eps_low,
                                   eps_high=cfg.eps_high, dual_clip_c=cfg.dual_clip_c,
                                   agg=cfg.loss_agg, entropy=ent, entropy_coef=cfg.entropy_coef,
                                   logp_ref=p.get("ref"), kl_coef=cfg.kl_coef,
                                   kl_kind=cfg.kl_kind, global_tokens=tokens, global_seqs=seqs,
                                   norm_len=self.cfg.rollout.max_tokens, host=False)
            # Metrics stay on the device: `_update_minibatch` reads the whole mini-batch's at once
            n = p["m"].sum()
            skipped = torch.zeros((), dtype=loss.dtype, device=loss.device)
            if cfg.skip_ratio_above is not None:  # PURE: this micro-batch moves nothing
                ratio = guard_ratio_mean(lp, p["old"], p["m"], cfg.skip_ratio_scope)
                skipped = (ratio > cfg.skip_ratio_above).to(loss.dtype)
                loss = loss * (1.0 - skipped)
            sums = {k: met[k] * n for k in ("actor/clip_frac", "actor/dual_clip_frac",
                                            "actor/approx_kl", "actor/ratio_mean")}
            sums["actor/ratio_skipped_microbatches"] = skipped
            sums["actor/entropy_token_mean"] = (ent.detach() * p["m"]).sum()
            for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
                if k in met:
                    sums[k] = met[k]  # already divided by the global normaliser
            sums["actor/loss"] = loss.detach()
            sums["ratio_max"] = met["actor/ratio_max"]
            return loss, {"keys": list(sums), "values": torch.stack(
                [v.to(torch.float32) for v in sums.values()])}

        self.actor.opt.zero_grad()
        parts = pipeline.run(self.actor.model, mbs, groups=g, post=post, forward_only=False)
        local, ratio_max = {}, 0.0
        if parts:  # the one host read of the mini-batch's metrics (last stage)
            keys = parts[0]["keys"]
            rows = torch.stack([part["values"] for part in parts]).tolist()
            for i, k in enumerate(keys):
                if k == "ratio_max":
                    ratio_max = max(r[i] for r in rows)
                else:
                    local[k] = sum(r[i] for r in rows)
        local = pipeline.broadcast_from_last_stage(local, g)
        ratio_max = pipeline.broadcast_from_last_stage(ratio_max, g)
        summed = dp_reduce(local, g)
        loss = summed.get("actor/loss", 0.0)
        if not math.isfinite(loss):
            raise StepSkipped(f"actor loss is {loss}")
        grad_norm, applied = self.actor.opt.step()
        if not applied:
            raise StepSkipped(f"actor grad norm is {grad_norm}")
        return {**summed, "tokens": tokens, "actor/grad_norm": grad_norm,
                "actor/grad_norm_max": grad_norm,
                "actor/ratio_max": dp_reduce({"r": ratio_max}, g, op="max")["r"]}

    def prime_prm(self, sb: ScoredBatch, rp: RightPadded, lengths, logp_ref_t) -> dict:
        """Phase (PRIME, released `update=after`, research §1.3/§1.6): the implicit PRM is
        trained with BCE(sigmoid(beta * sum_t q_t), outcome) on the accuracy-filtered rollouts
        in `prm.mini_batches` optimiser steps, and each mini-batch's q = log pi_prm - log pi_ref
        is the one computed inside the update (mini-batch k is scored by the PRM after k-1
        steps). Filtered-out rows are never trained on and get q = 0 (the policy loss masks
        them). `prm.update=none` scores all rows with the current PRM and never trains it."""
        from megaprm.algorithms import filters

        cfg, g = self.cfg, self.groups
        pc = cfg.advantage.prime
        B = rp.input_ids.shape[0]
        if cfg.prm.update == "none":
            lp = self.implicit.logprobs(rp.input_ids, lengths)
            self._set_q(sb, rp, lp - logp_ref_t)
            return {}
        keep = (filters.accuracy(sb.outcome.float(), sb.group_ids, low=pc.acc_low,
                                 high=pc.acc_high, group=pipeline.optional_group(g.host_dp))
                if pc.accuracy_filter else torch.ones(B, dtype=torch.bool))
        rows = keep.nonzero()[:, 0]
        q_t = torch.zeros(B, rp.input_ids.shape[1] - 1)
        losses, norms, applied = [], [], []
        for idx in rows.tensor_split(cfg.prm.mini_batches):
            lp, loss, grad_norm, ok = self._prm_minibatch(rp, idx, logp_ref_t, lengths,
                                                          sb.outcome)
            if idx.numel():
                q_t[idx] = lp - logp_ref_t[idx]
            losses.append(loss)
            norms.append(grad_norm)
            applied.append(ok)
        self._set_q(sb, rp, q_t)
        return {"prm/loss": sum(losses) / len(losses), "prm/grad_norm": max(norms),
                "prm/applied": float(all(applied)), "prm/updates": float(len(losses)),
                "prm/trained_rows": dp_sum(float(rows.numel()), g)}

    def _set_q(self, sb: ScoredBatch, rp: RightPadded, q_t: torch.Tensor) -> None:
        b = sb.rollout
        sb.q = targets_to_response(q_t, rp, b.response_ids.shape[1]) * b.response_mask
        fault = None if torch.isfinite(sb.q).all() else "implicit PRM produced non-finite q"
        fault = agree(fault, self.groups)
        if fault is not None:
            raise StepSkipped(fault)

    def _prm_minibatch(self, rp: RightPadded, idx, logp_ref_t, lengths, outcome):
        """One implicit-PRM optimiser step on rows `idx` of this rank (maybe none: the step's
        collectives still run); returns (log-probs [n, L-1] before the step, loss, grad norm,
        applied)."""
        g, beta = self.groups, self.cfg.prm.beta
        mask_t = rp.loss_mask[:, :-1][idx]
        seqs = dp_sum(float(idx.numel()), g)
        payload = {"ref": logp_ref_t[idx], "m": mask_t,
                   "o": outcome.float()[idx][:, None].expand_as(mask_t)}
        mbs = (self.batching.split(rp.input_ids[idx], mask_t, payload, lengths[idx])
               if idx.numel() else [])

        def post(mb, logits):
            lp = microbatch.unpack(mb, next_token_logprobs(
                logits, mb.input_ids, tp_group=g.tp, tp_rank=g.tp_rank,
                vocab_size=self.spec.vocab_size))
            p = mb.payload
            real = p["m"].sum(1) > 0  # pp padding rows carry no mask and no loss
            loss = implicit_prm_ce_loss(lp[real], p["ref"][real], p["m"][real],
                                        p["o"][real, 0], beta=beta, global_seqs=max(seqs, 1.0))
            return loss, {"lp": lp.detach(), "loss": float(loss.detach())}

        self.implicit.opt.zero_grad()
        parts = pipeline.run(self.implicit.model, mbs, groups=g, post=post, forward_only=False)
        lp = (to_host(microbatch.to_rows(mbs, [p["lp"] for p in parts], idx.numel()))
              if parts else None)
        loss = sum(p["loss"] for p in parts)
        lp, loss = pipeline.broadcast_from_last_stage((lp, loss), g)
        grad_norm, applied = self.implicit.opt.step()
        return lp, dp_sum(loss, g), grad_norm, applied

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> dict:
        cfg = self.cfg
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
        fault = agree(fault, self.groups)  # every rank skips, or none does
        if fault is not None:
            raise StepSkipped(fault)
        rp = batch.to_right_padded(self.pad)
        lengths = rp.attention_mask.long().sum(1)
        with t("old_logprobs"):
            # the monitor compares with the sampler at its own temperature (PURE: T=0.5 while
            # the update's log-probs are at T=1), from the same forward
            sampler_t = cfg.rollout.temperature
            if self.temperature == sampler_t:
                logp_old_t = logp_sampler_t = self.actor.logprobs(rp.input_ids, lengths)
            else:
                logp_old_t, logp_sampler_t = self.actor.logprobs(rp.input_ids, lengths,
                                                                 also_at=sampler_t)
            logp_ref_t = (self.ref.logprobs(rp.input_ids, lengths) if self.ref is not None
                          else None)
        R = batch.response_ids.shape[1]
        logp_old = targets_to_response(logp_old_t, rp, R)
        logp_ref = targets_to_response(logp_ref_t, rp, R) if logp_ref_t is not None else None
        prm_metrics = {}
        if self.implicit is not None:  # PRIME: train the PRM (filtered, mini-batched), score
            with t("prm_update"):
                imp_ref_t = (logp_ref_t if self.implicit_ref is self.ref
                             else self.implicit_ref.logprobs(rp.input_ids, lengths))
                prm_metrics = self.prime_prm(sb, rp, lengths, imp_ref_t)
        with t("advantages"):
            adv = self.advantages(sb, logp_old, logp_ref)
        adv_t = response_to_targets(adv.advantages, rp)
        logp_sampler = targets_to_response(logp_sampler_t, rp, R)
        metrics = {**self._rollout_metrics(sb, adv, logp_old, logp_sampler), **prm_metrics,
                   **refill_metrics, **self._judge_metrics, **self._fallback_metrics}
        # refill's top-up groups (the cap was hit) did not pass: no gradient from them
        keep = adv.keep if sb.passed is None else adv.keep & sb.passed
        update = (rp, adv_t, logp_old_t, logp_ref_t if cfg.actor.kl_coef else None, keep)
        if cfg.actor.shuffle_mini_batches:
            update = permute_rows(update, mini_batch_order(rp.input_ids.shape[0], cfg.trainer.seed,
                                                           step, self.groups.dp_rank))
        with t("update"):
            metrics.update(self.update_actor(*update))
        with t("weight_sync"):
            self.sync_weights()
        metrics.update(self.last_sync)
        metrics.update(t.times)
        elapsed = time.perf_counter() - t0
        tokens = float(batch.response_mask.sum() + batch.prompt_mask.sum())
        metrics["timing/step_s"] = elapsed
        metrics["throughput/tokens_per_s"] = dp_sum(tokens, self.groups) / max(elapsed, 1e-9)
        self._log_samples(step, sb)
        return metrics

    def _rollout_metrics(self, sb: ScoredBatch, adv: AdvantageOutputs, logp_old,
                         logp_sampler) -> dict:
        """Rank-local means (averaged over dp by `fit`) and the sampler-vs-trainer guard.
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
             "rollout/sampling_temperature": float(self.cfg.rollout.temperature),
             "rollout/logprob_temperature": float(self.temperature),
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
            prm_ok = min_score >= self.cfg.prm.low_score
            correct = sb.outcome > 0.5
            m["prm/score_mean"] = float(s[smask].mean()) if smask.any() else 0.0
            m["prm/outcome_agreement"] = float((prm_ok == correct).float().mean())
            m["prm/correct_with_low_prm_frac"] = float(
                (~prm_ok[correct]).float().mean()) if correct.any() else 0.0
        if sb.q is not None:
            m["prm/implicit_q_mean"] = float(sb.q.sum() / b.response_mask.sum().clamp(min=1))
        m.update(adv.metrics)
        return m

    def _log_samples(self, step: int, sb: ScoredBatch) -> None:
        """A few generations per step to samples.jsonl (rank 0's first rollouts)."""
        n = self.cfg.trainer.log_samples
        if self.groups.rank != 0 or n <= 0:
            return
        b = sb.rollout
        texts = b.decode_responses(self.tok)
        prompts = b.decode_prompts(self.tok, skip_special_tokens=True)
        with open(os.path.join(self.run_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
            for i in range(min(n, b.batch_size)):
                row = {"step": step, "prompt": prompts[i], "response": texts[i],
                       "outcome": float(sb.outcome[i]), "finish_reason": b.finish_reason[i]}
                if sb.step_scores is not None:
                    k = int(sb.seg.num_steps[i])
                    row["step_scores"] = [round(float(x), 4) for x in sb.step_scores[i, :k]]
                f.write(json.dumps(row) + "\n")

    def evaluate(self) -> dict:
        """Held-out greedy accuracy (arithmetic: plus the exact flawed-step shares)."""
        from megaprm.trainer import evaluate

        cfg = self.cfg
        n = cfg.trainer.eval_problems
        if cfg.data.task == "arithmetic":
            from megaprm.tasks.arithmetic import generate_problems

            problems = generate_problems(cfg.data.arithmetic, n, seed=HELD_OUT_SEED)
            r = self.lifecycle.generate(lambda: evaluate.evaluate_arithmetic(
                self.engine, self.tok, self.groups, problems, max_tokens=cfg.rollout.max_tokens,
                fmt=prompt_formatter(cfg.data, self.tok)))
        else:
            from megaprm.tasks.datasets import load_prompts

            records, _ = load_prompts(cfg.data.eval_path, limit=n)
            fmt = prompt_formatter(cfg.data, self.tok)  # the training prompts' format
            r = self.lifecycle.generate(lambda: evaluate.evaluate_math(
                self.engine, self.tok, self.groups,
                [fmt(x.prompt, x.meta.get("messages")) for x in records],
                [x.answer for x in records], max_tokens=cfg.rollout.max_tokens,
                verifier=cfg.reward.verifier))
        return {f"eval/{k}": float(v) for k, v in r.items()}

    # ------------------------------------------------------------------ checkpoints and loop
    def _ckpt_parts(self):
        models = {"actor": self.actor.model}
        optims = {"actor": self.actor.opt}
        sources = {"actor": self.src}
        if self.implicit is not None:
            models["prm"], optims["prm"] = self.implicit.model, self.implicit.opt
            sources["prm"] = self.implicit.src
        return models, optims, sources

    def save(self, step: int, crash_after_models: bool = False) -> str:
        models, optims, sources = self._ckpt_parts()
        dtype = self.cfg.model.dtype
        return checkpoint.save(
            self.ckpt_root, step, self.groups, models=models, optimizers=optims,
            sources={k: checkpoint.ModelSource(src.hf_dir, dtype) for k, src in sources.items()},
            trainer_state={"next_step": step + 1, "skipped_steps": self.skipped_steps,
                           "next_block": self.next_block, "run_id": self.run_id,
                           **self._requeue_state()},
            config=self.digest_fields, keep_last=self.cfg.trainer.keep_last,
            crash_after_models=crash_after_models)

    def _requeue_state(self) -> dict:
        """{"requeue": {dp rank: prompt ids}} for the checkpoint (rank 0 writes it; every rank's
        list is gathered first), or {} without rollout.refill_surplus=requeue."""
        if self.cfg.rollout.refill_surplus != "requeue":
            return {}
        lists = [self.requeue]
        if self.groups.world_size > 1:
            import torch.distributed as dist

            lists = [None] * self.groups.world_size
            dist.all_gather_object(lists, (self.groups.dp_rank, self.requeue),
                                   group=self.groups.agree)
            return {"requeue": {str(r): q for r, q in lists}}
        return {"requeue": {"0": lists[0]}}

    def maybe_resume(self) -> int:
        """Resume from the newest intact checkpoint (a damaged one is reported and skipped);
        refused when the layout or the digested config differ."""
        if not self.cfg.trainer.resume:
            return 0
        models, optims, _ = self._ckpt_parts()
        state = checkpoint.load(self.ckpt_root, self.groups, models=models, optimizers=optims,
                                config=self.digest_fields,
                                fallback=self.cfg.trainer.resume_fallback,
                                allow_config_change=self.cfg.trainer.allow_config_change,
                                log=print if self.groups.rank == 0 else (lambda _m: None))
        if state is None:
            return 0
        self.skipped_steps = state.get("skipped_steps", 0)
        self.run_id = state.get("run_id") or self.run_id
        self.next_block = state.get("next_block", state["next_step"])
        self.requeue = list(state.get("requeue", {}).get(str(self.groups.dp_rank), []))
        self.logger.truncate_after(state["step"])
        self.sync_weights()
        if self.groups.rank == 0:
            print(f"[megaprm] resumed from {state['path']} (next step {state['next_step']})",
                  flush=True)
        return state["next_step"]

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
                with_eval = self.evaluate()
                metrics.update(with_eval)
            self._warn_on_drift(step, metrics)
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
        self.logger.close()
        if self.lock is not None:
            self.lock.release()
        return history

    def step_or_skip(self, step: int) -> dict:
        """One step's metrics, the same on every rank: rollout metrics averaged over dp, the
        update's already global; or {'guard/skipped': 1} when every rank agreed to skip."""
        try:
            metrics = self.step(step)
            metrics = {**dp_mean({k: v for k, v in metrics.items()
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

    def _warn_on_drift(self, step: int, metrics: dict) -> None:
        """The engine and the trainer disagree on the sampled tokens' log-probs: a wrong
        temperature, stale engine weights, or a numerics problem (docs/rollout.md)."""
        d = metrics.get("rollout/logprob_diff_max")
        if d is not None and d > LOGPROB_DIFF_WARN and self.groups.rank == 0:
            print(f"[megaprm] warning: step {step}: sampler vs trainer log-prob max |diff| "
                  f"{d:.3g} > {LOGPROB_DIFF_WARN} (see docs/rollout.md)", flush=True)


def _pick_groups(passed: List[torch.Tensor], share: int) -> List[List[int]]:
    """Which local groups of each round make the step's `share` groups: passing groups first
    come first taken, then (when the cap left a shortfall) failing ones in the same order.
    passed: per round, [groups] bool. Returns per round the sorted local group indices."""
    order = [(r, gi) for r, ok in enumerate(passed) for gi in range(ok.numel()) if ok[gi]]
    order += [(r, gi) for r, ok in enumerate(passed) for gi in range(ok.numel()) if not ok[gi]]
    picks: List[List[int]] = [[] for _ in passed]
    for r, gi in order[:share]:
        picks[r].append(gi)
    return [sorted(p) for p in picks]


def _join_rollouts(parts: list, n: int) -> RolloutBatch:
    """Rows `r` of each RolloutBatch as one batch: prompts re-left-padded and responses
    re-right-padded to the widest part; group_index renumbered 0.. in row order (n per group)."""
    parts = [(b, r) for b, r in parts if r.numel()]
    pad = parts[0][0].pad_token_id
    P = max(b.prompt_ids.shape[1] for b, _ in parts)
    R = max(b.response_ids.shape[1] for b, _ in parts)

    def left(x, w, v):
        return torch.nn.functional.pad(x, (w - x.shape[1], 0), value=v)

    def right(x, w, v):
        return torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)
    cat = torch.cat
    B = sum(r.numel() for _, r in parts)
    return RolloutBatch(
        prompt_ids=cat([left(b.prompt_ids[r], P, pad) for b, r in parts]),
        prompt_mask=cat([left(b.prompt_mask[r], P, 0) for b, r in parts]),
        response_ids=cat([right(b.response_ids[r], R, pad) for b, r in parts]),
        response_mask=cat([right(b.response_mask[r], R, 0) for b, r in parts]),
        sampler_logprobs=cat([right(b.sampler_logprobs[r], R, 0.0) for b, r in parts]),
        finish_reason=[b.finish_reason[i] for b, r in parts for i in r.tolist()],
        group_index=torch.arange(B // n).repeat_interleave(n), pad_token_id=pad)


def oracle_step_scores(checks: list, step_mask: torch.Tensor) -> tuple:
    """The oracle process reward: step k of response i scores 1.0 if the exact checker marks it
    correct, else 0.0 ([B, S], on the token segmentation's steps, which `split_steps` matches;
    a step the checker did not see scores 0)."""
    scores = torch.zeros(step_mask.shape, dtype=torch.float32)
    for i, c in enumerate(checks):
        n = min(len(c.step_correct), step_mask.shape[1])
        scores[i, :n] = torch.tensor(c.step_correct[:n], dtype=torch.float32)
    return scores * step_mask, step_mask.bool()


def _lock_run_dir(run_dir: str, groups: Groups):
    """One run per run directory. The launcher (megaprm train) holds the lock for its ranks;
    started any other way (a hand-written torchrun, tests), global rank 0 takes it here and every
    rank learns the outcome, so a refused start stops all ranks with the same line."""
    from megaprm.trainer.run_lock import RunLock, RunLockError

    lock, err = None, None
    if groups.rank == 0 and os.environ.get(LOCK_ENV) != os.path.abspath(run_dir):
        try:
            lock = RunLock(run_dir).acquire()
        except RunLockError as e:
            err = str(e)
    err = agree(err, groups)
    if err is not None:
        if lock is not None:
            lock.release()
        raise checkpoint.CheckpointError(err.split(": ", 1)[-1])
    return lock


LOCK_ENV = "MEGAPRM_RUN_DIR_LOCKED"  # set by the launcher that holds the run directory's lock
HELD_OUT_SEED = 987_654_321  # arithmetic eval problems; training draws seed*100_003 + step
LOGPROB_DIFF_WARN = 1e-2     # fp32 engines agree to ~1e-6; bf16 vLLM vs Megatron ~1e-2 typical


def mini_batch_order(rows: int, seed: int, step: int, dp_rank: int) -> torch.Tensor:
    """actor.shuffle_mini_batches: this rank's row order for the update, a permutation [rows]
    fixed by (seed, step, dp rank), so a resumed run shuffles as the uninterrupted one."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 7919 + dp_rank * 104_729)
                                        % (2**63))
    return torch.randperm(rows, generator=gen)


def permute_rows(update: tuple, order: torch.Tensor) -> tuple:
    """update_actor's arguments (RightPadded, adv, old, ref or None, keep) with rows in `order`."""
    rp, *rest = update
    return (RightPadded(*(x[order] for x in rp)),
            *(None if x is None else x[order] for x in rest))


def logprob_temperature(cfg: Config) -> float:
    """The temperature of every log-prob the update uses (`actor.logprob_temperature`):
    rollout.temperature unless a number is set (PURE's release: T = 1 while sampling at 0.5)."""
    t = cfg.actor.logprob_temperature
    return float(cfg.rollout.temperature if t == "rollout" else t)


def encode_prompts(tokenizer, texts: list) -> list:
    """The token ids the engine is given: each prompt text encoded without added special tokens
    (a chat template's markers are in the text and parse as the special tokens they name), as
    verl's tokenize_and_postprocess_data and OpenRLHF's tokenizer call do."""
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def prompt_formatter(d, tokenizer):
    """(question, messages=None) -> the policy's prompt text under `data.prompt_format` (and
    data.prompt_template / system_prompt; tasks.datasets.policy_prompt). A chat format needs
    the policy tokenizer's chat template: refused here, before any model is built."""
    from megaprm.tasks.datasets import policy_prompt

    if d.prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.prompt_format='chat' needs a chat template in the policy's "
                          "tokenizer (tokenizer_config.json chat_template); this one has none. "
                          "Use data.prompt_format=raw or a tokenizer with a template")

    def fmt(question, messages=None):
        return policy_prompt(question, messages, fmt=d.prompt_format,
                             template=d.prompt_template, system=d.system_prompt,
                             tokenizer=tokenizer)
    return fmt


def _make_data(cfg: Config, tokenizer=None, log=None):
    """block -> `Prompts`: the global prompt batch number `block`, deterministic in it (a step
    without refill uses block = step, so resume needs nothing else; with refill the next block
    is saved trainer state). A prompt file is read once, with its load report printed (`log`)
    and `data.*` row rules applied; it is walked in order, block after block."""
    P = cfg.data.prompts_per_step
    d = cfg.data
    fmt = prompt_formatter(d, tokenizer)
    if cfg.data.task == "arithmetic":
        from megaprm.tasks.arithmetic import generate_problems, reference_solution

        def arithmetic(block):
            probs = generate_problems(cfg.data.arithmetic, P,
                                      seed=cfg.trainer.seed * 100_003 + block)
            texts = [p.prompt for p in probs]
            return Prompts([fmt(t) for t in texts], probs, texts,
                           [reference_solution(p) for p in probs])
        return arithmetic
    from megaprm.tasks.datasets import load_prompts

    records, report = load_prompts(d.path, on_bad_row=d.on_bad_row,
                                   keep_unanswered=d.keep_unanswered,
                                   max_prompt_tokens=d.max_prompt_tokens,
                                   long_prompt=d.long_prompt,
                                   tokenizer=tokenizer if d.max_prompt_tokens else None, log=log)
    if not records:
        raise ConfigError(f"data.path={d.path!r}: no usable rows ({report.summary()})")

    def math(block):
        rows = [records[(block * P + i) % len(records)] for i in range(P)]
        return Prompts([fmt(r.prompt, r.meta.get("messages")) for r in rows],
                       [r.answer for r in rows],
                       [r.question or r.prompt for r in rows], [r.reference for r in rows])
    math.report = report
    return math
