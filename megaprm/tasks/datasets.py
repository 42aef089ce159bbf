"""Prompt sets from parquet / JSONL into one record type, `PromptRecord`.

Accepted row layouts (the first that matches wins):

* verl's RL parquet layout: `prompt` is a list of chat messages `[{role, content}, ...]` or a
  string, the answer is `reward_model.ground_truth`, plus `data_source` and optionally
  `extra_info.index`. For chat prompts, `PromptRecord.prompt` is the content of the last user
  message and the full message list is kept in `meta["messages"]`.
* the math eval sets shipped in `eval/data/` (provenance in its README): the question is in
  `problem`, `question` or `prompt` (OlympiadBench's `context`, when present, is prepended);
  the answer is in `answer` (AMC: a float, written "27" for 27.0), `final_answer` (a list,
  joined with ", "), or the last `\\boxed{...}` of `solution` (Minerva).

A row that cannot be read is skipped, counted and reported (`LoadReport.skipped`, with file,
1-based line or row number, and the reason); it never stops the load. A missing file raises
FileNotFoundError naming the path.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCHMARKS = ("math500", "aime24", "amc23", "minerva_math", "olympiadbench")
# eval/data/ sits next to the megaprm package (repo checkout or installed, see setup.py)
EVAL_DATA_DIR = Path(__file__).resolve().parents[2] / "eval" / "data"

_PROMPT_FIELDS = ("prompt", "problem", "question")


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    answer: str  # ground truth as text; "" never occurs (such rows are skipped)
    data_source: str
    index: int
    meta: dict = field(default_factory=dict, compare=False)


@dataclass
class LoadReport:
    path: str
    rows_read: int = 0
    loaded: int = 0
    skipped: list[tuple[str, int, str]] = field(default_factory=list)  # (path, line, reason)

    def summary(self) -> str:
        head = f"{self.path}: loaded {self.loaded} of {self.rows_read} rows"
        if not self.skipped:
            return head
        shown = "; ".join(f"line {line}: {why}" for _, line, why in self.skipped[:5])
        more = f" (+{len(self.skipped) - 5} more)" if len(self.skipped) > 5 else ""
        return f"{head}, skipped {len(self.skipped)}: {shown}{more}"


class _BadRow(ValueError):
    pass


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _answer_text(value: Any, name: str) -> str:
    if isinstance(value, bool):
        raise _BadRow(f"field {name!r} is a bool")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _BadRow(f"field {name!r} is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow(f"field {name!r} is empty")
        return value.strip()
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray":
        parts = [_answer_text(v, name) for v in list(value)]
        if not parts:
            raise _BadRow(f"field {name!r} is an empty list")
        return ", ".join(parts)
    raise _BadRow(f"field {name!r} has type {type(value).__name__}")


def _prompt_of(row: dict) -> tuple[str, dict]:
    name = next((f for f in _PROMPT_FIELDS if row.get(f) is not None), None)
    if name is None:
        raise _BadRow(f"no prompt field (expected one of {_PROMPT_FIELDS})")
    value = row[name]
    if isinstance(value, str):
        if not value.strip():
            raise _BadRow(f"field {name!r} is empty")
        context = row.get("context")
        if isinstance(context, str) and context.strip() and context != "None":
            return f"{context.strip()}\n\n{value}", {}
        return value, {}
    messages = list(value) if isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray" else None
    if not messages or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise _BadRow(f"field {name!r} is neither a string nor a list of {{role, content}} messages")
    users = [m for m in messages if m.get("role") == "user"]
    content = (users or messages)[-1]["content"]
    if not isinstance(content, str) or not content.strip():
        raise _BadRow(f"field {name!r}: the last user message has no text")
    return content, {"messages": [dict(m) for m in messages]}


def _answer_of(row: dict) -> tuple[str, str]:
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return _answer_text(reward_model["ground_truth"], "reward_model.ground_truth"), "reward_model"
    for name in ("answer", "final_answer"):
        if row.get(name) is not None:
            return _answer_text(row[name], name), name
    solution = row.get("solution")
    if isinstance(solution, str):
        boxed = last_boxed(solution)
        if boxed is not None and boxed.strip():
            return boxed.strip(), "solution"
    raise _BadRow("no answer (expected reward_model.ground_truth, answer, final_answer or a \\boxed{} in solution)")


def _record(row: Any, default_source: str, position: int) -> PromptRecord:
    if not isinstance(row, dict):
        raise _BadRow(f"row is a {type(row).__name__}, not an object")
    prompt, meta = _prompt_of(row)
    answer, answer_field = _answer_of(row)
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    index = extra.get("index", position)
    try:
        index = int(index)
    except (TypeError, ValueError):
        index = position
    used = {"prompt", "problem", "question", "context", "reward_model", answer_field}
    meta.update({k: v for k, v in row.items() if k not in used})
    source = row.get("data_source")
    return PromptRecord(
        prompt=prompt,
        answer=answer,
        data_source=source if isinstance(source, str) and source else default_source,
        index=index,
        meta=meta,
    )


def _rows_jsonl(path: Path, report: LoadReport):
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            report.rows_read += 1
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                report.skipped.append((str(path), line_no, f"bad JSON: {exc.msg} at column {exc.colno}"))


def _rows_parquet(path: Path, report: LoadReport):
    import pyarrow.parquet as pq

    for row_no, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        report.rows_read += 1
        yield row_no, row


def load_prompts(
    path: str | Path, data_source: str | None = None, limit: int | None = None
) -> tuple[list[PromptRecord], LoadReport]:
    """Read a .parquet, .jsonl or .json(l) prompt file. `data_source` is used for rows that do
    not name one (default: the parent folder's name). Returns the records and a LoadReport."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt file {path} does not exist; pass the path of a .parquet or .jsonl file "
            "(verl layout or problem/answer fields), or use load_benchmark(name) for the shipped sets"
        )
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise ValueError(f"prompt file {path}: unknown extension {path.suffix!r}; expected .parquet or .jsonl")
    report = LoadReport(str(path))
    rows = _rows_parquet(path, report) if path.suffix == ".parquet" else _rows_jsonl(path, report)
    source = data_source or path.parent.name
    records: list[PromptRecord] = []
    for line_no, row in rows:
        if limit is not None and len(records) >= limit:
            break
        try:
            records.append(_record(row, source, position=line_no - 1))
        except _BadRow as exc:
            report.skipped.append((str(path), line_no, str(exc)))
    report.loaded = len(records)
    return records, report


def load_benchmark(
    name: str, limit: int | None = None, data_dir: str | Path | None = None
) -> tuple[list[PromptRecord], LoadReport]:
    """One of BENCHMARKS from `eval/data/<name>/test.jsonl` (offline copies; see its README)."""
    if name not in BENCHMARKS:
        raise ValueError(f"load_benchmark: name={name!r}; valid names are {BENCHMARKS}")
    path = Path(data_dir or EVAL_DATA_DIR) / name / "test.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark file {path} is missing; the eval sets ship in eval/data/ of the megaprm "
            "repository (reinstall or re-checkout it), or pass data_dir= to a folder with <name>/test.jsonl"
        )
    return load_prompts(path, data_source=name, limit=limit)
