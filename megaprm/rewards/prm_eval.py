"""Judge a PRM as the field does: first-error F1 (ProcessBench) and step AUROC, per error kind.

ProcessBench (Zheng et al. 2024, "ProcessBench: Identifying Process Errors in Mathematical
Reasoning", arXiv 2412.06559; released evaluation code/run_eval_prm_trl.py of
github.com/QwenLM/ProcessBench) scores a PRM on solutions whose `label` is the index of the
earliest wrong step, or -1 when every step is right:

* prediction: the first step the PRM calls bad, -1 if it calls none bad. The TRL-trained PRMs of
  the release call a step bad when its 2-class argmax is "bad"; Qwen2.5-Math-PRM's P(good) is
  compared with 0.5. Here: the first step whose score is below `threshold` (0.5 on P(good); a
  score exactly at the threshold counts as good, where the release's argmax breaks a 0.5/0.5 tie
  towards "bad" - a tie of two float logits);
* acc_erroneous ("error acc", acc1): the share of solutions with label != -1 whose prediction is
  exactly the label (an earlier or a later flag both miss);
* acc_correct ("correct acc", acc2): the share of solutions with label == -1 predicted -1;
* F1 = 2 * acc1 * acc2 / (acc1 + acc2), per subset; the release prints the mean F1 over its four
  subsets. Here F1 is 0 when both accuracies are 0 (the release divides 0 by 0) and nan when
  one of the two groups is empty.

Step AUROC (`step_auroc`) ranks every step's score against its exact label (1 = good).

Per error kind (the arithmetic task's corruption kinds, `tasks.arithmetic.CORRUPTION_KINDS`,
plus "reference" for the untouched solutions): a kind's row takes acc_erroneous over that kind's
erroneous solutions and acc_correct over *all* correct solutions of the set (a kind has few or
no correct ones of its own), so its F1 says how well the PRM finds that kind of error at the
false-alarm rate it has on correct solutions; likewise its step AUROC ranks that kind's bad steps
against every good step of the set. The "reference" row has acc_correct only.

Pure python/torch: no model code (`trainer.prm_judge` runs the PRMs).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch

PROCESSBENCH_FIELDS = ("id", "generator", "problem", "steps", "final_answer_correct", "label")


def step_auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a good step > score of a bad step), ties counted half (Mann-Whitney U).
    scores, labels: 1-D over steps; labels 1 = good. nan when one class is absent."""
    labels = labels.bool()
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores.double(), return_inverse=True, return_counts=True)
    counts = counts.double()
    first = counts.cumsum(0) - counts  # 0-based rank of each distinct value's first copy
    ranks = (first + (counts + 1) / 2.0)[inverse]  # 1-based average ranks
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def first_error_label(step_labels: Sequence[int]) -> int:
    """ProcessBench's label of a solution with exact step labels (1 = good): the index of the
    earliest bad step, -1 when there is none."""
    return next((k for k, ok in enumerate(step_labels) if not ok), -1)


def predicted_first_error(step_scores: Sequence[float], threshold: float) -> int:
    """The PRM's prediction: the index of the first step scored below `threshold`, else -1."""
    return next((k for k, s in enumerate(step_scores) if s < threshold), -1)


@dataclass(frozen=True)
class FirstErrorF1:
    """ProcessBench's metric of one set: accuracies (0..1) on the erroneous and the correct
    solutions, their harmonic mean, and the two counts."""

    acc_erroneous: float
    acc_correct: float
    f1: float
    n_erroneous: int
    n_correct: int


