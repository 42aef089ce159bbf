"""`reward.verifier: prime_math` (rewards.prime_grader, run in the verifiers' worker) against
the release's grader transcribed in tests/rewards/prime_release_reference.py, `prof_math_verify`
against PROF-GRPO's math-verify call, `hendrycks_math` against PURE's math_score.py
(tests/rewards/pure_release_reference.py) and `verl_prime_math` against the copy of the grader
PAPO's release ships (tests/rewards/papo_release_reference.py), on answer pairs of the kinds where graders part:
percentages, pi, fractions and decimals, several or empty boxes, numbers inside prose, order,
intervals, units, LaTeX spacing."""
import math

import pytest
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

from megaprm.rewards.prime_grader import _eval_arithmetic
from megaprm.rewards.verifiers import TIMEOUT_S, math_scores
from tests.rewards import papo_release_reference as papo_release
from tests.rewards import pure_release_reference as pure_release
from tests.rewards.prime_release_reference import released_score

PAIRS = [  # (response, ground truth)
    # percentages: the release accepts the truth, truth/100 and truth*100
    ("The answer is \\boxed{0.5}", "50"), ("\\boxed{50\\%}", "50"), ("\\boxed{50}", "50\\%"),
    ("\\boxed{5000}", "50"), ("\\boxed{0.25}", "25\\%"), ("\\boxed{25\\%}", "0.25"),
    ("\\boxed{12.5\\%}", "12.5"), ("so we get 40%", "40"),
    # pi, tried as math.pi and as 3.14
    ("\\boxed{3.14}", "\\pi"), ("\\boxed{2\\pi}", "6.28"),
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac{\\pi}{2}"), ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}"),
    ("\\boxed{3.1416}", "\\pi"), ("\\boxed{6\\pi}", "18.84"), ("\\boxed{4\\pi}", "4 \\pi"),
    ("\\boxed{\\pi r^2}", "\\pi r^2"),
    # fractions and decimals
    ("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{0.5}", "\\frac12"), ("\\boxed{1/2}", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"), ("\\boxed{2/4}", "1/2"),
    ("\\boxed{0.333}", "\\frac{1}{3}"), ("\\boxed{0.3333}", "\\frac{1}{3}"),
    ("\\boxed{1.5}", "\\frac{3}{2}"), ("\\boxed{5.0}", "5"), ("\\boxed{5.}", "5"),
    ("\\boxed{-\\frac{1}{3}}", "-\\frac13"), ("\\boxed{\\tfrac{7}{2}}", "3.5"),
    # several or empty boxes
    ("\\boxed{5}\\boxed{}", "5"), ("\\boxed{4} then \\boxed{5}", "5"),
    ("\\boxed{5} then \\boxed{4}", "5"), ("\\boxed{}", "5"), ("\\boxed{\\boxed{5}}", "5"),
    ("\\boxed 5$", "5"), ("$\\boxed{5}$.", "5"), ("\\fbox{7}", "7"),
    # numbers inside prose
    ("The answer is 3 apples", "3"), ("There are 3 apples.", "3"), ("so x = 7. Done.", "7"),
    ("Therefore the final answer is: 12", "12"), ("We get 12 cm.", "12"),
    ("It takes 5 hours", "5"), ("The answer is $\\$5$", "5"), ("The answer is \\$5.00", "5"),
    ("x is 10 degrees", "10"), ("\\boxed{\\text{5 apples}}", "5"),
    # order, tuples and lists
    ("\\boxed{2, 1}", "1, 2"), ("\\boxed{1, 2}", "1, 2"), ("\\boxed{1,2}", "1, 2"),
    ("\\boxed{(1, 2)}", "(1,2)"), ("\\boxed{(2, 1)}", "(1, 2)"), ("\\boxed{1 and 2}", "1, 2"),
    ("\\boxed{x=1 \\text{ or } x=2}", "1, 2"), ("\\boxed{1,000}", "1000"),
    ("\\boxed{1{,}000}", "1000"),
    # intervals
    ("\\boxed{[1, 2)}", "[1,2)"), ("\\boxed{(1, 2]}", "[1,2)"),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)"), ("\\boxed{[0,\\frac{1}{2}]}", "[0, 0.5]"),
    ("\\boxed{(1,2)\\cup(3,4)}", "(1,2) \\cup (3,4)"),
    # units
    ("\\boxed{12\\text{ cm}}", "12"), ("\\boxed{12 \\text{ inches}}", "12"),
    ("\\boxed{90^\\circ}", "90"), ("\\boxed{5 \\text{ meters}}", "5"),
    ("\\boxed{3\\text{ million}}", "3000000"),
    # LaTeX spacing and forms, bases, choices, equations
    ("\\boxed{2\\sqrt{3}}", "2 \\sqrt 3"), ("\\boxed{2\\sqrt3}", "2\\sqrt{3}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt 3}{2}"), ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{ 7 }", "7"), ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"), ("\\boxed{10_2}", "2"),
    ("\\boxed{101_2}", "5"), ("\\boxed{\\text{(B)}}", "B"), ("\\boxed{B}", "\\text{(B)}"),
    ("\\boxed{k=3}", "3"), ("\\boxed{y = 2x + 3}", "2x+3"), ("\\boxed{\\infty}", "\\infty"),
    ("\\boxed{1e3}", "1000"), ("\\boxed{3\\frac{1}{2}}", "3.5"),
    ("\\boxed{7 \\frac{1}{2}}", "\\frac{15}{2}"),
]


