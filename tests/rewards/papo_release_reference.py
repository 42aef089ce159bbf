"""The copy of PRIME's grader that PAPO's release grades with, transcribed for the tests where it
differs from PRIME's (tests/rewards/prime_release_reference.py holds the rest):
ScopeHLS/Process-Aware-Policy-Optimization@4d48531 verl/verl/utils/reward_score/prime_math/

* __init__.py:212-213: `are_equal_under_sympy` under verl's `@timeout_limit(seconds=2)` (a child
  process; no test pair comes near 2 s, so it is called directly here);
* grader.py:285-319: the two pmatrix branches, live (their `\\begin{pmatrix}` is a raw string);
* grader.py:324-358: `symbolic_equal` opens its limits with `with timeout_limit(seconds=...)`,
  which (verl/utils/py_functional.py) returns a decorator, not a context manager: the `with`
  raises TypeError inside each try, so nothing is parsed, simplified or evaluated.
* __init__.py:389-410: compute_score, as PRIME's evaluate_math."""
from __future__ import annotations

import math
from functools import wraps

from sympy.parsing.latex import parse_latex
from sympy.parsing.sympy_parser import parse_expr

from tests.rewards import prime_release_reference as prime
from tests.rewards.prime_release_reference import (
    _normalize,
    format_intervals,
    is_digit,
    match_answer,
    normalize,
    normalize_answer,
    split_tuple,
    _is_frac,
    _str_is_int,
    are_equal_under_sympy,
)


def timeout_limit(seconds, use_signals=False):
    """verl's decorator factory (py_functional.py), enough to show what `with` does on it."""
    def decorator(func):
        @wraps(func)
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapper
    return decorator


def grade_answer(given_answer, ground_truth):
    if normalize_answer(ground_truth) == normalize_answer(given_answer):
        return True
    gt_n, given_n = _normalize(ground_truth), _normalize(given_answer)
    if gt_n == given_n:
        return True
    if len(given_n) == 0:
        return False
    gt_elems, given_elems = split_tuple(gt_n), split_tuple(given_n)
    if len(gt_elems) > 1 and (gt_n[0] != given_n[0] or gt_n[-1] != given_n[-1]):
        return False
    if len(gt_elems) != len(given_elems):
        return False
    for gt_elem, given_elem in zip(gt_elems, given_elems):
        if _is_frac(gt_elem) and _is_frac(given_elem):
            is_correct = gt_elem == given_elem
        elif _str_is_int(gt_elem) != _str_is_int(given_elem):
            is_correct = False
        else:
            is_correct = are_equal_under_sympy(gt_elem, given_elem)
        if not is_correct:
            return False
    return True


def math_equal(prediction, reference, include_percentage=True, tolerance=1e-4, timeout=10.0,
               pi=math.pi):
    prediction = normalize(prediction, pi)
    reference = normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    try:
        if is_digit(prediction)[0] and is_digit(reference)[0]:
            prediction, reference = is_digit(prediction)[1], is_digit(reference)[1]
            gt_result = [reference / 100, reference, reference * 100] if include_percentage \
                else [reference]
            for item in gt_result:
                try:
                    if math.isclose(item, prediction, rel_tol=tolerance):
                        return True
                except Exception:
                    continue
            return False
    except Exception:
        pass
    if not prediction and prediction not in [0, False]:
        return False
    reference = str(reference).strip()
    prediction = format_intervals(str(prediction).strip())
    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) \
            or (prediction.startswith("(") and prediction.endswith(")")
                and not reference.startswith("[")):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for s in ["{", "}", "(", ")"]:
        ref_str, pred_str = ref_str.replace(s, ""), pred_str.replace(s, "")
    if pred_str == ref_str:
        return True
    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):
        pp, rp = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pp) == len(rp) and all([math_equal(p, r, include_percentage, tolerance)
                                       for p, r in zip(pp, rp, strict=True)]):
            return True
    if "," in prediction and "," in reference:
        pp = [item.strip() for item in prediction.split(",")]
        rp = [item.strip() for item in reference.split(",")]
        if len(pp) == len(rp):
            return bool(all([math_equal(pp[i], rp[i], include_percentage, tolerance)
                             for i in range(len(pp))]))
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pp, rp = prediction[prediction.find("(") + 1:-1].split(","), reference[1:-1].split(",")
        if len(pp) == len(rp) and all([math_equal(p, r, include_percentage, tolerance)
                                       for p, r in zip(pp, rp, strict=False)]):
            return True
    if r"\begin{pmatrix}" in reference and prediction.startswith("Matrix"):
        try:
            pred_matrix = parse_expr(prediction)
            ref_items = reference.split()[1:-1:2]
            if len(pred_matrix) == len(ref_items) and all(
                    [math_equal(p, r, include_percentage, tolerance)
                     for r, p in zip(ref_items, pred_matrix, strict=False)]):
                return True
        except Exception:
            pass
    elif r"\begin{pmatrix}" in reference and prediction.startswith("[") and prediction.endswith("]"):
        if isinstance(eval(prediction), list):  # noqa: S307 - the release's, test inputs only
            try:
                pred_matrix = eval(prediction)  # noqa: S307
                items = (reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
                         .removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}"))
                items = [row.split("&") if "&" in row else row for row in items.split("\\")]
                if len(pred_matrix) == len(items) and all(
                        [math_equal(p, r, include_percentage, tolerance)
                         for r, p in zip(items, pred_matrix, strict=False)]):
                    return True
            except Exception:
                pass
    return symbolic_equal(prediction, reference, tolerance, timeout)


def symbolic_equal(a, b, tolerance, timeout=10.0):
    def _parse(s):
        for f in [parse_expr, parse_latex]:
            try:
                with timeout_limit(seconds=timeout):
                    return f(s)
            except TimeoutError:
                continue
            except Exception:
                continue
        return s

    a, b = _parse(a), _parse(b)
    try:
        with timeout_limit(seconds=timeout):
            if prime.simplify(a - b) == 0:
                return True
    except Exception:
        pass
    try:
        with timeout_limit(seconds=timeout):
            if math.isclose(prime.N(a), prime.N(b), rel_tol=tolerance):
                return True
    except Exception:
        pass
    return False


def released_score(model_output, ground_truth) -> float:
    try:
        _, extracted = match_answer(str(model_output))
        ground_truth = str(ground_truth)
        if grade_answer(extracted, ground_truth):
            return 1.0
        try:
            if "\\pi" in extracted or "\\pi" in ground_truth:
                return float(any([math_equal(extracted, ground_truth, timeout=True, pi=pi)
                                  for pi in [math.pi, 3.14]]))
            return float(math_equal(extracted, ground_truth, timeout=True))
        except Exception:
            return 0.0
    except Exception:
        return 0.0



