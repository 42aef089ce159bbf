"""Phases outcome reward (the verifier, with PAPO's LLM fallback) and process reward (a
discriminative PRM, the oracle's exact step labels, or a generative judge), and the reward
models' construction. PRIME's implicit PRM scores inside its own phase (implicit_prm.py)."""
from __future__ import annotations

import torch

from checkpoint_tools import model_source
from megaprm import faults
from megaprm.config import ConfigError
from megaprm.models.hf_spec import spec_from_hf
from megaprm.parallel.device import resolve_dtype, to_host
from megaprm.parallel.host import dp_reduce
from megaprm.rollout.engine import RolloutBatch
from megaprm.trainer.batch import ScoredBatch
from megaprm.trainer.data import Prompts


def outcome_reward(tr, batch: RolloutBatch, prompts: Prompts, group_ids):
    """Phase: verifier. Arithmetic: exact per-step check; math: math-verify."""
    from megaprm.rewards.steps import segment_steps

    texts = batch.decode_responses(tr.tok)
    seg = segment_steps(batch.response_ids, batch.response_mask, tr.sep_ids)
    rows = [int(i) for i in batch.group_index]
    truths_b = [prompts.truths[i] for i in rows]
    wrong_step = None
    if tr.cfg.data.task == "arithmetic":
        from megaprm.tasks.arithmetic import check_steps

        checks = [check_steps(p, t, ends_with_eos=r == "stop")
                  for p, t, r in zip(truths_b, texts, batch.finish_reason)]
        outcome = torch.tensor([float(c.final_correct) for c in checks])
        wrong_step = torch.tensor([c.correct_with_wrong_step for c in checks])
        tr._checks = checks  # the oracle PRM's labels
    else:
        from megaprm.rewards.verifiers import score_outcomes

        outcome = score_outcomes(texts, truths_b, kind="math",
                                 verifier=tr.cfg.reward.verifier)
        if tr.cfg.reward.llm_fallback:
            outcome = _llm_fallback(tr, texts, truths_b,
                                    [prompts.problems[i] for i in rows], outcome)
    outcome = faults.nan_at("outcome", tr.groups.rank, tr._step, outcome)
    if not torch.isfinite(outcome).all():
        raise FloatingPointError("verifier returned non-finite rewards")
    return ScoredBatch(batch, outcome, group_ids, seg, correct_with_wrong_step=wrong_step,
                       problems=[prompts.problems[i] for i in rows],
                       references=[prompts.references[i] for i in rows])

def _llm_fallback(tr, texts, truths, problems, outcome):
    """reward.llm_fallback (PAPO): the prm.kind=judge grader re-grades the answers the
    verifier called wrong (rewards.judge.llm_answer_fallback); its shares are logged."""
    import dataclasses

    from megaprm.rewards.judge import llm_answer_fallback

    jc = tr.cfg.prm.judge
    jc = dataclasses.replace(jc, seed=(jc.seed + 7919 * tr._step + 104_729
                                       * tr.groups.dp_rank + 1) % (2**31))
    if tr.grader.asleep:
        tr.grader.wake()
    outcome, m = llm_answer_fallback(tr.grader, tr.grader_tok, problems, truths, texts,
                                     outcome, jc)
    tr.grader.sleep()
    tr._fallback_metrics = m
    return outcome


def process_reward(tr, sb: ScoredBatch) -> None:
    """Phase: discriminative PRM, P(step correct) per step (PRIME's implicit PRM scores
    inside its update, `prime_prm`)."""
    from megaprm.rewards.scoring import ChatStepFormat, score_rollouts
    from megaprm.rewards.steps import prof_num_steps

    b, mbs = sb.rollout, tr.cfg.actor.micro_batch_size
    if tr.cfg.prm.kind == "judge":
        _judge_scores(tr, sb)
        return
    if tr.cfg.prm.kind == "oracle":
        sb.step_scores, sb.step_mask = oracle_step_scores(tr._checks, sb.seg.step_mask)
        sb.prof_steps = prof_num_steps(b.decode_responses(tr.tok))
        return
    if tr.prm is not None:
        scores, _ = score_rollouts(tr.prm, tr.groups, b.prompt_ids, b.prompt_mask,
                                   b.response_ids, b.response_mask, sep_ids=tr.sep_ids,
                                   fmt=tr.prm_fmt, head=tr.prm_spec.head,
                                   micro_batch_size=mbs, pad_id=tr.pad,
                                   forward=tr.cfg.prm.forward)
        s = to_host(scores.scores)
        if tr.prm_spec.head == "token_cls":  # PURE's PR = 2p - 1 -> p
            s = torch.where(to_host(scores.step_mask), (s + 1) / 2, torch.zeros_like(s))
        sb.step_scores, sb.step_mask = s, to_host(scores.step_mask).bool()
        # PROF's H_i: the released text split (prof_dp_rm.py), or the chat format's own
        # step count, which is the same split after the PRM's truncation
        sb.prof_steps = (sb.step_mask.sum(1) if isinstance(tr.prm_fmt, ChatStepFormat)
                         else prof_num_steps(b.decode_responses(tr.tok)))

