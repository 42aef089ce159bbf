"""ProcessBench's first-error F1 and the step AUROC of `rewards.prm_eval`: against a hand-computed
example, and against ProcessBench's released definition (code/run_eval_prm_trl.py, restated as a
plain loop below) on a fixture in its JSONL format."""
import json
from pathlib import Path

import pytest
import torch

from megaprm.rewards import prm_eval
from megaprm.rewards.prm_eval import ScoredSolution

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "processbench_tiny.jsonl"


def test_hand_computed_example():
    # threshold 0.5: the prediction is the first step scored < 0.5, else -1
    sols = [  # scores, ProcessBench label, kind, exact step labels
        ScoredSolution((0.9, 0.8, 0.7), -1, "reference", (1, 1, 1)),  # A: pred -1, right
        ScoredSolution((0.9, 0.4, 0.6), -1, "reference", (1, 1, 1)),  # B: pred 1, false alarm
        ScoredSolution((0.6, 0.7), -1, "reference", (1, 1)),          # G: pred -1, right
        ScoredSolution((0.9, 0.2, 0.1), 1, "wrong_result", (1, 0, 1)),  # C: pred 1, right
        ScoredSolution((0.3, 0.9, 0.1), 1, "wrong_result", (1, 0, 1)),  # D: pred 0, too early
        ScoredSolution((0.9, 0.9, 0.9), 2, "truncated", (1, 1, 0)),   # E: pred -1, missed
        ScoredSolution((0.5, 0.49), 1, "truncated", (1, 0)),          # F: pred 1 (0.5 is good)
        ScoredSolution((0.1,), 0, "truncated", (0,)),                 # H: pred 0, right
    ]
    rep = prm_eval.judge(sols, 0.5)
    a = rep["all"]
    # erroneous C D E F H: right C F H -> acc1 = 3/5; correct A B G: right A G -> acc2 = 2/3
    # F1 = 2 * 3/5 * 2/3 / (3/5 + 2/3) = (4/5) / (19/15) = 12/19
    assert (a["n_erroneous"], a["n_correct"]) == (5, 3)
    assert a["acc_erroneous"] == pytest.approx(3 / 5) and a["acc_correct"] == pytest.approx(2 / 3)
    assert a["f1"] == pytest.approx(12 / 19)
    wr, tr, ref = (rep["per_kind"][k] for k in ("wrong_result", "truncated", "reference"))
    # a kind's errors against every correct solution: wrong_result 1/2 and 2/3 -> F1 4/7;
    # truncated 2/3 (E missed) and 2/3 -> F1 2/3; reference: no errors of its own -> F1 nan
    assert wr["acc_erroneous"] == pytest.approx(1 / 2) and wr["f1"] == pytest.approx(4 / 7)
    assert tr["acc_erroneous"] == pytest.approx(2 / 3) and tr["f1"] == pytest.approx(2 / 3)
    assert ref["acc_correct"] == pytest.approx(2 / 3) and ref["f1"] != ref["f1"]
    # step AUROC of wrong_result: its bad steps (C 0.2, D 0.9) against the set's 15 good steps
    # (A .9 .8 .7, B .9 .4 .6, G .6 .7, C .9 .1, D .3 .1, E .9 .9, F .5). 0.2 is below 13 of
    # them; 0.9 is below none and ties 5 (counted half): (13 + 2.5) / (2 * 15)
    assert wr["step_auroc"] == pytest.approx(15.5 / 30)
    assert (wr["bad_steps"], wr["steps"]) == (2, 6)
    # every step pooled: 5 bad (C .2, D .9, E .9, F .49, H .1) against the 15 good, by pairs
    assert a["bad_steps"] == 5 and a["steps"] == 20
    good = [.9, .8, .7, .9, .4, .6, .6, .7, .9, .1, .3, .1, .9, .9, .5]
    bad = [.2, .9, .9, .49, .1]
    pairs = sum((g > b) + 0.5 * (g == b) for g in good for b in bad)
    assert a["step_auroc"] == pytest.approx(pairs / (len(good) * len(bad)))


def test_f1_edge_cases():
    assert prm_eval.first_error_f1([0, 0], [1, -1]).f1 == 0.0  # both accuracies 0 (all miss)
    f = prm_eval.first_error_f1([-1, -1], [-1, -1])  # no erroneous solution: acc1, F1 nan
    assert f.acc_correct == 1.0 and f.acc_erroneous != f.acc_erroneous and f.f1 != f.f1
    assert prm_eval.predicted_first_error([0.7, 0.2, 0.1], 0.5) == 1
    assert prm_eval.predicted_first_error([0.0, 0.0], 0.0) == -1  # 0 is not below 0
    assert prm_eval.first_error_label([1, 1, 0, 0]) == 2 and prm_eval.first_error_label([1]) == -1


# step scores of the fixture's rows, as a PRM might give them (P(good) per step)
FIXTURE_SCORES = {
    "pb-0": [0.95, 0.90, 0.99], "pb-1": [0.20, 0.70, 0.80], "pb-2": [0.90, 0.60, 0.30],
    "pb-3": [0.80, 0.45, 0.90], "pb-4": [0.90, 0.90, 0.10], "pb-5": [0.9, 0.9, 0.9, 0.9],
    "pb-6": [0.90, 0.30, 0.20, 0.90], "pb-7": [0.70, 0.80, 0.60], "pb-8": [0.90, 0.40, 0.80],
    "pb-9": [0.50, 0.51, 0.52],
}


