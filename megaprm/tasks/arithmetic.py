"""Synthetic multi-step arithmetic: the embedded task of the CPU demo.

Every step of a solution can be checked exactly, so the demo can measure what papers can only
estimate: how often a correct final answer rests on a wrong step.

Text format (short on purpose: a ~1M-parameter model with a char tokenizer learns it in minutes)::

    prompt    "7+5-3+8="
    solution  "7+5=12\\n\\n12-3=9\\n\\n9+8=17\\n\\n\\boxed{17}"

One equation step per operation, evaluated left to right (no precedence, also for "*"), then a
final boxed step. Steps are separated by SEP = "\\n\\n" (one token in `tasks.tokenizer`).

Step correctness is *local* (what a careful grader checking one line at a time would say):

* equation step k (0-based) `a op b = c` is correct iff `c == a op b` (true equation), `a` is the
  result stated by step k-1 (or the first operand for k = 0), and `op b` is the problem's k-th
  operation with the (k+1)-th operand, i.e. it is *the right next step*, not just a true equation;
* the boxed step is correct iff it comes right after the last operation (no skipped or extra
  steps) and its value equals the result stated by the previous step;
* anything else (garbage, an extra step, a partial step) is incorrect.

So a step that correctly continues from a wrong earlier result is itself correct; the earlier
step carries the blame.

`ArithmeticConfig(restate=True)` (the comparison's long task): every equation step also restates
the operations still to apply, so each step reads its next operand from the step before it,
not from a position in the prompt a small model must count to::

    prompt    "7+5-3+8="
    solution  "7+5=12-3+8\n\n12-3=9+8\n\n9+8=17\n\n\boxed{17}"

and a step is correct iff it is correct as above and its restated tail is exactly the problem's
operations after it (a response of 10 steps runs to ~150 tokens with one-digit operands). `StepCheck.first_error_index` gives the "first error onward" view, and
`step_labelled_examples(label_mode="prefix")` emits those labels instead.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

SEP = "\n\n"
CORRUPTION_KINDS = ("wrong_result", "flawed_but_correct", "wrong_operand", "truncated")

_EQ_RE = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+)")
# an equation step that restates the operations still to apply (`restate`)
_EQ_TAIL_RE = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+)((?:[+\-*]\d+)*)")
_BOXED_RE = re.compile(r"\\boxed\{(-?\d+)\}")
_LAST_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs. `num_ops` is an inclusive (min, max) range of operations per problem;
    operands are drawn from 1..operand_max; with `allow_negative=False` no intermediate result
    is negative (a "-" whose operand would go below 0 is drawn smaller, or becomes "+")."""

    num_ops: tuple[int, int] = (2, 4)
    operand_max: int = 20
    ops: str = "+-"
    allow_negative: bool = False
    seed: int = 0
    restate: bool = False  # each step restates the operations still to apply (module docstring)

    def __repr__(self) -> str:
        # `restate` is named only when set: the repr keys cached starts (and the shipped demo's
        # recipe), which must not change for the tasks that existed before it
        base = (f"ArithmeticConfig(num_ops={self.num_ops!r}, operand_max={self.operand_max!r}, "
                f"ops={self.ops!r}, allow_negative={self.allow_negative!r}, seed={self.seed!r}")
        return base + (", restate=True)" if self.restate else ")")

    def __post_init__(self) -> None:
        lo_hi = tuple(self.num_ops)
        if len(lo_hi) != 2 or not all(isinstance(v, int) for v in lo_hi):
            raise ValueError(f"ArithmeticConfig.num_ops={self.num_ops!r}: expected a (min, max) pair of ints")
        if not 1 <= lo_hi[0] <= lo_hi[1]:
            raise ValueError(f"ArithmeticConfig.num_ops={self.num_ops!r}: need 1 <= min <= max")
        object.__setattr__(self, "num_ops", lo_hi)
        if not isinstance(self.operand_max, int) or self.operand_max < 2:
            raise ValueError(f"ArithmeticConfig.operand_max={self.operand_max!r}: expected an int >= 2")
        if not self.ops or any(c not in "+-*" for c in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ArithmeticConfig.ops={self.ops!r}: expected distinct characters from '+-*'")
        if self.ops == "-" and not self.allow_negative:
            raise ValueError(
                "ArithmeticConfig.ops='-' with allow_negative=False: results would go below 0; "
                "add '+' or '*' to ops, or set allow_negative=True"
            )


# the named tasks: the comparison's and the demo's (experiments/arithmetic/runs.py), and
# `megaprm eval-prm --arith-task`'s, on the same exact checker. "short": the demo's (2-4 steps, a
# solution of ~32 tokens). "long": 8-11 steps of a one-digit operand carried on a running
# result, each step restating the operations still to apply (`restate`), so a solution runs to
# 114-208 tokens (median 160 with the char tokenizer): the regime PRIME was built for (its
# released run samples hundreds of tokens), where "short" is ~20x too short for its implicit
# PRM's beta (docs/compare.md, "PRIME at this response length"). The restated tail puts each
# step's next operand in the step before it: without it, a first long task of 18-22 plain steps
# (median 152 tokens) left the tiny policy at 4.9% greedy accuracy and no fully correct chain
# after 600 supervised steps (3.5% after 200 more): it picked the wrong operand from the prompt.
TASKS = {"short": ArithmeticConfig(num_ops=(2, 4), operand_max=20, ops="+-", seed=0),
         "long": ArithmeticConfig(num_ops=(8, 11), operand_max=9, ops="+-", seed=0,
                                  restate=True)}


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "7+5-3+8="
    operands: tuple[int, ...]  # len(ops) + 1 operands, all >= 1
    ops: tuple[str, ...]  # each in "+-*"
    answer: int  # left-to-right value
    restate: bool = False  # its solutions restate the operations still to apply

    @property
    def results(self) -> list[int]:
        """True intermediate result after each operation; results[-1] == answer."""
        out, acc = [], self.operands[0]
        for op, b in zip(self.ops, self.operands[1:]):
            acc = _apply(acc, op, b)
            out.append(acc)
        return out


@dataclass(frozen=True)
class StepCheck:
    step_correct: list[bool]  # one entry per step of split_steps(response)
    final_correct: bool  # the last \boxed{} integer equals the problem's answer
    parsed_ok: bool  # every step is a well-formed equation or boxed step, boxed last
    first_error_index: int | None = field(default=None)  # first False in step_correct

    @property
    def all_steps_correct(self) -> bool:
        return all(self.step_correct) and len(self.step_correct) > 0

    @property
    def correct_with_wrong_step(self) -> bool:
        """Right final answer resting on a wrong step (the demo's headline metric)."""
        return self.final_correct and not all(self.step_correct)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def make_problem(operands: list[int] | tuple[int, ...], ops: list[str] | tuple[str, ...],
                 restate: bool = False) -> Problem:
    assert len(operands) == len(ops) + 1 and len(ops) >= 1
    prompt = str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(ops, operands[1:])) + "="
    acc = operands[0]
    for op, b in zip(ops, operands[1:]):
        acc = _apply(acc, op, b)
    return Problem(prompt=prompt, operands=tuple(operands), ops=tuple(ops), answer=acc,
                   restate=restate)


