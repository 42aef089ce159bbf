"""Generated sections of README.md (and docs/): a command writes its own results between markers.

A block is delimited by ``<!-- megaprm:NAME begin -->`` and ``<!-- megaprm:NAME end -->`` on lines of
their own; ``replace_block`` rewrites what lies between them and nothing else, so the numbers a
reader sees are the ones the command printed and cannot drift from it.
"""
from __future__ import annotations

import os


class BlockMissing(ValueError):
    """The file has no (or an unbalanced) pair of markers for the block."""


def markers(name: str) -> tuple:
    return f"<!-- megaprm:{name} begin -->", f"<!-- megaprm:{name} end -->"


def read_block(path: str, name: str) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    begin, end = markers(name)
    lo, hi = text.find(begin), text.find(end)
    if lo < 0 or hi < lo or text.count(begin) != 1 or text.count(end) != 1:
        raise BlockMissing(f"{path}: no single '{begin}' ... '{end}' pair; add both markers on lines "
                           "of their own where the generated section belongs")
    return text[lo + len(begin):hi].strip("\n")


def replace_block(path: str, name: str, body: str) -> None:
    """Replace the block ``name`` in ``path`` with ``body`` (written atomically)."""
    read_block(path, name)  # validates the markers
    with open(path, encoding="utf-8") as f:
        text = f.read()
    begin, end = markers(name)
    lo, hi = text.index(begin) + len(begin), text.index(end)
    out = text[:lo] + "\n" + body.strip("\n") + "\n" + text[hi:]
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(out)
    os.replace(tmp, path)