def _release_metric(rows, scores, threshold):
    """ProcessBench's run_eval_prm_trl.py, restated: each step's verdict (1 = good), the index of
    the first 0 (or -1), `match`, then error acc / correct acc / F1 in percent."""
    res = []
    for r in rows:
        verdict = [1 if s >= threshold else 0 for s in scores[r["id"]]]
        pred = verdict.index(0) if 0 in verdict else -1
        res.append({"label": r["label"], "match": pred == r["label"]})
    data1 = [e for e in res if e["label"] != -1]
    data2 = [e for e in res if e["label"] == -1]
    acc1 = sum(e["match"] for e in data1) / len(data1) * 100
    acc2 = sum(e["match"] for e in data2) / len(data2) * 100
    return acc1, acc2, 2 * acc1 * acc2 / (acc1 + acc2)


@pytest.mark.parametrize("threshold", [0.5, 0.35, 0.85])
def test_processbench_fixture_matches_the_released_definition(threshold):
    raw = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    rows = prm_eval.read_processbench_jsonl(str(FIXTURE))
    assert [r.label for r in rows] == [r["label"] for r in raw] and len(rows) == 10
    sols = [ScoredSolution(tuple(FIXTURE_SCORES[r.id]), r.label, "tiny") for r in rows]
    rep = prm_eval.judge(sols, threshold, pooled_kinds=False)
    acc1, acc2, f1 = _release_metric(raw, FIXTURE_SCORES, threshold)
    got = rep["per_kind"]["tiny"]
    assert got["acc_erroneous"] * 100 == pytest.approx(acc1)
    assert got["acc_correct"] * 100 == pytest.approx(acc2)
    assert got["f1"] * 100 == pytest.approx(f1) and rep["mean_f1"] * 100 == pytest.approx(f1)
    assert "step_auroc" not in got  # ProcessBench gives the first error only


def test_processbench_fixture_at_0_5_by_hand():
    # erroneous: pb-1 (pred 0 = 0 right), pb-2 (pred 2 != 1), pb-4 (2 right), pb-6 (1 right),
    # pb-8 (1 != 0) -> 3/5; correct: pb-0, pb-3 (pred 1), pb-5, pb-7, pb-9 (0.5 is good) -> 4/5
    rows = prm_eval.read_processbench_jsonl(str(FIXTURE))
    sols = [ScoredSolution(tuple(FIXTURE_SCORES[r.id]), r.label, "tiny") for r in rows]
    a = prm_eval.judge(sols, 0.5, pooled_kinds=False)["all"]
    assert (a["acc_erroneous"], a["acc_correct"]) == (pytest.approx(0.6), pytest.approx(0.8))
    assert a["f1"] == pytest.approx(2 * 0.6 * 0.8 / 1.4)


@pytest.mark.parametrize("line, why", [
    ('{"problem": "1+1=", "steps": ["1+1=2"], "label": 1}', "'label' must be an integer in [-1, 0]"),
    ('{"problem": "1+1=", "steps": [], "label": -1}', "'steps' must be a non-empty list"),
    ('{"problem": "1+1=", "steps": ["1+1=2"]}', "missing field(s) ['label']"),
    ('{"problem": "1+1=", "steps": ["1+1=2"], "label": -1', "not valid JSON"),
])
def test_a_bad_row_is_named_by_its_line(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text(FIXTURE.read_text().splitlines()[0] + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        prm_eval.read_processbench_jsonl(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and why in msg and "\n" not in msg, msg


def test_step_auroc_keeps_its_old_home():
    from megaprm.trainer import prm_training

    assert prm_training.step_auroc is prm_eval.step_auroc
    assert prm_eval.step_auroc(torch.tensor([0.1, 0.9, 0.5]), torch.tensor([0, 1, 1])) == 1.0


def test_subsets_are_judged_apart_and_averaged_like_the_release():
    # subset a: erroneous right 1/1, correct right 0/1 -> F1 0; subset b: 1/2 and 1/1 -> 2/3.
    # The release prints each subset's F1 and their mean: (0 + 2/3) / 2 = 1/3.
    sols = [ScoredSolution((0.9, 0.1), 1, "a"), ScoredSolution((0.1,), -1, "a"),
            ScoredSolution((0.1, 0.9), 1, "b"), ScoredSolution((0.9, 0.1), 1, "b"),
            ScoredSolution((0.9,), -1, "b")]
    rep = prm_eval.judge(sols, 0.5, pooled_kinds=False)
    a, b = rep["per_kind"]["a"], rep["per_kind"]["b"]
    assert (a["acc_erroneous"], a["acc_correct"], a["f1"]) == (1.0, 0.0, 0.0)
    assert (b["acc_erroneous"], b["acc_correct"]) == (0.5, 1.0)
    assert b["f1"] == pytest.approx(2 / 3) and rep["mean_f1"] == pytest.approx(1 / 3)
    # pooled (error kinds): b's correct accuracy becomes the whole set's, 1/2
    assert prm_eval.judge(sols, 0.5)["per_kind"]["b"]["acc_correct"] == 0.5