def _sample_problem(cfg: ArithmeticConfig, rng: random.Random) -> Problem:
    n = rng.randint(*cfg.num_ops)
    acc = rng.randint(1, cfg.operand_max)
    operands, ops = [acc], []
    for _ in range(n):
        op = rng.choice(cfg.ops)
        if op == "-" and not cfg.allow_negative and acc < 1:
            op = rng.choice([o for o in cfg.ops if o != "-"])  # validated: one exists
        no_neg = op == "-" and not cfg.allow_negative
        b = rng.randint(1, min(cfg.operand_max, acc) if no_neg else cfg.operand_max)
        acc = _apply(acc, op, b)
        operands.append(b)
        ops.append(op)
    return make_problem(operands, ops, cfg.restate)


def generate_problems(cfg: ArithmeticConfig, n: int, seed: int | None = None) -> list[Problem]:
    """`n` problems drawn with `random.Random(seed if given else cfg.seed)`: deterministic."""
    if n < 0:
        raise ValueError(f"generate_problems: n={n} must be >= 0")
    rng = random.Random(cfg.seed if seed is None else seed)
    return [_sample_problem(cfg, rng) for _ in range(n)]


def _tail(problem: Problem, k: int) -> str:
    """The operations after step k, as step k restates them (`restate`)."""
    return "".join(f"{op}{b}" for op, b in zip(problem.ops[k + 1:], problem.operands[k + 2:]))


def _render(steps: list[tuple[int, str, int, int]], boxed: int | None,
            problem: Problem | None = None) -> str:
    """Equation steps (then the boxed answer); with a `restate` problem, step k also restates
    the problem's operations after it (a corrupted step keeps the true tail)."""
    restate = problem is not None and problem.restate
    parts = [f"{a}{op}{b}={c}" + (_tail(problem, k) if restate else "")
             for k, (a, op, b, c) in enumerate(steps)]
    if boxed is not None:
        parts.append(f"\\boxed{{{boxed}}}")
    return SEP.join(parts)


