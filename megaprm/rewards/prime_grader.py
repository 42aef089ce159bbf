"""PRIME's released math grader (`reward.verifier: prime_math`; `verl_prime_math` is the copy
PAPO's verl ships, which parts from it where `prime_grade(verl=True)` says), rewritten here
from its rules (no code taken), stage by stage:

1. PRIME's answer extraction (`answer_rules.prime_extract_answer`; the release's
   math_util/__init__.py `match_answer`).
2. PRM800K's `grade_answer` (math_util/__init__.py, from openai/prm800k grading/grader.py):
   a. the mathd normalisation of both strings (`answer_rules.math_normalize` after a whole-string
      `\\text{}` unwrap) compared as strings;
   b. PRM800K's own `_normalize` (`prm800k_normalize`: units, %, $, words, LaTeX turned into
      text with pylatexenc, mixed numbers, integers) compared as strings;
   c. element-wise (tuples and intervals split on commas): unreduced fractions must match as
      written, an integer only equals an integer, else sympy must simplify the difference to 0.
3. Qwen2.5-Math's `math_equal` (math_util/grader.py), with the release's `\\pi` retry: when
   either side holds `\\pi` it is tried with pi = math.pi and with pi = 3.14. It compares
   strings, then numbers (with the percent rule: the truth, truth/100 or truth*100 to a relative
   1e-4), then intervals and comma lists element by element, then sympy (`parse_expr`, else
   sympy's `parse_latex`) by simplification or numeric value, each parse and check bounded by
   a 1 s alarm (the release passes `timeout=True`; the nested element checks get 10 s).

Where the release runs Python's `eval` on the `\\pi`-substituted answer (grader.py
handle_pi), `_eval_arithmetic` evaluates literal arithmetic only (numbers, operators, tuples,
comparisons); any other text stays text, as when the release's eval fails. sympy's
`parse_latex` needs antlr4-python3-runtime 4.11 (pinned in the release's eval/
requirements_prime.txt with sympy 1.12); math-verify pins antlr 4.13, under which
`parse_latex` raises, so LaTeX that `parse_expr` cannot read ends the symbolic stage "not
equal", as in a release environment without antlr 4.11.

The whole grade runs in `rewards.verifiers`' killable worker (the release: a process pool with
a 300 s limit per sample, 0 on timeout). sympy's `parse_expr` evaluates text, as released: the
worker process keeps it away from the trainer.
"""
from __future__ import annotations

import ast
import contextlib
import math
import operator
import re
import signal

from megaprm.rewards.answer_rules import _RuleFailed, math_normalize, prime_extract_answer

RELEASE_TIMEOUT_S = 300.0  # reward_score/prime.py process_row_with_timeout


# ----------------------------------------------------------------------------- 2a: mathd

def _unwrap_text(s: str) -> str:
    """A whole-string `\\text{...}` -> its content (both graders' first rule)."""
    m = re.search(r"^\\text\{(.+?)\}$", s)
    return s if m is None else m.group(1)


def mathd_normalize(answer: str) -> str:
    """PRM800K's math_normalize.normalize_answer: strip, unwrap `\\text{}`, MATH normalisation;
    the (stripped, unwrapped) text itself where a rule fails."""
    answer = answer.strip()
    m = re.search(r"^\\text\{(.+?)\}$", answer)
    if m is not None:
        answer = m.group(1).strip()
    try:
        return math_normalize(answer)
    except (_RuleFailed, IndexError, ValueError):
        return answer


# ----------------------------------------------------------------------------- 2b: _normalize

_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day",
          "week", "month", "year", "foot", "feet", "inch", "yard", "liter")
_LATEX_TEXT_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"),
                       ("×", "*"))


def _float_or_none(s: str):
    try:
        return float(s)
    except ValueError:
        return None


def _near_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _drop_thousands_commas(s: str) -> str:
    """"1,234,567" -> "1234567"; tuple commas ("1,2") stay."""
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        nxt = pattern.sub(r"\1\3\4", s)
        if nxt == s:
            return s
        s = nxt


def _is_int_text(s: str) -> bool:
    x = _float_or_none(_drop_thousands_commas(s))
    return x is not None and _near_int(x)


