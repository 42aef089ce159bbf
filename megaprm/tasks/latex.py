"""Brace matching in LaTeX answers: the `\\boxed{...}` a solution ends with. The datasets read a
row's answer from its solution with it; the reward rules (rewards/answer_rules.py) match braces
with the same function."""
from __future__ import annotations


def closing_brace(text: str, start: int) -> int | None:
    """Index of the brace closing the first "{" at or after `start` (None if unclosed)."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    j = closing_brace(text, i)
    return None if j is None else text[i + 1 : j]