def _judge_scores(tr, sb: ScoredBatch) -> None:
    """prm.kind=judge (PAPO's released process score, reward_score/__init__.py:150-163):
    the grader grades the correct responses against their reference solutions; the grade
    is one [B, 1] "step" score, so PAPO's (and Blend's, PROF's) sequence process score is
    it. Incorrect responses, missing references and unparseable grades score 0 (counted;
    the counts are summed over dp ranks)."""
    import dataclasses

    from megaprm.rewards.judge import judge_process_scores
    from megaprm.rewards.steps import prof_num_steps

    b, g = sb.rollout, tr.groups
    texts = b.decode_responses(tr.tok)
    jc = tr.cfg.prm.judge
    jc = dataclasses.replace(jc, seed=(jc.seed + 7919 * tr._step + 104_729 * g.dp_rank)
                             % (2**31))
    if tr.grader.asleep:  # the grader sleeps (level 1, weights kept) between steps
        tr.grader.wake()
    res = judge_process_scores(tr.grader, tr.grader_tok, sb.problems, sb.references,
                               texts, sb.outcome, jc)
    tr.grader.sleep()
    sb.step_scores, sb.step_mask = res.as_step_scores()
    sb.prof_steps = prof_num_steps(texts)
    # global counts (the same on every rank, so step_or_skip's dp mean keeps them)
    m = res.metrics
    counts = dp_reduce({**{k: v for k, v in m.items() if k != "judge/grade_mean"},
                        "graded": m["judge/grade_mean"] * m["judge/judged"]}, g)
    graded = counts.pop("graded")
    counts["judge/grade_mean"] = graded / counts["judge/judged"] if counts["judge/judged"] \
        else 0.0
    tr._judge_metrics = counts

def oracle_step_scores(checks: list, step_mask: torch.Tensor) -> tuple:
    """The oracle process reward: step k of response i scores 1.0 if the exact checker marks it
    correct, else 0.0 ([B, S], on the token segmentation's steps, which `split_steps` matches;
    a step the checker did not see scores 0)."""
    scores = torch.zeros(step_mask.shape, dtype=torch.float32)
    for i, c in enumerate(checks):
        n = min(len(c.step_correct), step_mask.shape[1])
        scores[i, :n] = torch.tensor(c.step_correct[:n], dtype=torch.float32)
    return scores * step_mask, step_mask.bool()


def build_discriminative_prm(tr):
    from megaprm.models.prm import build_prm
    from megaprm.rewards.scoring import ChatStepFormat, resolve_prm_input_format

    src = model_source.resolve(tr.cfg.prm.path, "prm.path")
    g = tr.groups
    spec = spec_from_hf(src.hf_dir)
    # prm.forward=released also runs it in bf16 (prof_dp_rm.py:255 autocast); else the
    # run's dtype (model.dtype, resolved: bf16 on CUDA, fp32 on the CPU by default)
    dtype = (torch.bfloat16 if tr.cfg.prm.forward == "released"
             else resolve_dtype(tr.cfg.model.dtype))
    model = build_prm(spec, tp=g.tp_size, pp=g.pp_size, pp_rank=g.pp_rank, dtype=dtype)
    model_source.load_weights(model, src, spec, g)
    tr.prm, tr.prm_spec = model.eval(), spec
    tr.prm_fmt = resolve_prm_input_format(tr.cfg.prm.input_format, src.hf_dir,
                                          hf_config=spec.hf_config)
    if isinstance(tr.prm_fmt, ChatStepFormat) and tr.cfg.advantage.method == "pure":
        raise ConfigError("advantage.method=pure needs token positions of the steps; "
                          f"prm.input_format={tr.prm_fmt.name} scores text steps. Use a "
                          "token-classification PRM (prm.input_format=pure)")

def build_grader(tr):
    """prm.kind=judge: the grader LLM at prm.path on its own engine (the rollout factory;
    transformers on CPU, vLLM on GPU), with its own tokenizer and chat template."""
    from transformers import AutoTokenizer

    from megaprm.models.hf_files import has_weights
    from megaprm.config import RolloutConfig
    from megaprm.parallel.device import rank_device
    from megaprm.rollout.factory import build_engine

    src = model_source.resolve(tr.cfg.prm.path, "prm.path")
    if not has_weights(src.hf_dir):
        raise ConfigError(f"prm.path={tr.cfg.prm.path!r}: prm.kind=judge needs the grader's "
                          "HF weights (config.json + safetensors); export a checkpoint with "
                          "checkpoint_tools export-hf first")
    jc, g = tr.cfg.prm.judge, tr.groups
    tr.grader_tok = AutoTokenizer.from_pretrained(src.hf_dir)
    rc = RolloutConfig(engine=jc.engine, temperature=max(jc.temperature, 1e-6),
                       top_p=jc.top_p, max_tokens=jc.max_tokens,
                       gpu_memory_utilization=tr.cfg.rollout.gpu_memory_utilization,
                       sleep_level=1)  # woken (not reloaded) before each grading
    tr.grader = build_engine(rc, src.hf_dir, tr.grader_tok, world_size=g.world_size,
                             tp_size=g.tp_size, seed=tr.cfg.trainer.seed,
                             device=rank_device())
