"""A generative judge as a process-score source (PAPO, arXiv 2603.26535; research notes §4.1).

PAPO's "PRM" is not a step classifier: an LLM grader (GPT-OSS-20B in the released scripts,
temperature 0.1) reads the problem, a reference solution and the student's solution and gives
the whole solution a rubric grade in {0, 0.5, 1}. The released routing
(ScopeHLS/Process-Aware-Policy-Optimization verl/utils/reward_score/__init__.py:130-175 and
llm_proof_grading.py) is reproduced here:

* only responses whose outcome is correct are judged; every other response gets 0;
* `<think>...</think>` spans are removed from the student's solution and from the grade;
* no reference solution, or an empty solution after that: 0, without a grader call;
* the grade is the last `\\boxed{...}` of the grader's answer when it holds 0, 0.5 or 1, else
  the first "Score: N" / "score is N" with N in that set; anything else is unparseable: 0.
  (The released grading function catches grader errors itself and returns 0 too; its caller's
  "grader failed on a correct answer -> 1" branch is therefore only reached on import errors.)

The grader is any megaprm `RolloutEngine` (`generate(prompt_ids, SamplingParams)`): vLLM on
GPU, the transformers engine on CPU. The prompt is one user message through the grader's chat
template (the released code calls an OpenAI-compatible chat endpoint); of a gpt-oss completion
only the "final" channel is parsed (the endpoint returns only it), and one cut off before its
final channel grades 0 (the endpoint's content is empty then).

`llm_answer_fallback` is PAPO's other grader call (its outcome checker's LLM fallback, below).

The rubric is written here in our own words; it keeps the released template's structure
(task, three-level scale, the rule on cited results, problem / reference / student sections,
analysis then `Score: \\boxed{}`) and its grade scale.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megaprm.rollout.engine import SamplingParams

JUDGE_GRADES = (0.0, 0.5, 1.0)

JUDGE_TEMPLATE = r"""## Task
Grade the quality of a student's solution to a math problem.

## Grading scale
* 1: the solution is fully correct, with every step carried out properly and shown clearly.
* 0.5: the solution is correct overall, but leaves out some details or makes small mistakes.
* 0: the solution does not solve the problem that was asked, makes a fatal error, or leaves out essential parts.

Cited results: citing a result from the literature does not replace proving it. A cited result counts only if the solution also proves it correctly; otherwise grade with the scale above, and never give 1.

## Problem
{problem}

## Reference Solution
{reference}

## Student Solution
{student}

## Assessment
Go through the student's solution step by step, then state the grade.

Analysis:
...

Score: \boxed{{...}}"""

_THINK = re.compile(r"<think>.*?</think>", flags=re.DOTALL)
_SCORE_LINE = re.compile(r"(?:score|Score)\s*(?:is\s*:?|:)\s*([\d.]+)")
_HARMONY_CHANNEL = "<|channel|>"
_HARMONY_FINAL = "<|channel|>final<|message|>"
_HARMONY_ENDS = ("<|return|>", "<|end|>")


@dataclass
class JudgeConfig:
    """The grader's engine and sampling (`prm.judge`; the grader model is `prm.path`, PAPO:
    GPT-OSS-20B). `engine`: hf | vllm; sampling as released (temperature 0.1, up to 16384 new
    tokens); the trainer varies `seed` per step and dp rank."""

    engine: str = "hf"
    temperature: float = 0.1
    top_p: float = 1.0
    max_tokens: int = 16384
    seed: int = 0

    def __post_init__(self):
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"prm.judge.engine={self.engine!r} is not valid: hf or vllm")
        if not self.temperature >= 0:
            raise ValueError(f"prm.judge.temperature={self.temperature!r} must be >= 0")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"prm.judge.max_tokens={self.max_tokens!r} must be an int >= 1")


def strip_think(text: str) -> str:
    """Remove `<think>...</think>` spans and surrounding whitespace."""
    return _THINK.sub("", text or "").strip()


def final_channel(text: str) -> str:
    """The gpt-oss final answer of a decoded completion (what a chat endpoint returns as
    content); "" for a harmony completion cut off before its final channel (max_tokens reached
    in the analysis: the endpoint returns empty content, which the release scores 0); the text
    itself when it is no harmony completion (a grader without channels)."""
    i = text.rfind(_HARMONY_FINAL)
    if i < 0:
        return "" if _HARMONY_CHANNEL in text else text
    out = text[i + len(_HARMONY_FINAL):]
    for end in _HARMONY_ENDS:
        out = out.split(end, 1)[0]
    return out


def build_judge_prompt(problem: str, reference: str, student: str) -> str:
    """The grading prompt of one solution (think spans already removed from `student`)."""
    return JUDGE_TEMPLATE.format(problem=problem, reference=reference, student=student)


def last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    i = text.rfind("\\boxed")
    if i < 0:
        i = text.rfind("\\fbox")
        if i < 0:
            return None
    depth, start = 0, None
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
            start = j if start is None else start
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:j].strip()
    return None


def _grade(token: Optional[str]) -> Optional[float]:
    try:
        value = float(token)
    except (TypeError, ValueError):
        return None
    return value if value in JUDGE_GRADES else None


def parse_grade(text: str) -> Optional[float]:
    """The grade in a grader's answer (module docstring), None when unparseable."""
    if not text:
        return None
    grade = _grade(last_boxed(text))
    if grade is None:
        m = _SCORE_LINE.search(text)
        grade = _grade(m.group(1)) if m else None
    return grade