def _reference_steps(problem: Problem) -> list[tuple[int, str, int, int]]:
    steps, acc = [], problem.operands[0]
    for op, b in zip(problem.ops, problem.operands[1:]):
        c = _apply(acc, op, b)
        steps.append((acc, op, b, c))
        acc = c
    return steps


def reference_solution(problem: Problem) -> str:
    return _render(_reference_steps(problem), problem.answer, problem)


def split_steps(text: str, ends_with_eos: bool = True) -> list[str]:
    """Split a response into steps on SEP, matching `rewards.steps.segment_steps` on its tokens.

    A response closed by EOS has len(separators) + 1 steps (the last one possibly empty). A
    response cut off right after a separator (`ends_with_eos=False`) has no step after it, as
    the separator closed the final step; the empty text of a 0-token response has 0 steps.
    """
    pieces = text.split(SEP)
    if not ends_with_eos and pieces[-1] == "":
        pieces.pop()
    return pieces


def extract_boxed_int(text: str) -> int | None:
    """Integer inside the last `\\boxed{...}` of `text`, or None."""
    matches = _LAST_BOXED_RE.findall(text)
    if not matches:
        return None
    try:
        return int(matches[-1].strip())
    except ValueError:
        return None


def check_steps(problem: Problem, response_text: str, ends_with_eos: bool = True) -> StepCheck:
    """Exact per-step check of a response (see the module docstring for the rules)."""
    steps = split_steps(response_text, ends_with_eos)
    n_ops = len(problem.ops)
    correct: list[bool] = []
    parsed_ok = len(steps) > 0
    prev = problem.operands[0]  # the result the next step must start from (as stated)
    for k, text in enumerate(steps):
        eq = (_EQ_TAIL_RE if problem.restate else _EQ_RE).fullmatch(text)
        boxed = _BOXED_RE.fullmatch(text)
        if eq is not None:
            a, op, b, c = int(eq[1]), eq[2], int(eq[3]), int(eq[4])
            ok = (
                k < n_ops
                and a == prev
                and op == problem.ops[k]
                and b == problem.operands[k + 1]
                and c == _apply(a, op, b)
                and (not problem.restate or eq[5] == _tail(problem, k))
            )
            prev = c
            correct.append(ok)
        elif boxed is not None:
            correct.append(k == n_ops and int(boxed[1]) == prev)
            parsed_ok = parsed_ok and k == len(steps) - 1
        else:
            correct.append(False)
            parsed_ok = False
    parsed_ok = parsed_ok and _BOXED_RE.fullmatch(steps[-1]) is not None
    first_error = next((i for i, ok in enumerate(correct) if not ok), None)
    return StepCheck(
        step_correct=correct,
        final_correct=extract_boxed_int(response_text) == problem.answer,
        parsed_ok=parsed_ok,
        first_error_index=first_error,
    )


def _delta(rng: random.Random, value: int, allow_negative: bool) -> int:
    """A small nonzero delta d with value + d >= 0 unless negatives are allowed (so a negative
    number is not a give-away that a step is wrong)."""
    choices = [d for d in (-3, -2, -1, 1, 2, 3) if allow_negative or value + d >= 0]
    return rng.choice(choices)


def _propagated_error(
    problem: Problem, ref: list[tuple[int, str, int, int]], rng: random.Random, kind: str, allow_negative: bool
) -> list[tuple[int, str, int, int]] | None:
    """Steps with one wrong result (or operand) at a random step k; later steps continue
    correctly from it. Only candidates whose error reaches the final answer, and (unless
    negatives are allowed) that keep every number >= 0 are used; None if there is none."""
    for k in rng.sample(range(len(ref)), len(ref)):
        a, op, b, c = ref[k]
        deltas = rng.sample((-3, -2, -1, 1, 2, 3), 6)
        if kind == "wrong_result":
            candidates = [(b, c + d) for d in deltas]
        else:
            candidates = [(b + d, _apply(a, op, b + d)) for d in deltas if b + d >= 1]
        for b_k, c_k in candidates:
            steps = ref[:k] + [(a, op, b_k, c_k)]
            for _, op_j, b_j, _ in ref[k + 1 :]:
                prev = steps[-1][3]
                steps.append((prev, op_j, b_j, _apply(prev, op_j, b_j)))
            if steps[-1][3] != problem.answer and (allow_negative or min(st[3] for st in steps) >= 0):
                return steps
    return None


