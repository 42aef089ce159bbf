"""The released checkers' string rules (rewards.answer_rules) on their edge cases; each expected
value is worked out by hand from the release's rules (PURE math_score.py, PRIME match_answer)."""
import pytest

from megaprm.rewards.answer_rules import (
    hendrycks_math_equal,
    prime_extract_answer,
    pure_boxed_answer,
)
from megaprm.rewards.prime_grader import mathd_normalize
from megaprm.rewards.verifiers import math_scores


@pytest.mark.parametrize("answer, truth, equal", [
    ("\\frac12", "0.5", True),            # \frac12 -> \frac{1}{2}; 0.5 -> \frac{1}{2}
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("x = 5", "5", True),                 # short left side of "=" dropped
    ("10^\\circ", "10", True),
    ("5\\text{ cm}", "5", True),          # a unit after "\text{ " dropped
    ("1/2", "\\frac{1}{2}", True),
    (".5", "\\frac{1}{2}", True),         # leading "." -> "0.5" -> \frac{1}{2}
    ("\\sqrt3", "\\sqrt{3}", True),
    ("45000", "45,000", True),            # the truth's commas may go ...
    ("45,000", "45000", False),           # ... the answer's may not (released asymmetry)
    ("2.0", "2", False),                  # strings, not numbers
    ("\\frac{2}{4}", "\\frac{1}{2}", False),
    ("x+1", "1+x", False),
])
def test_pure_string_equality_after_math_normalisation(answer, truth, equal):
    assert hendrycks_math_equal(f"Steps.\n\nSo it is $\\boxed{{{answer}}}$.", truth) is equal


def test_pure_box_rules():
    assert pure_boxed_answer("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert pure_boxed_answer("so $\\boxed 7$ and \\boxed{3}") == "7"  # the space form wins
    assert pure_boxed_answer("\\fbox{5}") is None                   # remove_boxed asserts
    assert pure_boxed_answer("\\boxed{5") is None
    assert not hendrycks_math_equal("the answer is 5", "5")         # no box, no reward
    # a rule that fails (two units) falls back to raw equality
    two_units = "1\\text{ m}2\\text{ s}"
    assert hendrycks_math_equal(f"\\boxed{{{two_units}}}", two_units)


@pytest.mark.parametrize("response, matched, answer", [
    ("The answer is 5.", True, "5."),
    ("Thus x = \\boxed{\\frac{3}{4}}", True, "\\frac{3}{4}"),
    ("so we get 12. Done", True, "12"),               # cut at ". ", then after "get "
    ("The final answer: 7 apples", True, "7 apples"),
    ("42 is the answer", True, "42"),
    ("nothing to see", False, "nothing to see"),
    ("The answer is x", False, "x"),                  # matched needs a digit
])
def test_prime_answer_extraction(response, matched, answer):
    assert prime_extract_answer(response) == (matched, answer)


def test_prime_mathd_normalize_unwraps_text():
    assert mathd_normalize("\\text{(B)}") == mathd_normalize("(B)")
    assert mathd_normalize(" \\dfrac{1}{2} ") == "\\frac{1}{2}"


def test_verifiers_differ_where_the_papers_do():
    """One response, three checkers: PURE's string rule rejects an unboxed or differently
    written answer that math-verify (PROF) and PRIME's extraction accept."""
    responses = ["The answer is 5.", "\\boxed{2.0}", "\\boxed{\\frac{1}{2}}", "\\boxed{7}"]
    truths = ["5", "2", "0.5", "8"]
    assert math_scores(responses, truths, "hendrycks_math") == [0.0, 0.0, 1.0, 0.0]
    assert math_scores(responses, truths, "prime_math") == [1.0, 1.0, 1.0, 0.0]
    assert math_scores(responses, truths, "math_verify") == [1.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="valid verifiers"):
        math_scores(responses, truths, "exact")