def latex_to_text(expr: str) -> str:
    """LaTeX -> plain text sympy can read (PRM800K `_parse_latex`: pylatexenc, then the unicode
    symbols it emits spelled out)."""
    # deferred: pylatexenc is only needed by this grader, in its worker process
    from pylatexenc import latex2text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # "1\\frac12" stays a mixed number
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, word in _LATEX_TEXT_SYMBOLS:
        expr = expr.replace(symbol, word)
    return expr.strip()


def prm800k_normalize(expr: str) -> str:
    """PRM800K grader.py `_normalize`, rule by rule."""
    expr = _unwrap_text(expr)
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in (("million", 6), ("billion", 9), ("trillion", 12)):
        expr = expr.replace(word, f"*10^{power}")
    for unit in _UNITS:
        expr = re.sub(unit + r"(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    x = _float_or_none(expr)
    if x is not None and _near_int(x):
        expr = str(int(round(x)))
    if "\\" in expr:
        try:
            expr = latex_to_text(expr)
        except Exception:  # noqa: BLE001 - pylatexenc's failures leave the text as is, as released
            pass
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # "7 3/4" -> "7+3/4"
    expr = expr.lower()
    if _is_int_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


# ----------------------------------------------------------------------------- 2c: elements

def _split_elements(expr: str) -> list[str]:
    """A tuple or interval "(a, b)" / "[a, b)" -> its elements; anything else -> [expr]."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    brackets = "()[]"
    if (len(expr) > 2 and expr[0] in brackets and expr[-1] in brackets
            and not any(c in brackets for c in expr[1:-1])):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def _is_plain_fraction(s: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", s) is not None


def _sympy_difference_is_zero(truth: str, given: str) -> bool:
    """PRM800K `are_equal_under_sympy`, with its guard against inputs sympy may hang on (more
    than two unknown letters, `^{`, `^(`, stacked or multi-digit powers)."""
    # deferred: sympy, in the worker process only
    import sympy
    from sympy.parsing import sympy_parser

    expr = f"({truth})-({given})"
    if len({c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}) > 2:
        return False
    if "^{" in expr or "^(" in expr or re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr):
        return False
    try:
        parsed = sympy_parser.parse_expr(
            expr.replace("^", "**"),
            transformations=sympy_parser.standard_transformations
            + (sympy_parser.implicit_multiplication_application,))
        return sympy.simplify(parsed) == 0
    except Exception:  # noqa: BLE001 - any sympy failure: not equal, as released
        return False


def prm800k_grade(given: str, truth: str, sympy_seconds: float | None = None) -> bool:
    """PRM800K's grade_answer (stage 2). `sympy_seconds`: verl's copy bounds each sympy check
    (2 s, in a child process; a timeout raises out of the grade, scored 0)."""
    if mathd_normalize(truth) == mathd_normalize(given):
        return True
    truth_n, given_n = prm800k_normalize(truth), prm800k_normalize(given)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_e, given_e = _split_elements(truth_n), _split_elements(given_n)
    if len(truth_e) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # an interval's brackets must match
    if len(truth_e) != len(given_e):
        return False
    for t, g in zip(truth_e, given_e):
        if _is_plain_fraction(t) and _is_plain_fraction(g):
            ok = t == g  # an unreduced fraction is not accepted for a reduced one
        elif _is_int_text(t) != _is_int_text(g):
            ok = False
        else:
            if sympy_seconds is None:
                ok = _sympy_difference_is_zero(t, g)
            else:
                with _alarm(sympy_seconds):
                    ok = _sympy_difference_is_zero(t, g)
        if not ok:
            return False
    return True


# ----------------------------------------------------------------------------- 3: math_equal

class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _alarm(seconds: float):
    """SIGALRM after `seconds` (the worker's main thread), as grader.py's time_limit."""
    def on_alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
            ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne}


def _eval_node(node):
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_eval_node(e) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Compare) and all(type(o) in _COMPARE for o in node.ops):
        left, ok = _eval_node(node.left), True
        for op, right in zip(node.ops, node.comparators):
            right = _eval_node(right)
            ok = ok and _COMPARE[type(op)](left, right)
            left = right
        return ok
    raise ValueError("not literal arithmetic")


def _eval_arithmetic(text: str):
    """The value of `text` when it is literal arithmetic, else `text` unchanged."""
    try:
        return _eval_node(ast.parse(text, mode="eval"))
    except Exception:  # noqa: BLE001 - syntax, names, zero division, overflow: stays text
        return text


def _substitute_pi(s: str, pi: float):
    """grader.py handle_pi: each `\\pi` -> `*pi` after a digit, else `1*pi`; then the value of
    the result where it is literal arithmetic."""
    i = s.find("\\pi")
    while i != -1:
        value = f"*{pi}" if i > 0 and s[i - 1].isdigit() else f"1*{pi}"
        s = s[:i] + value + s[i + 3:]
        i = s.find("\\pi", i + 1)
    return _eval_arithmetic(s)


def _qwen_normalize(answer, pi: float):
    """grader.py `normalize`: "$5" -> "5", "5%" / "5\\%" -> "5", "101_2" -> 101 (the digits
    before a base subscript, read as a number: ValueError where they are not one), `\\pi`."""
    if not isinstance(answer, str):
        return answer
    if re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if re.match(r"^\d+(\.\d+)?%$", answer) or re.match(r"^\d+(\.\d+)?\\%$", answer):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:
        return int(float(answer.split("_")[0]))
    if "\\pi" in answer:
        return _substitute_pi(answer, pi)
    return answer


def _as_number(x):
    """grader.py is_digit: the number `x` spells (commas, or `{,}`, as thousands marks)."""
    s = str(x)
    try:
        return float(s.replace("{,}", "")) if "{,}" in s else float(s.replace(",", ""))
    except ValueError:
        return None


def _interval_form(s: str) -> str:
    """sympy's printed intervals back to brackets (grader.py format_intervals)."""
    for head, left, right in (("Interval.Ropen(", "[", ")"), ("Interval.Lopen(", "(", "]"),
                              ("Interval.open(", "(", ")"), ("Interval(", "[", "]")):
        m = re.match("^" + re.escape(head) + r"(.*)\)$", s)
        if m:
            return left + m.group(1) + right
    return s


def _symbolic_equal(a: str, b: str, tolerance: float, seconds: float) -> bool:
    # deferred: sympy, in the worker process only
    from sympy import N, simplify
    from sympy.parsing.latex import parse_latex
    from sympy.parsing.sympy_parser import parse_expr

    def parse(s):
        for reader in (parse_expr, parse_latex):
            try:
                with _alarm(seconds):
                    return reader(s)
            except Exception:  # noqa: BLE001 - unreadable (or parse_latex unavailable): next
                pass
        return s

    a, b = parse(a), parse(b)
    try:
        with _alarm(seconds):
            if simplify(a - b) == 0:
                return True
    except Exception:  # noqa: BLE001
        pass
    try:
        with _alarm(seconds):
            if math.isclose(N(a), N(b), rel_tol=tolerance):
                return True
    except Exception:  # noqa: BLE001
        pass
    return False


def _matrix_equal(prediction: str, reference: str, verl: bool) -> bool:
    """verl's copy only (its `\\begin{pmatrix}` is a raw string there; PRIME's copy tests for a
    backspace, so these never run): a sympy `Matrix(...)` or a list prediction against a
    pmatrix truth, element by element. A list that is not literal arithmetic raises (the
    release's eval fails outside its try)."""
    if prediction.startswith("Matrix"):
        # deferred: sympy, in the worker process only
        from sympy.parsing.sympy_parser import parse_expr
        try:
            pred = parse_expr(prediction)
            ref = reference.split()[1:-1:2]
            return len(pred) == len(ref) and all(
                [qwen_math_equal(x, r, verl=verl) for r, x in zip(ref, pred)])
        except Exception:  # noqa: BLE001 - as released: not equal by this rule
            return False
    value = _eval_arithmetic(prediction)
    if value is prediction:
        raise ValueError("a list prediction that is not literal arithmetic")
    if not isinstance(value, list):
        return False
    try:
        body = reference.removeprefix("\\\\begin{pmatrix}").removeprefix("\\begin{pmatrix}")
        body = body.removesuffix("\\\\end{pmatrix}").removesuffix("\\end{pmatrix}")
        ref = [row.split("&") if "&" in row else row for row in body.split("\\")]
        return len(value) == len(ref) and all(
            [qwen_math_equal(x, r, verl=verl) for r, x in zip(ref, value)])
    except Exception:  # noqa: BLE001
        return False


def qwen_math_equal(prediction, reference, tolerance: float = 1e-4, seconds: float = 10.0,
                    pi: float = math.pi, verl: bool = False) -> bool:
    """Qwen2.5-Math's math_equal (stage 3), percent rule on. Raises where the release raised
    (a base subscript on a non-number): the caller scores that 0. `verl`: verl's copy (PAPO),
    whose pmatrix rules run and whose sympy stage never does (it opens its time limits with
    `with timeout_limit(...)`, a decorator, which raises TypeError inside its own try)."""
    def _elementwise(pred_parts, ref_parts) -> bool:
        return all([qwen_math_equal(p, r, verl=verl) for p, r in zip(pred_parts, ref_parts)])

    prediction = _qwen_normalize(prediction, pi)
    reference = _qwen_normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    p_num, r_num = _as_number(prediction), _as_number(reference)
    if p_num is not None and r_num is not None:
        return any(math.isclose(r, p_num, rel_tol=tolerance)
                   for r in (r_num / 100, r_num, r_num * 100))
    if not prediction and prediction not in (0, False):
        return False
    reference, prediction = str(reference).strip(), _interval_form(str(prediction).strip())
    # brackets dropped (unless they clash) and braces/parentheses removed: "(1,2)" = "1,2"
    p, r = prediction, reference
    if (p.startswith("[") and p.endswith("]") and not r.startswith("(")) or \
            (p.startswith("(") and p.endswith(")") and not r.startswith("[")):
        p, r = p.strip("[]()"), r.strip("[]()")
    if re.sub(r"[{}()]", "", p) == re.sub(r"[{}()]", "", r):
        return True
    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):
        pp, rp = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pp) == len(rp) and _elementwise(pp, rp):
            return True
    if "," in prediction and "," in reference:
        pp = [x.strip() for x in prediction.split(",")]
        rp = [x.strip() for x in reference.split(",")]
        if len(pp) == len(rp):
            return _elementwise(pp, rp)  # same length: decided here, in order
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pp, rp = prediction[prediction.find("(") + 1:-1].split(","), reference[1:-1].split(",")
        if len(pp) == len(rp) and _elementwise(pp, rp):
            return True
    # (PRIME's grader.py tests for "\b"egin{pmatrix}, a backspace: its matrix rules never run)
    if verl and "\\begin{pmatrix}" in reference and (
            prediction.startswith("Matrix")
            or (prediction.startswith("[") and prediction.endswith("]"))):
        if _matrix_equal(prediction, reference, verl):
            return True
    return False if verl else _symbolic_equal(prediction, reference, tolerance, seconds)


# ----------------------------------------------------------------------------- the grade

def prime_grade(response: str, truth: str, verl: bool = False) -> bool:
    """PRIME's evaluate_math: extraction, PRM800K's grade_answer, then math_equal (with the
    `\\pi` retry) on the extracted answer; any error is "wrong". `verl`: the copy in PAPO's
    verl (verl/utils/reward_score/prime_math): the same stages, its sympy check in
    grade_answer bounded by 2 s, its pmatrix rules live and its last (sympy) stage of
    math_equal never reached (`qwen_math_equal`)."""
    answer = prime_extract_answer(response)[1]
    truth = str(truth)
    try:
        if prm800k_grade(answer, truth, sympy_seconds=2.0 if verl else None):
            return True
    except BaseException:  # noqa: BLE001 - the release lets this one propagate: scored 0
        return False
    try:
        if "\\pi" in answer or "\\pi" in truth:
            verdicts = [qwen_math_equal(answer, truth, seconds=1.0, pi=pi, verl=verl)
                        for pi in (math.pi, 3.14)]
            return any(verdicts)
        return qwen_math_equal(answer, truth, seconds=1.0, verl=verl)
    except Exception:  # noqa: BLE001 - evaluate_math's except: wrong
        return False
