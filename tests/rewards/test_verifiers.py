import threading
import time

import pytest
import torch

from megaprm.rewards.verifiers import (
    MathVerifier,
    arithmetic_reward,
    math_verify_reward,
    score_outcomes,
)
from megaprm.tasks.arithmetic import (
    ArithmeticConfig,
    generate_problems,
    make_problem,
    reference_solution,
)
from megaprm.tasks.datasets import load_benchmark

PATHOLOGICAL = [
    "\\boxed{9^{9^{9^{9}}}}",
    "so the answer is 9**9**9**9",
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "\\boxed{100000000!}",
]


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier()
    t0 = time.perf_counter()
    assert v.score(["\\boxed{1}"], ["1"]) == [1.0]
    print(f"\nmath-verify first-call latency (worker start + 1 check): {time.perf_counter() - t0:.2f} s")
    yield v
    v.close()


def test_math500_gold_answers_verify_against_themselves(verifier):
    records, _ = load_benchmark("math500")
    t0 = time.perf_counter()
    scores = verifier.score([f"So the final answer is $\\boxed{{{r.answer}}}$." for r in records], [r.answer for r in records])
    per_item = (time.perf_counter() - t0) / len(records)
    print(f"\nmath-verify warm latency: {1000 * per_item:.1f} ms per MATH500 answer")
    failed = [r.answer for r, s in zip(records, scores) if s != 1.0]
    assert failed == []


@pytest.mark.parametrize("name", ["aime24", "amc23", "minerva_math", "olympiadbench"])
def test_other_benchmark_gold_answers_verify(verifier, name):
    records, _ = load_benchmark(name, limit=60)
    scores = verifier.score([f"\\boxed{{{r.answer}}}" for r in records], [r.answer for r in records])
    assert sum(scores) == len(records)


@pytest.mark.parametrize(
    "response, truth",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{27.0}", "27"),
        ("\\boxed{27}", "27.0"),
        ("The answer is $27$.", "27"),
        ("Thus \\boxed{\\dfrac{3}{4}}.", "0.75"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}"),
        ("\\boxed{3, 5, 7}", "7,3,5"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\pi/2)"),
        ("\\boxed{90^\\circ}", "90"),
        ("first 12, then \\boxed{13}", "13"),
    ],
)
def test_equivalent_forms(response, truth):
    assert math_verify_reward(response, truth) == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [("\\boxed{26}", "27"), ("\\boxed{0.333}", "\\frac13"), ("\\boxed{\\frac{1}{3}}", "0.5"), ("", "1"), ("\\boxed{", "1"), ("\\boxed{1}", "}{")],
)
def test_wrong_or_broken_answers_score_zero(response, truth):
    assert math_verify_reward(response, truth) == 0.0


def test_other_problems_answers_do_not_verify(verifier):
    records, _ = load_benchmark("math500")
    answers = [r.answer for r in records]
    pairs = [(a, b) for a, b in zip(answers, answers[1:] + answers[:1]) if a != b]
    scores = verifier.score([f"\\boxed{{{a}}}" for a, _ in pairs], [b for _, b in pairs])
    # only genuinely equivalent pairs may pass (e.g. "5" vs "x=5")
    assert sum(scores) <= 0.01 * len(pairs), [p for p, s in zip(pairs, scores) if s]


@pytest.mark.parametrize(
    "response, inner_timeout", [(r, "auto") for r in PATHOLOGICAL] + [(r, None) for r in PATHOLOGICAL[:2]]
)
def test_pathological_inputs_are_bounded(verifier, response, inner_timeout):
    """inner_timeout=None switches math-verify's own alarms off: only the hard kill bounds it."""
    limit = 2.0
    verifier.score(["\\boxed{1}"], ["1"])  # a worker killed by the previous case restarts here
    t0 = time.perf_counter()
    assert verifier.score([response], ["5"], timeout_s=limit, inner_timeout=inner_timeout) == [0.0]
    assert time.perf_counter() - t0 < limit + 1.0
    assert verifier.score(["\\boxed{5}"], ["5"]) == [1.0]  # the pool recovered


def test_timeouts_in_a_batch_do_not_spoil_neighbours():
    v = MathVerifier(num_workers=2)
    try:
        responses = ["\\boxed{1}", PATHOLOGICAL[0], "\\boxed{3}", PATHOLOGICAL[1], "\\boxed{5}"]
        truths = ["1", "5", "3", "5", "5"]
        assert v.score(responses, truths, timeout_s=1.0, inner_timeout=None) == [1.0, 0.0, 1.0, 0.0, 1.0]
    finally:
        v.close()


def test_works_off_the_main_thread():
    """math-verify's own alarms refuse to run off the main thread; the worker does not care."""
    out = []

    def check():
        out.append(math_verify_reward("\\boxed{\\frac{2}{4}}", "0.5"))
        t0 = time.perf_counter()
        out.append(math_verify_reward(PATHOLOGICAL[0], "5", timeout_s=1.0))
        out.append(time.perf_counter() - t0)

    t = threading.Thread(target=check)
    t.start()
    t.join()
    assert out[:2] == [1.0, 0.0] and out[2] < 2.0


def test_arithmetic_rewards():
    p = make_problem([7, 5, 3, 8], ["+", "-", "+"])
    assert arithmetic_reward(p, reference_solution(p)) == 1.0
    assert arithmetic_reward(p, "7+5=12\n\n\\boxed{17}") == 1.0  # outcome only: steps not checked
    assert arithmetic_reward(p, "\\boxed{18}") == 0.0
    assert arithmetic_reward(p, "17") == 0.0  # no boxed answer
    problems = generate_problems(ArithmeticConfig(), 8, seed=0)
    responses = [reference_solution(q) if i % 2 else "\\boxed{-99}" for i, q in enumerate(problems)]
    expected = torch.tensor([i % 2 for i in range(8)], dtype=torch.float32)
    assert torch.equal(score_outcomes(responses, problems, kind="arithmetic"), expected)
    answers = [str(q.answer) for q in problems]
    assert torch.equal(score_outcomes(responses, answers, kind="arithmetic"), expected)


def test_score_outcomes_math_and_errors():
    r = score_outcomes(["\\boxed{2}", "\\boxed{3}", "nothing"], ["2", "4", "1"])
    assert r.dtype == torch.float32 and r.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="ground truths"):
        score_outcomes(["a"], ["1", "2"])
    with pytest.raises(ValueError, match="kind"):
        score_outcomes(["a"], ["1"], kind="code")
