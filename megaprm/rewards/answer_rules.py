"""The string rules of two released outcome checkers, written from their rules (no code taken):

* `hendrycks_math_equal` - PURE's verifier (CJReinforce/PURE openrlhf/utils/math_score.py,
  `compute_score`): the content of the response's last `\\boxed{}` must equal the ground truth
  as a string after the MATH dataset's normalisation (Hendrycks et al. 2021, the
  lm-evaluation-harness `strip_string`), or after also dropping the truth's commas. No symbolic
  check: "2.0" is not "2".
* `prime_extract_answer` - PRIME's (and verl's `prime_math`, which PAPO uses) answer extraction
  (PRIME-RL/PRIME training/verl/utils/reward_score/evaluation_utils/math_util `match_answer`):
  answer markers, then the last boxed content, then the tail after the last "is", "=", ...
  (its grading stages are in `rewards.prime_grader`).

Every rule that fails on odd input (a `\\sqrt` at the very end, two "\\text{ " units) makes the
check fall back, as released, to comparing the raw strings.
"""
from __future__ import annotations

import re

from megaprm.tasks.latex import closing_brace


class _RuleFailed(ValueError):
    """A normalisation rule met input it cannot handle (the release's assert/IndexError)."""


# ----------------------------------------------------------------------------- boxed answers

def pure_boxed_answer(response: str) -> str | None:
    """PURE's last-boxed rule: `\\boxed <x>` (a space form: up to the next "$") wins when present
    anywhere; else the last `\\boxed{...}` (balanced); a `\\fbox{}` or an unclosed box gives None
    (released: its remove_boxed asserts a `\\boxed{` prefix, the exception scores 0)."""
    if "\\boxed " in response:
        return response.split("\\boxed ")[-1].split("$")[0]
    start = response.rfind("\\boxed")
    if start < 0:
        return None
    end = closing_brace(response, start)
    if end is None:
        return None
    boxed = response[start:end + 1]
    if not boxed.startswith("\\boxed{"):
        return None
    return boxed[len("\\boxed{"):-1]


# ----------------------------------------------------------------------------- MATH normalisation

def _frac_arguments(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{7}` -> `\\frac{1}{7}` (single-character arguments
    braced); a `\\frac` with fewer than two characters after it is left as the whole string."""
    head, *rest = s.split("\\frac")
    out = head
    for part in rest:
        out += "\\frac"
        if part.startswith("{"):
            out += part
            continue
        if len(part) < 2:
            if not part:
                raise _RuleFailed("\\frac at the end")
            return s
        a, b, tail = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + tail if b == "{" else "{" + b + "}" + tail)
    return out


def _slash_fraction(s: str, strict: bool = False) -> str:
    """"3/4" (two plain integers, nothing else) -> `\\frac{3}{4}`. strict (PURE's copy of the
    rule, which catches only its assert): a side that is not an integer at all fails the rule."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    if strict:
        try:
            int(parts[0]), int(parts[1])
        except ValueError:
            raise _RuleFailed("a non-integer side of a/b") from None
    if re.fullmatch(r"-?\d+", parts[0]) and re.fullmatch(r"-?\d+", parts[1]) \
            and s == f"{int(parts[0])}/{int(parts[1])}":
        return f"\\frac{{{int(parts[0])}}}{{{int(parts[1])}}}"
    return s


def _sqrt_arguments(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}` (a single-character argument braced)."""
    head, *rest = s.split("\\sqrt")
    out = head
    for part in rest:
        if not part:
            raise _RuleFailed("\\sqrt at the end")
        out += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return out


def math_normalize(s: str, strict_slash: bool = False) -> str:
    """The MATH dataset's answer normalisation (rules in this order): drop newlines, `\\!`,
    doubled backslashes, t/dfrac -> frac, `\\left`/`\\right`, degree marks, `\\$`, a unit after
    "\\text{ ", `\\%`; " ." -> " 0.", a leading "." -> "0."; "k = v" with a short left side ->
    "v"; `\\sqrt3` -> `\\sqrt{3}`; remove spaces; brace `\\frac` arguments; "0.5" -> 1/2 as
    `\\frac{1}{2}`; "a/b" of integers -> `\\frac{a}{b}` (`strict_slash`: PURE's copy, where
    "x/y" raises). Raises _RuleFailed where released code raised."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise _RuleFailed("more than one unit")
        s = parts[0]
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _sqrt_arguments(s)
    s = s.replace(" ", "")
    s = _frac_arguments(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_fraction(s, strict_slash)


def strings_equal_after_math_normalize(answer: str, truth: str) -> bool:
    """PURE's is_equiv: normalised strings equal (or equal to the truth without its commas:
    45,000 = 45000); raw equality where a rule fails."""
    try:
        a, t = math_normalize(answer, True), math_normalize(truth, True)
    except _RuleFailed:
        return answer == truth
    return a == t or a == t.replace(",", "")


def hendrycks_math_equal(response: str, truth: str) -> bool:
    """PURE's outcome check: the last boxed answer (`pure_boxed_answer`) equals `truth` after
    the MATH normalisation. No box: wrong."""
    answer = pure_boxed_answer(response)
    return answer is not None and strings_equal_after_math_normalize(answer, truth)


# ----------------------------------------------------------------------------- PRIME's extraction

_AFTER_MARKERS = ("answer:", "answer is", "answers are")
_BEFORE_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_TAIL_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n",
                 "get\n")


def _prime_boxed(text: str) -> str | None:
    """Content of the last `\\boxed` (else `\\fbox`): from its first "{" to the matching "}",
    stripped; None when there is none or it is unclosed."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    left = text.find("{", start)
    if left < 0:
        return None
    end = closing_brace(text, start)  # counted from the marker, as released
    return None if end is None else text[left + 1:end].strip()


def prime_extract_answer(response: str) -> tuple[bool, str]:
    """(matched, answer text) by PRIME's rules, each applied to what the previous left:
    1. after the last "answer:" / "answer is" / "answers are" (case-insensitive, each marker in
       turn); 2. before the last "is answer" / "is the answer" / ...; 3. the last boxed content,
       when non-empty; 4. before the last ". "; 5. after the last "be ", "is ", "=", ": ",
       "get " (and their newline forms), each in turn. `matched` (a marker or box was found)
       is False when the answer holds no digit."""
    matched = False
    out = response
    for marker in _AFTER_MARKERS:
        i = out.lower().rfind(marker)
        if i != -1:
            matched, out = True, out[i + len(marker):].strip()
    for marker in _BEFORE_MARKERS:
        i = out.lower().rfind(marker)
        if i != -1:
            matched, out = True, out[:i].strip()
    boxed = _prime_boxed(out)
    if boxed:
        matched, out = True, boxed
    if ". " in out:
        out = out[:out.rfind(". ")].strip()
    for marker in _TAIL_MARKERS:
        i = out.lower().rfind(marker)
        if i != -1:
            matched, out = True, out[i + len(marker):].strip()
    return matched and any(c.isdigit() for c in out), out
