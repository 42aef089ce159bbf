"""Run a PRM over labelled solutions and judge it (`megaprm eval-prm`; the metrics are
`rewards.prm_eval`'s).

Two kinds of PRM, each scored exactly as the trainer scores rollouts:

* discriminative (`--prm DIR`): a megaprm-trained PRM (the layout it recorded) or an HF
  Qwen2.5-Math-PRM-shaped checkpoint (`qwen25_math_prm`, through `rewards.scoring`); a step's
  score is P(good) of the head, called bad below 0.5 (ProcessBench's rule);
* implicit (PRIME, `--implicit DIR --ref DIR`): a step's score is beta * sum over the step's
  tokens of (log pi_phi - log pi_ref), PRIME's token-level process reward summed per step
  (`scoring.implicit_prm_rewards`); called bad below 0 (a negative process reward) unless a
  threshold is given.

Solutions come as `prm_training.StepExample`s: the arithmetic task's held-out solutions (exact
step labels, every corruption kind) or ProcessBench rows (the steps joined by "\\n\\n"; only the
first error is known). A solution whose tokenised response has another number of steps than it
has (a step the tokenizer merges or splits, a chat input cut at max_length) is not scored; the
report counts and names them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from checkpoint_tools import model_source
from megaprm.models.hf_spec import spec_from_hf
from megaprm.parallel.groups import Groups
from megaprm.parallel.init import destroy, init_distributed
from megaprm.rewards import prm_eval, scoring
from megaprm.rewards.prm_eval import ProcessBenchRow, ScoredSolution, first_error_label
from megaprm.rewards.steps import STEP_SEP, separator_token_ids
from megaprm.tasks import arithmetic
from megaprm.trainer.prm_training import StepExample, arithmetic_examples, load_tokenizer


@dataclass(frozen=True)
class Judged:
    """What `judge_solutions` hands the metrics: the scored solutions, the rows not scored
    ("source: why") and how a step was called bad."""

    solutions: List[ScoredSolution]
    skipped: List[str]
    threshold: float
    score: str  # what a step's score is, in words


def arithmetic_set(cfg: arithmetic.ArithmeticConfig, n: int, seed: int
                   ) -> Tuple[List[StepExample], List[int], List[Optional[tuple]]]:
    """(examples, first-error labels, exact step labels) of n held-out solutions: half
    reference, half corrupted, every corruption kind in turn (`arithmetic_examples`)."""
    ex = arithmetic_examples(cfg, n, seed)
    return ex, [first_error_label(e.labels) for e in ex], [tuple(e.labels) for e in ex]


def processbench_set(rows: Sequence[ProcessBenchRow], kind: str
                     ) -> Tuple[List[StepExample], List[int], List[Optional[tuple]]]:
    """ProcessBench rows as examples of kind `kind` (the subset's name): the steps joined by the
    step separator, a step's own blank lines collapsed to one newline so that it stays one
    step. Labels beyond the first error are unknown: no exact step labels."""
    ex = []
    for r in rows:
        steps = [re.sub(r"\n\s*\n", "\n", s.strip()) for s in r.steps]
        ex.append(StepExample(r.problem, STEP_SEP.join(steps), tuple([1] * len(steps)), True,
                              kind, r.source))
    return ex, [r.label for r in rows], [None] * len(rows)


def _rollout_tensors(examples: Sequence[StepExample], tok):
    """Examples as rollout tensors: prompts [B, P] left-padded, responses [B, T] right-padded
    (+ EOS where the solution is complete), with their masks."""
    eos, pad = tok.eos_token_id, (tok.pad_token_id if tok.pad_token_id is not None else 0)
    prompts = tok([e.prompt for e in examples], add_special_tokens=False).input_ids
    responses = tok([e.response for e in examples], add_special_tokens=False).input_ids
    responses = [r + [eos] if e.ends_with_eos and eos is not None else r
                 for e, r in zip(examples, responses)]
    B = len(examples)
    P, T = max(map(len, prompts), default=1), max(map(len, responses), default=1)
    p_ids, p_mask = torch.full((B, P), pad, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    r_ids, r_mask = torch.full((B, T), pad, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if p:
            p_ids[i, P - len(p):] = torch.tensor(p)
            p_mask[i, P - len(p):] = 1
        r_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        r_mask[i, : len(r)] = 1
    return p_ids, p_mask, r_ids, r_mask, pad


def _source(path: str, what: str):
    """(model source, spec) of `path`, before any weight is read."""
    src = model_source.resolve(path, what)
    return src, spec_from_hf(src.hf_dir)


def _load(src, spec, build, groups: Groups):
    model = build(spec)
    model_source.load_weights(model, src, spec, groups)
    return model.eval()


def score_discriminative(prm_dir: str, examples: Sequence[StepExample], groups: Groups, *,
                         input_format: str = "auto", micro_batch_size: int = 16
                         ) -> List[Optional[List[float]]]:
    """P(good) of every step of every example under the PRM at `prm_dir` (None for an example
    whose scored step count differs from its own)."""
    from megaprm.models.prm import PRM_HEADS, build_prm  # deferred: megatron

    src, spec = _source(prm_dir, "--prm")
    if spec.head not in PRM_HEADS:
        raise ValueError(f"--prm {prm_dir}: a {spec.architecture} is no discriminative PRM "
                         f"(its head is {spec.head!r}); give a PRM (megaprm train-prm output or "
                         "Qwen2.5-Math-PRM), or an implicit PRM with --implicit and --ref")
    model = _load(src, spec, lambda s: build_prm(s, tp=1, pp=1, pp_rank=0, dtype=torch.float32),
                  groups)
    fmt = scoring.resolve_prm_input_format(input_format, src.hf_dir, hf_config=spec.hf_config)
    chat = isinstance(fmt, scoring.ChatStepFormat)
    tok = fmt.tokenizer if chat else load_tokenizer(src.hf_dir)
    p_ids, p_mask, r_ids, r_mask, pad = _rollout_tensors(examples, tok)
    if chat:
        batch = scoring.chat_batch_from_rollouts(p_ids, p_mask, r_ids, r_mask, fmt)
    else:
        batch, _ = scoring.batch_from_rollouts(p_ids, p_mask, r_ids, r_mask,
                                               separator_token_ids(tok), fmt, pad)
    out = scoring.run_prm(model, groups, batch, head=spec.head,
                          micro_batch_size=micro_batch_size, keep_logits=True)
    p_good = torch.softmax(out.logits.float(), -1)[..., 1]  # [B, S]
    return [_row(p_good[i], out.step_mask[i], len(e.labels)) for i, e in enumerate(examples)]


def score_implicit(implicit_dir: str, ref_dir: str, examples: Sequence[StepExample],
                   groups: Groups, *, beta: float, micro_batch_size: int = 16
                   ) -> List[Optional[List[float]]]:
    """PRIME's implicit step scores beta * sum_t (log pi_phi - log pi_ref) of every step."""
    from megaprm.models.actor import build_stage  # deferred: megatron

    def build(spec):
        return build_stage(spec, groups, dtype=torch.float32)

    (src, spec), (ref_src, ref_spec) = _source(implicit_dir, "--implicit"), _source(ref_dir,
                                                                                   "--ref")
    if spec.head != "lm" or ref_spec.head != "lm" or spec.vocab_size != ref_spec.vocab_size:
        raise ValueError(f"--implicit {implicit_dir} and --ref {ref_dir} must be causal LMs of "
                         f"one vocabulary (heads {spec.head!r}/{ref_spec.head!r}, vocab sizes "
                         f"{spec.vocab_size}/{ref_spec.vocab_size}); PRIME's implicit PRM and "
                         "its reference start from the same policy")
    prm, ref = _load(src, spec, build, groups), _load(ref_src, ref_spec, build, groups)
    tok = load_tokenizer(src.hf_dir)
    p_ids, p_mask, r_ids, r_mask, pad = _rollout_tensors(examples, tok)
    q = scoring.implicit_prm_rewards(prm, ref, groups, p_ids, p_mask, r_ids, r_mask,
                                     sep_ids=separator_token_ids(tok), vocab_size=spec.vocab_size,
                                     micro_batch_size=micro_batch_size, pad_id=pad)
    steps = q.steps
    return [_row(beta * steps.scores[i], steps.step_mask[i], len(e.labels))
            for i, e in enumerate(examples)]


def _row(scores: torch.Tensor, mask: torch.Tensor, n_steps: int) -> Optional[List[float]]:
    got = scores[mask.bool()].double().tolist()
    return got if len(got) == n_steps else None


def judged(examples: Sequence[StepExample], labels: Sequence[int],
           step_labels: Sequence[Optional[tuple]], scores: Sequence[Optional[List[float]]],
           threshold: float, score: str) -> Judged:
    """Pair the scores with the labels; examples without scores are listed as skipped."""
    solutions, skipped = [], []
    for i, (e, y, sl, s) in enumerate(zip(examples, labels, step_labels, scores)):
        source = e.source or f"{e.kind}:{i}"
        if s is None:
            skipped.append(f"{source}: the PRM's input has another number of steps than the "
                           f"solution's {len(e.labels)}")
            continue
        solutions.append(ScoredSolution(tuple(s), y, e.kind, sl, source))
    return Judged(solutions, skipped, threshold, score)


def labelled_set(task: Optional[arithmetic.ArithmeticConfig], num: int, seed: int,
                 subsets: Sequence[Tuple[str, Sequence[ProcessBenchRow]]]
                 ) -> Tuple[List[StepExample], List[int], List[Optional[tuple]]]:
    """The solutions `megaprm eval-prm` judges: `num` of the arithmetic `task` (seed `seed`),
    or, without a task, the ProcessBench rows of every (kind, rows) subset in turn."""
    if task is not None:
        return arithmetic_set(task, num, seed)
    examples, labels, step_labels = [], [], []
    for kind, rows in subsets:
        ex, y, sl = processbench_set(rows, kind)
        examples += ex
        labels += y
        step_labels += sl
    return examples, labels, step_labels


def judge_prm(examples: Sequence[StepExample], labels: Sequence[int],
              step_labels: Sequence[Optional[tuple]], threshold: float, *,
              prm: Optional[str] = None, implicit: Optional[str] = None,
              ref: Optional[str] = None, beta: float = 0.05, input_format: str = "auto",
              micro_batch_size: int = 16, pooled_kinds: bool = False
              ) -> Tuple[dict, Judged]:
    """Score the solutions by one PRM in this one process (a discriminative `prm`, else the
    implicit PRM `implicit` over `ref` at `beta`) and judge the scores at `threshold`:
    (`prm_eval.judge`'s report, the Judged solutions with what a score is in words). Raises
    ValueError when no solution could be scored."""
    groups = init_distributed(tp=1, pp=1, seed=0)
    try:
        if prm:
            scores = score_discriminative(prm, examples, groups, input_format=input_format,
                                          micro_batch_size=micro_batch_size)
            what = "P(good) of the PRM's head"
        else:
            scores = score_implicit(implicit, ref, examples, groups, beta=beta,
                                    micro_batch_size=micro_batch_size)
            what = f"PRIME's implicit reward: {beta:g} * sum(log pi_phi - log pi_ref)"
    finally:
        destroy()
    j = judged(examples, labels, step_labels, scores, threshold, what)
    if not j.solutions:
        raise ValueError(f"no solution could be scored ({len(j.skipped)} skipped, e.g. "
                         f"{j.skipped[0]}); the PRM's tokenizer must keep each step apart")
    return prm_eval.judge(j.solutions, threshold, pooled_kinds=pooled_kinds), j