def corrupt_solution(
    problem: Problem, rng: random.Random, kind: str, allow_negative: bool = False
) -> str:
    """A wrong solution of `problem` of the given kind (text in the reference format).

    * "wrong_result": one step's result off by a small delta; later steps continue correctly from
      it, so exactly that step is wrong and the final answer is wrong.
    * "flawed_but_correct": a wrong step whose error is cancelled, so the final answer is right
      (one of: the next step silently restarts from the true value; a compensating error in the
      next step; the boxed answer ignores a wrong last result).
    * "wrong_operand": one step uses a wrong operand (an off-by-delta number), computes correctly
      from it, and the error propagates to a wrong final answer.
    * "truncated": the solution cut at a random character before the boxed step (no EOS-closed
      boxed answer, so the final answer is wrong; the last step may be partial).
    """
    if kind not in CORRUPTION_KINDS:
        raise ValueError(f"corrupt_solution: kind={kind!r}; valid kinds are {CORRUPTION_KINDS}")
    ref = _reference_steps(problem)
    n = len(ref)
    allow_negative = allow_negative or min(problem.results) < 0  # it has negatives already
    if kind == "truncated":
        body = _render(ref, None, problem)
        return body[: rng.randint(1, len(body) - 1)]

    if kind in ("wrong_result", "wrong_operand"):
        wrong = _propagated_error(problem, ref, rng, kind, allow_negative)
        if wrong is None:  # no operand error survives (e.g. every step multiplies a 0)
            wrong = _propagated_error(problem, ref, rng, "wrong_result", allow_negative)
        assert wrong is not None  # an upward result error always survives and stays >= 0
        return _render(wrong, wrong[-1][3], problem)

    # flawed_but_correct
    variants = ["boxed_ignores"] + (["restart", "compensate"] if n >= 2 else [])
    variant = rng.choice(variants)
    steps = list(ref)
    if variant == "boxed_ignores":
        a, op, b, c = ref[-1]
        steps[-1] = (a, op, b, c + _delta(rng, c, allow_negative))
        return _render(steps, problem.answer, problem)
    k = rng.randrange(n - 1)
    a, op, b, c = ref[k]
    d = _delta(rng, c, allow_negative)
    steps[k] = (a, op, b, c + d)
    if variant == "compensate":
        # step k+1 starts from the wrong value but states the true result: a false equation
        _, op1, b1, c1 = ref[k + 1]
        steps[k + 1] = (c + d, op1, b1, c1)
    # "restart": step k+1 is left as in the reference, i.e. it starts from the true value
    return _render(steps, problem.answer, problem)


def step_labelled_examples(
    cfg: ArithmeticConfig,
    n: int,
    seed: int | None = None,
    correct_fraction: float = 0.5,
    label_mode: str = "local",
) -> list[tuple[str, list[str], list[int]]]:
    """PRM training data: (prompt, steps, labels), about `correct_fraction` reference solutions
    and the rest corrupted with a kind drawn uniformly from CORRUPTION_KINDS.

    Labels come from `check_steps` (exact). label_mode "local": 1 iff the step itself is correct
    (PRM800K-style per-step labels); "prefix": 1 before the first wrong step, 0 from it onward.
    Truncated solutions are split with `ends_with_eos=False`, like a response cut off mid-way.
    """
    if label_mode not in ("local", "prefix"):
        raise ValueError(f"step_labelled_examples: label_mode={label_mode!r}; valid: 'local', 'prefix'")
    if not 0.0 <= correct_fraction <= 1.0:
        raise ValueError(f"step_labelled_examples: correct_fraction={correct_fraction} must be in [0, 1]")
    rng = random.Random((cfg.seed if seed is None else seed) + 1_000_003)
    problems = generate_problems(cfg, n, seed)
    out = []
    for problem in problems:
        if rng.random() < correct_fraction:
            text, eos = reference_solution(problem), True
        else:
            kind = rng.choice(CORRUPTION_KINDS)
            text, eos = corrupt_solution(problem, rng, kind, cfg.allow_negative), kind != "truncated"
        check = check_steps(problem, text, ends_with_eos=eos)
        if label_mode == "local":
            labels = [int(ok) for ok in check.step_correct]
        else:
            first = check.first_error_index
            labels = [int(first is None or i < first) for i in range(len(check.step_correct))]
        out.append((problem.prompt, split_steps(text, eos), labels))
    return out
