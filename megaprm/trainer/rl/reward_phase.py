"""Phases outcome reward (the verifier, with PAPO's LLM fallback) and process reward (a
discriminative PRM, the oracle's exact step labels, or a generative judge), and the reward
models' construction. PRIME's implicit PRM scores inside its own phase (implicit_prm.py).

Both phases read a `RewardContext` (the config, the groups, the tokenizer and the reward models)
and return a ScoredBatch; what they measure on the way travels in `ScoredBatch.metrics`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional

import torch

from checkpoint_tools import model_source
from megaprm import faults
from megaprm.config import Config
from megaprm.errors import ConfigError
from megaprm.models.hf_files import has_weights
from megaprm.models.hf_spec import spec_from_hf
from megaprm.parallel.device import rank_device, resolve_dtype, to_host
from megaprm.parallel.groups import Groups
from megaprm.parallel.host import dp_reduce
from megaprm.rewards import judge  # called through the module: a test can stand in for it
from megaprm.rewards.scoring import ChatStepFormat, resolve_prm_input_format, score_rollouts
from megaprm.rewards.steps import prof_num_steps, segment_steps
from megaprm.rewards.verifiers import score_outcomes
from megaprm.rollout.config import RolloutConfig
from megaprm.rollout.engine import RolloutBatch
from megaprm.rollout.factory import build_engine
from megaprm.tasks.arithmetic import check_steps
from megaprm.trainer.rl.batch import ScoredBatch
from megaprm.trainer.rl.data import Prompts


@dataclass(frozen=True)
class DiscriminativePRM:
    """prm.kind=discriminative: the PRM (eval mode), its spec (the head) and its input format.
    One of the trainer's PRM slot kinds (the other: implicit_prm.ImplicitPRM)."""

    kind: ClassVar[str] = "discriminative"
    model: torch.nn.Module
    spec: Any
    fmt: Any


@dataclass(frozen=True)
class Grader:
    """prm.kind=judge (and reward.llm_fallback): the grader LLM's engine and tokenizer."""

    engine: Any
    tok: Any


@dataclass(frozen=True)
class RewardContext:
    """What the reward phases read besides the batch. `step`: the RL step (seeds the judge,
    places the test-only NaN hook); `sep_ids`: the step separator's token ids."""

    cfg: Config
    groups: Groups
    tok: Any
    sep_ids: List[int]
    pad: int
    step: int
    prm: Optional[DiscriminativePRM] = None
    grader: Optional[Grader] = None


def outcome_reward(ctx: RewardContext, batch: RolloutBatch, prompts: Prompts,
                   group_ids: torch.Tensor) -> ScoredBatch:
    """Phase: verifier. Arithmetic: exact per-step check; math: math-verify."""
    cfg = ctx.cfg
    texts = batch.decode_responses(ctx.tok)
    seg = segment_steps(batch.response_ids, batch.response_mask, ctx.sep_ids)
    rows = [int(i) for i in batch.group_index]
    truths_b = [prompts.truths[i] for i in rows]
    wrong_step = checks = None
    metrics: dict = {}
    if cfg.data.task == "arithmetic":
        checks = [check_steps(p, t, ends_with_eos=r == "stop")
                  for p, t, r in zip(truths_b, texts, batch.finish_reason)]
        outcome = torch.tensor([float(c.final_correct) for c in checks])
        wrong_step = torch.tensor([c.correct_with_wrong_step for c in checks])
    else:
        outcome = score_outcomes(texts, truths_b, kind="math", verifier=cfg.reward.verifier)
        if cfg.reward.llm_fallback:
            outcome, metrics = _llm_fallback(ctx, texts, truths_b,
                                             [prompts.problems[i] for i in rows], outcome)
    outcome = faults.nan_at("outcome", ctx.groups.rank, ctx.step, outcome)
    if not torch.isfinite(outcome).all():
        raise FloatingPointError("verifier returned non-finite rewards")
    return ScoredBatch(batch, outcome, group_ids, seg, correct_with_wrong_step=wrong_step,
                       problems=[prompts.problems[i] for i in rows],
                       references=[prompts.references[i] for i in rows], checks=checks,
                       metrics=metrics)


