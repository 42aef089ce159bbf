"""Grading against the shipped gold answers: gold as `\\boxed{...}` scores 1, wrong answers 0.

Every gold answer of the five sets self-verifies with math-verify given enough time (checked over
all 1517 problems, see BENCHMARKS.md); a handful of long symbolic Minerva / MATH500 answers need
more than the default 5 s per sample on a heavily loaded machine, so this test uses a generous
timeout and the first problems of each set to stay fast.
"""
import pytest

from eval.run import grade, summarize
from megaprm.rewards.verifiers import MathVerifier
from megaprm.tasks.datasets import BENCHMARKS, load_benchmark

PER_BENCHMARK = 8
WRONG = "-987654321.5"


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier()
    yield v
    v.close()


@pytest.mark.parametrize("name", BENCHMARKS)
def test_gold_answers_score_one_and_wrong_zero(name, verifier):
    recs, report = load_benchmark(name, limit=PER_BENCHMARK)
    assert len(recs) == PER_BENCHMARK, report.summary()
    golds = [r.answer for r in recs]
    k = 2  # two "samples" per problem: the same gold twice
    responses = [f"Step 1 ... so the answer is \\boxed{{{g}}}." for g in golds for _ in range(k)]
    scores = grade(responses, [g for g in golds for _ in range(k)], verifier, timeout_s=30.0)
    per_problem = [scores[i * k:(i + 1) * k] for i in range(len(golds))]
    assert summarize(per_problem, k)["avg@k"] == 1.0, [
        (r.index, r.answer) for r, s in zip(recs, per_problem) if min(s) < 1]

    wrong = [f"\\boxed{{{WRONG}}}" for _ in golds]
    # a neighbour's gold is wrong too, where the two answers differ as text
    shifted = [(f"\\boxed{{{golds[(i + 1) % len(golds)]}}}", g)
               for i, g in enumerate(golds) if golds[(i + 1) % len(golds)] != g]
    scores = grade(wrong + [s for s, _ in shifted], golds + [g for _, g in shifted], verifier,
                   timeout_s=30.0)
    assert sum(scores) == 0.0


def test_unparsable_response_scores_zero(verifier):
    assert grade(["no answer here", ""], ["4", "4"], verifier) == [0.0, 0.0]