@dataclass
class JudgeResult:
    """scores [B] float32: the process score (0 for responses not judged or unparseable);
    judged [B] bool: sent to the grader; parsed [B] bool: a grade was read;
    texts: the grader's answers (None where not judged); metrics: counts for logging."""

    scores: torch.Tensor
    judged: torch.Tensor
    parsed: torch.Tensor
    texts: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

    def as_step_scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(process_step_scores [B, 1], step_mask [B, 1])`: one "step" per response, so an
        estimator's mean step score (PAPO's p_i, Blend's, PROF's) is the grade."""
        return self.scores[:, None], torch.ones(self.scores.shape[0], 1, dtype=torch.bool)


def judge_process_scores(engine, tokenizer, problems: Sequence[str],
                         references: Sequence[Optional[str]], responses: Sequence[str],
                         outcome: torch.Tensor, cfg: JudgeConfig = JudgeConfig()) -> JudgeResult:
    """Grade the correct responses (outcome == 1) of B samples with a generative judge.

    problems / references / responses: B strings (the problem statement, its reference solution
    or None, the decoded response); `tokenizer` is the grader's; `engine` serves the grader."""
    B = len(responses)
    assert len(problems) == len(references) == B and outcome.shape == (B,)
    scores = torch.zeros(B, dtype=torch.float32)
    judged = torch.zeros(B, dtype=torch.bool)
    parsed = torch.zeros(B, dtype=torch.bool)
    texts: list = [None] * B
    correct = (outcome == 1).tolist()
    no_ref = empty = 0
    rows, prompts = [], []
    for i in range(B):
        if not correct[i]:
            continue
        student = strip_think(responses[i])
        if not references[i]:
            no_ref += 1
            continue
        if not student:
            empty += 1
            continue
        rows.append(i)
        prompts.append(_encode(tokenizer, build_judge_prompt(problems[i], references[i], student)))
    if prompts:
        eos = tokenizer.eos_token_id
        params = SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p,
                                max_tokens=cfg.max_tokens, seed=cfg.seed,
                                stop_token_ids=() if eos is None else (int(eos),))
        out = engine.generate(prompts, params)
        answers = out.decode_responses(tokenizer, skip_special_tokens=False)
        for i, raw in zip(rows, answers):
            # think spans go before special tokens are dropped: "<think>" may be one of them
            text = _drop_special(tokenizer, strip_think(final_channel(raw))).strip()
            grade = parse_grade(text)
            judged[i], texts[i] = True, text
            if grade is not None:
                scores[i], parsed[i] = grade, True
    n_judged = int(judged.sum())
    metrics = {"judge/judged": float(n_judged),
               "judge/unparseable": float(n_judged - int(parsed.sum())),
               "judge/no_reference": float(no_ref), "judge/empty_solution": float(empty),
               "judge/grade_mean": float(scores[judged].mean()) if n_judged else 0.0}
    return JudgeResult(scores, judged, parsed, texts, metrics)


def _encode(tokenizer, prompt: str) -> list[int]:
    """One user message through the grader's chat template (raw text when it has none)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                            add_generation_prompt=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return tokenizer(prompt, add_special_tokens=False).input_ids


def _drop_special(tokenizer, text: str) -> str:
    for tok in getattr(tokenizer, "all_special_tokens", []):
        text = text.replace(tok, "")
    return text


# ----------------------------------------------------------------------------- answer fallback
# PAPO's LLM answer fallback (reward_score/__init__.py:84-110 and 136-148, llm_answer_grading.py;
# `reward.llm_fallback`): a response the rule-based checker calls wrong is shown, as its
# extracted answer, to the same grader next to the reference answer; "Final Grade: CORRECT"
# flips its outcome to 1. The prompt is in our own words with the released structure (question,
# student answer, reference answer, four notes, the verdict line).

ANSWER_TEMPLATE = """Question: {question}

Student's Answer: {student}

Reference Answer: {reference}

Decide whether the student's answer means the same as the reference answer; it may be written differently and still be right.

Note 1: Do not solve the problem. Compare the student's answer with the reference answer only.

Note 2: When the reference answer is an interval or range, the student's answer must be exactly the same, open and closed ends included.

Note 3: When the reference answer is an expression that seems equivalent to the student's, show the derivation that checks it.

Note 4: When the reference answer lists several solutions, the student's answer must give all of them.

Explain your grading briefly (a few sentences), then give the grade in this form:

Final Grade: CORRECT or INCORRECT
"""
_VERDICT = re.compile(r"Final\s+Grade:\s*(CORRECT|INCORRECT)", re.IGNORECASE)


def student_answer(response: str) -> str:
    """The answer the released fallback grades: think spans removed, the text after a stray
    `</think>`, then the last boxed content, else the whole remaining response."""
    text = strip_think(response)
    if "</think>" in text:
        text = text.split("</think>")[-1].strip()
    return last_boxed(text) or text


def parse_verdict(text: str) -> bool:
    """CORRECT per the verdict line; without one, a bare CORRECT with no INCORRECT anywhere."""
    if not text:
        return False
    m = _VERDICT.search(text)
    if m:
        return m.group(1).upper() == "CORRECT"
    return (re.search(r"\bCORRECT\b", text, re.IGNORECASE) is not None
            and re.search(r"\bINCORRECT\b", text, re.IGNORECASE) is None)


def llm_answer_fallback(engine, tokenizer, problems: Sequence[str], truths: Sequence[str],
                        responses: Sequence[str], outcome: torch.Tensor,
                        cfg: JudgeConfig = JudgeConfig()) -> tuple[torch.Tensor, dict]:
    """(outcome [B] with the grader's flips, metrics): every response with outcome 0 and a
    non-empty answer is graded once; a CORRECT verdict sets its outcome to 1."""
    B = len(responses)
    assert len(problems) == len(truths) == B and outcome.shape == (B,)
    rows = [i for i in range(B) if outcome[i] == 0 and student_answer(responses[i])]
    out = outcome.clone()
    if rows:
        prompts = [_encode(tokenizer, ANSWER_TEMPLATE.format(
            question=problems[i], student=student_answer(responses[i]), reference=truths[i]))
            for i in rows]
        eos = tokenizer.eos_token_id
        params = SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p,
                                max_tokens=cfg.max_tokens, seed=cfg.seed,
                                stop_token_ids=() if eos is None else (int(eos),))
        answers = engine.generate(prompts, params).decode_responses(tokenizer,
                                                                    skip_special_tokens=False)
        for i, raw in zip(rows, answers):
            text = _drop_special(tokenizer, strip_think(final_channel(raw))).strip()
            if parse_verdict(text):
                out[i] = 1.0
    flipped = float((out != outcome).sum())
    return out, {"reward/llm_fallback_asked_frac": len(rows) / max(B, 1),
                 "reward/llm_fallback_flipped_frac": flipped / max(B, 1)}