def test_prime_math_grades_every_pair_as_the_release():
    responses, truths = zip(*PAIRS)
    released = [released_score(r, t) for r, t in PAIRS]
    ours = math_scores(list(responses), list(truths), "prime_math")
    wrong = [(r, t, want, got) for (r, t), want, got in zip(PAIRS, released, ours) if want != got]
    assert not wrong, wrong
    assert len(PAIRS) >= 60 and 20 <= sum(released) <= len(PAIRS) - 15  # both verdicts common


def test_prime_math_is_not_math_verify():
    """The pairs where the lenient math-verify parts from the release (0.5 for 50 under the
    percent rule, 3.14 for pi, a trailing empty box; a number inside prose, an unordered list),
    so the agreement above is the release's grader, not any reasonable checker."""
    pairs = [("The answer is \\boxed{0.5}", "50"), ("\\boxed{3.14}", "\\pi"),
             ("\\boxed{5}\\boxed{}", "5"), ("The answer is 3 apples", "3"),
             ("\\boxed{2, 1}", "1, 2")]
    responses, truths = map(list, zip(*pairs))
    released = [released_score(r, t) for r, t in pairs]
    assert released == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert math_scores(responses, truths, "prime_math") == released
    lenient = math_scores(responses, truths, "math_verify")
    assert sum(a != b for a, b in zip(lenient, released)) >= 3


def test_the_pi_answer_is_evaluated_as_arithmetic_only():
    """grader.py's handle_pi runs eval on the substituted answer; megaprm evaluates literal
    arithmetic and leaves any other text as text (as when the release's eval fails)."""
    assert _eval_arithmetic("2*3.14") == pytest.approx(6.28)
    assert _eval_arithmetic("(1*3.14, 2)") == (3.14, 2)
    assert _eval_arithmetic("__import__('os').getcwd()") == "__import__('os').getcwd()"
    assert _eval_arithmetic("1*3.14^2") == "1*3.14^2"  # XOR of a float: a TypeError released
    assert math.isclose(released_score("\\boxed{2\\pi}", "6.2832"), 1.0)


def _prof_release(response: str, truth: str) -> float:
    """PROF-GRPO verl/utils/reward_score/math_verify.py compute_score (math-verify's default
    extraction configs, expressions before LaTeX for the prediction; errors score 0)."""
    metric = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                         pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    try:
        return float(metric(["\\boxed{" + truth + "}"], [response])[0])
    except Exception:  # noqa: BLE001 - as released: 0
        return 0.0


def test_prof_math_verify_is_prof_grpos_call():
    pairs = PAIRS[::3] + [("\\boxed{5}, so the final answer is $6$", "6"),
                          ("\\boxed{5}, so the final answer is $6$", "5")]
    responses, truths = map(list, zip(*pairs))
    released = [_prof_release(r, t) for r, t in pairs]
    assert math_scores(responses, truths, "prof_math_verify") == released
    # the release takes the last answer, the lenient verifier the boxed one
    assert released[-2:] == [1.0, 0.0]
    assert math_scores(responses[-2:], truths[-2:], "math_verify") == [0.0, 1.0]
    assert TIMEOUT_S["prof_math_verify"] == 20.0 and TIMEOUT_S["prime_math"] == 300.0


def test_hendrycks_math_is_pures_checker():
    """PURE's string rules on every pair, and on "a/b" forms where PURE's copy of the MATH
    normalisation raises (its fix_a_slash_b catches only its assert) and falls back to raw
    equality, while PRM800K's copy leaves the string as it is."""
    slash = [("\\boxed{x/ y}", "x/y"), ("\\boxed{x/y}", "\\frac{x}{y}"), ("\\boxed{a/ 2}", "a/2"),
             ("\\boxed{ 3/4}", "\\frac34"), ("\\boxed{3 /4}", "3/4"), ("\\boxed{1/2/3}", "1/2/3"),
             ("so $\\boxed 7$ and", "7"), ("\\boxed{45,000}", "45000"), ("\\boxed{45000}", "45,000")]
    pairs = PAIRS + slash
    responses, truths = map(list, zip(*pairs))
    released = [pure_release.compute_score(r, t) for r, t in pairs]
    assert math_scores(responses, truths, "hendrycks_math") == released
    assert released[len(PAIRS):len(PAIRS) + 3] == [0.0, 0.0, 0.0]


PMATRIX = "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"


def test_verl_prime_math_grades_as_papos_copy():
    """PAPO grades with verl's copy of PRIME's grader: its last sympy stage never runs (so
    2/4 is not 1/2 there) and its pmatrix rules do (a Matrix(...) answer for a pmatrix)."""
    pairs = PAIRS + [("\\boxed{Matrix([1, 2])}", PMATRIX), ("\\boxed{[1, 2]}", PMATRIX),
                     ("\\boxed{[x, 2]}", PMATRIX), ("\\boxed{2^{10}}", "1024"),
                     ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}")]
    responses, truths = map(list, zip(*pairs))
    released = [papo_release.released_score(r, t) for r, t in pairs]
    assert math_scores(responses, truths, "verl_prime_math") == released
    prime = math_scores(responses, truths, "prime_math")
    parted = [p for p, a, b in zip(pairs, released, prime) if a != b]
    assert ("\\boxed{2/4}", "1/2") in parted and ("\\boxed{Matrix([1, 2])}", PMATRIX) in parted