def _mean(xs: Sequence[bool]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def harmonic_f1(acc_erroneous: float, acc_correct: float) -> float:
    """2ab / (a + b); 0 when both are 0, nan when either is nan."""
    if math.isnan(acc_erroneous) or math.isnan(acc_correct):
        return float("nan")
    total = acc_erroneous + acc_correct
    return 2 * acc_erroneous * acc_correct / total if total > 0 else 0.0


def first_error_f1(predictions: Sequence[int], labels: Sequence[int]) -> FirstErrorF1:
    """ProcessBench's acc1 / acc2 / F1 of predictions against labels (both: first-error
    indices, -1 = no error)."""
    assert len(predictions) == len(labels)
    err = [p == y for p, y in zip(predictions, labels) if y != -1]
    ok = [p == -1 for p, y in zip(predictions, labels) if y == -1]
    a1, a2 = _mean(err), _mean(ok)
    return FirstErrorF1(a1, a2, harmonic_f1(a1, a2), len(err), len(ok))


@dataclass(frozen=True)
class ScoredSolution:
    """One judged solution: the PRM's step scores, ProcessBench's label (first error, -1 =
    none), the exact step labels when known (1 = good; None for a ProcessBench row), the
    solution's kind ("reference", a corruption kind, or a ProcessBench subset name) and where
    it came from."""

    scores: tuple
    label: int
    kind: str
    step_labels: Optional[tuple] = None
    source: str = ""  # where it came from (file:line, or kind:index)


def judge(solutions: Sequence[ScoredSolution], threshold: float, *,
          pooled_kinds: bool = True) -> dict:
    """The report of a PRM on judged solutions: {"threshold", "all": row, "per_kind": {kind:
    row}, "mean_f1"}, a row = FirstErrorF1's fields, "solutions", and with exact step labels
    "steps", "bad_steps" and "step_auroc". `pooled_kinds`: a kind's row measures its errors
    against the whole set's correct solutions (error kinds, module docstring); False: each
    kind is a set of its own (ProcessBench's subsets) and "mean_f1" is the mean of their F1s,
    the release's "Average F1" (nan where a subset's F1 is)."""
    preds = [predicted_first_error(s.scores, threshold) for s in solutions]
    labels = [s.label for s in solutions]
    overall = first_error_f1(preds, labels)
    has_steps = all(s.step_labels is not None for s in solutions)
    good_scores = [x for s in solutions if has_steps
                   for x, ok in zip(s.scores, s.step_labels) if ok]

    def row(sel: List[int], pooled: bool) -> Dict[str, float]:
        f = first_error_f1([preds[i] for i in sel], [labels[i] for i in sel])
        if pooled:  # the kind's errors against the whole set's correct solutions
            f = FirstErrorF1(f.acc_erroneous, overall.acc_correct,
                             harmonic_f1(f.acc_erroneous, overall.acc_correct),
                             f.n_erroneous, f.n_correct)
        out = asdict(f)
        out["solutions"] = len(sel)
        if has_steps:
            bad = [x for i in sel for x, ok in zip(solutions[i].scores, solutions[i].step_labels)
                   if not ok]
            good = good_scores if pooled else [x for i in sel for x, ok in
                                               zip(solutions[i].scores, solutions[i].step_labels)
                                               if ok]
            out["steps"] = sum(len(solutions[i].scores) for i in sel)
            out["bad_steps"] = len(bad)
            out["step_auroc"] = step_auroc(torch.tensor(good + bad, dtype=torch.float64),
                                           torch.tensor([1] * len(good) + [0] * len(bad)))
        return out

    kinds = sorted({s.kind for s in solutions})
    per_kind = {k: row([i for i, s in enumerate(solutions) if s.kind == k], pooled=pooled_kinds)
                for k in kinds}
    return {"threshold": threshold, "all": row(list(range(len(solutions))), pooled=False),
            "per_kind": per_kind,
            "mean_f1": (float("nan") if pooled_kinds or not per_kind
                        else sum(r["f1"] for r in per_kind.values()) / len(per_kind))}


# ------------------------------------------------------------------------- ProcessBench JSONL

@dataclass(frozen=True)
class ProcessBenchRow:
    """One row of ProcessBench's released JSONL (Qwen/ProcessBench on the HF hub)."""

    id: str
    generator: str
    problem: str
    steps: tuple
    final_answer_correct: bool
    label: int
    source: str  # file:line


def _row_problem(row) -> Optional[str]:
    """Why a ProcessBench row is unusable, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    missing = [k for k in ("problem", "steps", "label") if k not in row]
    if missing:
        return f"missing field(s) {missing}"
    if not isinstance(row["problem"], str):
        return "'problem' must be a string"
    steps = row["steps"]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) for s in steps):
        return "'steps' must be a non-empty list of strings"
    if any(not s.strip() for s in steps):
        return "'steps' has an empty step"
    label = row["label"]
    if isinstance(label, bool) or not isinstance(label, int) or not -1 <= label < len(steps):
        return (f"'label' must be an integer in [-1, {len(steps) - 1}] (the index of the "
                f"earliest wrong step among its {len(steps)} steps, -1 = none), got {label!r}")
    return None


def read_processbench_jsonl(path: str) -> List[ProcessBenchRow]:
    """ProcessBench rows of `path` (fields `PROCESSBENCH_FIELDS`; id, generator and
    final_answer_correct are optional). A bad row raises ValueError naming file:line, what is
    wrong and the fields a row needs; an empty file raises too."""
    need = ('each row is {"id", "generator", "problem": str, "steps": [str], '
            '"final_answer_correct": bool, "label": index of the earliest wrong step or -1}')
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); {need}") from None
            why = _row_problem(row)
            if why is not None:
                raise ValueError(f"{path}:{lineno}: {why}; {need}")
            rows.append(ProcessBenchRow(str(row.get("id", lineno)), str(row.get("generator", "")),
                                        row["problem"], tuple(row["steps"]),
                                        bool(row.get("final_answer_correct", row["label"] == -1)),
                                        row["label"], f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"{path}: no rows; {need}")
    return rows


def solution_rows(solutions: Sequence[ScoredSolution], threshold: float) -> List[dict]:
    """Per solution, as ProcessBench's release writes its outputs: source, kind, label,
    prediction, match, and the step scores."""
    out = []
    for s in solutions:
        pred = predicted_first_error(s.scores, threshold)
        out.append({"source": s.source, "kind": s.kind, "label": s.label, "prediction": pred,
                    "match": pred == s.label, "scores": [round(x, 6) for x in s.scores]})
    return out


def format_table(report: dict, title: str) -> str:
    """A plain-text table of `judge`'s report."""
    def num(x, fmt="{:.3f}"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)

    lines = [f"{title} (a step is called bad when its score < {report['threshold']:g})",
             f"{'kind':20s} {'solutions':>9s} {'err acc':>8s} {'corr acc':>8s} {'F1':>6s} "
             f"{'step AUROC':>10s} {'bad/steps':>11s}"]
    for name, r in [("all", report["all"]), *report["per_kind"].items()]:
        steps = f"{r['bad_steps']}/{r['steps']}" if "steps" in r else "-"
        lines.append(f"{name:20s} {r['solutions']:9d} {num(r['acc_erroneous']):>8s} "
                     f"{num(r['acc_correct']):>8s} {num(r['f1']):>6s} "
                     f"{num(r.get('step_auroc')):>10s} {steps:>11s}")
    return "\n".join(lines)