def _judge_config(ctx: RewardContext, offset: int):
    """prm.judge with its seed moved by step and dp rank (`offset` tells the fallback's draws
    from the process judge's)."""
    jc = ctx.cfg.prm.judge
    return dataclasses.replace(jc, seed=(jc.seed + 7919 * ctx.step + 104_729
                                         * ctx.groups.dp_rank + offset) % (2**31))


def _llm_fallback(ctx: RewardContext, texts, truths, problems, outcome) -> tuple:
    """reward.llm_fallback (PAPO): the prm.kind=judge grader re-grades the answers the
    verifier called wrong (rewards.judge.llm_answer_fallback). Returns (outcome, its shares)."""
    grader = ctx.grader
    if grader.engine.asleep:
        grader.engine.wake()
    outcome, m = judge.llm_answer_fallback(grader.engine, grader.tok, problems, truths, texts,
                                           outcome, _judge_config(ctx, 1))
    grader.engine.sleep()
    return outcome, m


def process_reward(ctx: RewardContext, sb: ScoredBatch) -> ScoredBatch:
    """Phase: P(step correct) per step (PRIME's implicit PRM scores inside its update,
    `implicit_prm.prime_prm`): the discriminative PRM, the oracle's exact labels, or the
    judge. Returns `sb` with step_scores, step_mask and prof_steps (unchanged without one)."""
    b, kind = sb.rollout, ctx.cfg.prm.kind
    if kind == "judge":
        return _judge_scores(ctx, sb)
    if kind == "oracle":
        scores, mask = oracle_step_scores(sb.checks, sb.seg.step_mask)
        return dataclasses.replace(sb, step_scores=scores, step_mask=mask,
                                   prof_steps=prof_num_steps(b.decode_responses(ctx.tok)))
    if ctx.prm is None:
        return sb
    prm = ctx.prm
    scores, _ = score_rollouts(prm.model, ctx.groups, b.prompt_ids, b.prompt_mask,
                               b.response_ids, b.response_mask, sep_ids=ctx.sep_ids,
                               fmt=prm.fmt, head=prm.spec.head,
                               micro_batch_size=ctx.cfg.actor.micro_batch_size, pad_id=ctx.pad,
                               forward=ctx.cfg.prm.forward)
    s = to_host(scores.scores)
    if prm.spec.head == "token_cls":  # PURE's PR = 2p - 1 -> p
        s = torch.where(to_host(scores.step_mask), (s + 1) / 2, torch.zeros_like(s))
    mask = to_host(scores.step_mask).bool()
    # PROF's H_i: the released text split (prof_dp_rm.py), or the chat format's own step
    # count, which is the same split after the PRM's truncation
    prof = (mask.sum(1) if isinstance(prm.fmt, ChatStepFormat)
            else prof_num_steps(b.decode_responses(ctx.tok)))
    return dataclasses.replace(sb, step_scores=s, step_mask=mask, prof_steps=prof)


def _judge_scores(ctx: RewardContext, sb: ScoredBatch) -> ScoredBatch:
    """prm.kind=judge (PAPO's released process score, reward_score/__init__.py:150-163):
    the grader grades the correct responses against their reference solutions; the grade
    is one [B, 1] "step" score, so PAPO's (and Blend's, PROF's) sequence process score is
    it. Incorrect responses, missing references and unparseable grades score 0 (counted;
    the counts are summed over dp ranks)."""
    b, g, grader = sb.rollout, ctx.groups, ctx.grader
    texts = b.decode_responses(ctx.tok)
    if grader.engine.asleep:  # the grader sleeps (level 1, weights kept) between steps
        grader.engine.wake()
    res = judge.judge_process_scores(grader.engine, grader.tok, sb.problems, sb.references,
                                     texts, sb.outcome, _judge_config(ctx, 0))
    grader.engine.sleep()
    scores, mask = res.as_step_scores()
    # global counts (the same on every rank, so step_or_skip's dp mean keeps them)
    m = res.metrics
    counts = dp_reduce({**{k: v for k, v in m.items() if k != "judge/grade_mean"},
                        "graded": m["judge/grade_mean"] * m["judge/judged"]}, g)
    graded = counts.pop("graded")
    counts["judge/grade_mean"] = graded / counts["judge/judged"] if counts["judge/judged"] \
        else 0.0
    return dataclasses.replace(sb, step_scores=scores, step_mask=mask,
                               prof_steps=prof_num_steps(texts),
                               metrics={**sb.metrics, **counts})


def oracle_step_scores(checks: list, step_mask: torch.Tensor) -> tuple:
    """The oracle process reward: step k of response i scores 1.0 if the exact checker marks it
    correct, else 0.0 ([B, S], on the token segmentation's steps, which `split_steps` matches;
    a step the checker did not see scores 0)."""
    scores = torch.zeros(step_mask.shape, dtype=torch.float32)
    for i, c in enumerate(checks):
        n = min(len(c.step_correct), step_mask.shape[1])
        scores[i, :n] = torch.tensor(c.step_correct[:n], dtype=torch.float32)
    return scores * step_mask, step_mask.bool()


def build_discriminative_prm(cfg: Config, groups: Groups) -> DiscriminativePRM:
    """prm.kind=discriminative: the PRM at prm.path, loaded on this rank's stage."""
    from megaprm.models.prm import build_prm  # deferred: megatron is optional

    src = model_source.resolve(cfg.prm.path, "prm.path")
    spec = spec_from_hf(src.hf_dir)
    # prm.forward=released also runs it in bf16 (prof_dp_rm.py:255 autocast); else the
    # run's dtype (model.dtype, resolved: bf16 on CUDA, fp32 on the CPU by default)
    dtype = (torch.bfloat16 if cfg.prm.forward == "released"
             else resolve_dtype(cfg.model.dtype))
    model = build_prm(spec, tp=groups.tp_size, pp=groups.pp_size, pp_rank=groups.pp_rank,
                      dtype=dtype)
    model_source.load_weights(model, src, spec, groups)
    fmt = resolve_prm_input_format(cfg.prm.input_format, src.hf_dir, hf_config=spec.hf_config)
    if isinstance(fmt, ChatStepFormat) and cfg.advantage.method == "pure":
        raise ConfigError("advantage.method=pure needs token positions of the steps; "
                          f"prm.input_format={fmt.name} scores text steps. Use a "
                          "token-classification PRM (prm.input_format=pure)")
    return DiscriminativePRM(model.eval(), spec, fmt)


def build_grader(cfg: Config, groups: Groups) -> Grader:
    """prm.kind=judge: the grader LLM at prm.path on its own engine (the rollout factory;
    transformers on CPU, vLLM on GPU), with its own tokenizer and chat template."""
    from transformers import AutoTokenizer

    src = model_source.resolve(cfg.prm.path, "prm.path")
    if not has_weights(src.hf_dir):
        raise ConfigError(f"prm.path={cfg.prm.path!r}: prm.kind=judge needs the grader's "
                          "HF weights (config.json + safetensors); export a checkpoint with "
                          "checkpoint_tools export-hf first")
    jc = cfg.prm.judge
    tok = AutoTokenizer.from_pretrained(src.hf_dir)
    rc = RolloutConfig(engine=jc.engine, temperature=max(jc.temperature, 1e-6),
                       top_p=jc.top_p, max_tokens=jc.max_tokens,
                       gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                       sleep_level=1)  # woken (not reloaded) before each grading
    engine = build_engine(rc, src.hf_dir, tok, world_size=groups.world_size,
                          tp_size=groups.tp_size, seed=cfg.trainer.seed, device=rank_device())
    return Grader(engine, tok)
