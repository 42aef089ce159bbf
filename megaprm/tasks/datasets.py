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

A reference solution (`PromptRecord.reference`, for a generative judge: PAPO's grader) and the
problem statement it is shown (`PromptRecord.question`): a release-format row (chat messages) is
read as PAPO's released grader reads it (llm_proof_grading.py:171-173), from
`extra_info.reference_solution` only (none: graded 0) and `extra_info.question` /
`extra_info.problem`, else "" (an empty problem); a plain question row as the release's
preprocessing would have filled them (convert_numina_math.py:44-63): a `reference_solution` or
`solution` column, and the question itself (`question` None: the prompt).

What the policy is given is built from a record by `policy_prompt` (`data.prompt_format`,
`data.prompt_template`, `data.system_prompt`): the question through the recipe's instruction
template, as is (PURE, PAPO) or in the tokenizer's chat template with the recipe's system
message (PRIME, PROF-GRPO). A row that carries chat messages must be the recipe's layout (the
release's preprocessing output); its question is read back from it, so a plain question row and
a release-format row give the same prompt, and any other row is a bad row ("layout").

A row that cannot be read is skipped, counted by reason and reported (`LoadReport`: file,
1-based line or row number, reason; `LoadReport.text()` is the printable report with the first
examples), or with `on_bad_row="error"` stops the load with a DataError naming the row.
Invalid UTF-8 is always an error naming the file and byte offset (never silently replaced).
A row without an answer is skipped, or kept with answer "" (`keep_unanswered=True`: PURE
trains on such prompts with verifiable reward 0). `max_prompt_tokens` (with a tokenizer)
truncates, drops or refuses prompts longer than that, counted on the rendered prompt
(`long_prompt`). A row over `MAX_ROW_BYTES` (1 MiB)
is a bad row before it is decoded, parsed or tokenised. A missing file raises
FileNotFoundError naming the path; a directory or a .json file holding one JSON array is a
DataError saying what to pass instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from megaprm.tasks.latex import last_boxed

BENCHMARKS = ("math500", "aime24", "amc23", "minerva_math", "olympiadbench")
# eval/data/ sits next to the megaprm package (repo checkout or installed, see setup.py)
EVAL_DATA_DIR = Path(__file__).resolve().parents[2] / "eval" / "data"

_PROMPT_FIELDS = ("prompt", "problem", "question")
ON_BAD_ROW = ("skip", "error")
LONG_PROMPT = ("truncate", "drop", "error")
_EXAMPLES = 3


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    answer: str  # ground truth as text; "" only for rows kept with keep_unanswered=True
    data_source: str
    index: int
    meta: dict = field(default_factory=dict, compare=False)
    reference: Optional[str] = None  # reference solution text (module docstring), or None
    question: Optional[str] = None   # problem statement for a judge; None: the prompt
    text: Optional[str] = None       # the rendered policy prompt (load_prompts' `render`)


PROMPT_FORMATS = ("raw", "chat", "first_message")


class LayoutError(ValueError):
    """A row whose chat messages are not the recipe's prompt layout (a bad row, named)."""


def _template_parts(template: str) -> tuple[str, str]:
    """The text `template` puts before and after the question (doubled braces undone)."""
    parts = template.split("{question}")
    if len(parts) != 2:
        raise LayoutError("data.prompt_template holds {question} more than once, so a row's "
                          "messages cannot be read back to a question; give plain questions")
    unescape = lambda t: t.replace("{{", "{").replace("}}", "}")  # noqa: E731
    return unescape(parts[0]), unescape(parts[1])


def question_of_messages(messages: list, *, fmt: str = "raw", template: str = "{question}",
                         system: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(question, the row's system message or None) of a release-format row: its messages are
    what the recipe builds from a plain question, [system_prompt (chat), user:
    template(question)]. Raises LayoutError saying what differs, so such a row is refused or
    reported by name instead of being prompted differently.

    The row's own system message is accepted where the recipe sets none (prompt_format chat
    keeps it; raw and first_message have no place for one, so it is refused there)."""
    msgs = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
    row_system = msgs.pop(0)["content"] if msgs and msgs[0]["role"] == "system" else None
    roles = [m["role"] for m in msgs]
    if roles != ["user"]:
        raise LayoutError(f"messages with roles {(['system'] if row_system is not None else []) + roles}"
                          "; a prompt row holds an optional system message and one user message")
    if system is not None and row_system != system:
        what = "no system message" if row_system is None else "another system message"
        raise LayoutError(f"{what} (data.system_prompt is {system[:40]!r}...); give the "
                          "plain question, or the release's messages")
    if row_system is not None and system is None and fmt != "chat":
        raise LayoutError(f"a system message, which data.prompt_format={fmt} has no place for")
    user = msgs[0]["content"]
    head, tail = _template_parts(template)
    if not (isinstance(user, str) and len(user) >= len(head) + len(tail)
            and user.startswith(head) and user.endswith(tail)):
        raise LayoutError("its user message is not data.prompt_template around a question "
                          f"(expected {head[:30]!r}...{{question}}...{tail[-40:]!r}); give the "
                          "plain question, or convert the file with `megaprm data`")
    return user[len(head):len(user) - len(tail)], row_system


def policy_prompt(question: str, messages: Optional[list] = None, *, fmt: str = "raw",
                  template: str = "{question}", system: Optional[str] = None,
                  tokenizer=None) -> str:
    """The policy's prompt text for one row (encoded without special tokens, as verl's
    tokenize_and_postprocess_data and OpenRLHF's tokenizer call do).

    A plain question goes through `template` ("{question}" = as is; PURE's input_template,
    PROF-GRPO's and PRIME's instruction, PAPO's wrapper) into the user text. A row that carries
    chat messages (verl's parquet layout) must be that recipe's layout already
    (`question_of_messages`, LayoutError otherwise): its question is read back from it, so both
    kinds of row give the same prompt.

    fmt raw and first_message: the user text (first_message is PAPO's pass-through chat
    template, `{{ messages[0]["content"] }}`, over [user]); chat:
    `tokenizer.apply_chat_template([system, user], add_generation_prompt=True)`, the system
    message `system`, else the row's own, else none (the template's default system text
    applies, as released)."""
    if fmt not in PROMPT_FORMATS:
        raise ValueError(f"prompt format {fmt!r}: expected one of {PROMPT_FORMATS}")
    row_system = None
    if messages is not None:
        question, row_system = question_of_messages(messages, fmt=fmt, template=template,
                                                    system=system)
    user = template.format(question=question)
    if fmt != "chat":
        return user
    system = system if system is not None else row_system
    chat = ([] if system is None else [{"role": "system", "content": system}]) + \
        [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def _reference_of(row: dict, extra: dict, release_row: bool
                  ) -> tuple[Optional[str], Optional[str]]:
    """(reference solution, problem statement) for a generative judge (module docstring)."""
    def text(v):
        return v if isinstance(v, str) and v.strip() else None
    question = text(extra.get("question")) or text(extra.get("problem"))
    if release_row:
        return text(extra.get("reference_solution")), question or ""
    ref = (text(extra.get("reference_solution")) or text(row.get("reference_solution"))
           or text(row.get("solution")))
    return ref, question


class DataError(ValueError):
    """A prompt file the user must fix (encoding, a bad row under on_bad_row=error, a prompt
    over max_prompt_tokens under long_prompt=error); the message is one line."""


@dataclass
class LoadReport:
    path: str
    rows_read: int = 0
    loaded: int = 0
    skipped: list[tuple[str, int, str]] = field(default_factory=list)  # (path, line, reason)
    skip_kinds: Counter = field(default_factory=Counter)  # reason kind -> rows
    truncated: int = 0  # prompts cut to max_prompt_tokens
    unanswered: int = 0  # rows kept without an answer (keep_unanswered)
    examples: list[tuple[str, str]] = field(default_factory=list)  # first (prompt, answer)

    def skip(self, line: int, kind: str, why: str) -> None:
        self.skipped.append((self.path, line, why))
        self.skip_kinds[kind] += 1

    def summary(self) -> str:
        """One line: counts, then the first skipped rows."""
        head = f"{self.path}: loaded {self.loaded} of {self.rows_read} rows"
        extra = [f"{n} {what}" for n, what in ((self.truncated, "truncated"),
                                              (self.unanswered, "kept without an answer")) if n]
        if extra:
            head += f" ({', '.join(extra)})"
        if not self.skipped:
            return head
        kinds = ", ".join(f"{k} {n}" for k, n in self.skip_kinds.most_common())
        shown = "; ".join(f"line {line}: {why}" for _, line, why in self.skipped[:5])
        more = f" (+{len(self.skipped) - 5} more)" if len(self.skipped) > 5 else ""
        return f"{head}, skipped {len(self.skipped)} [{kinds}]: {shown}{more}"

    def text(self) -> str:
        """The printable report: the summary and the first examples used."""
        lines = [f"[megaprm] data: {self.summary()}"]
        for prompt, answer in self.examples:
            p = " ".join(prompt.split())
            p = p if len(p) <= 70 else p[:67] + "..."
            lines.append(f"[megaprm]   e.g. {p!r} -> {answer!r}")
        return "\n".join(lines)


class _BadRow(ValueError):
    def __init__(self, why: str, kind: str = "bad field"):
        super().__init__(why)
        self.kind = kind


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
        raise _BadRow(f"no prompt field (expected one of {_PROMPT_FIELDS})", "no prompt")
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
    raise _BadRow("no answer (expected reward_model.ground_truth, answer, final_answer or a "
                  "\\boxed{} in solution)", "no answer")


def _record(row: Any, default_source: str, position: int,
            keep_unanswered: bool = False) -> PromptRecord:
    if not isinstance(row, dict):
        raise _BadRow(f"row is a {type(row).__name__}, not an object", "not an object")
    prompt, meta = _prompt_of(row)
    try:
        answer, answer_field = _answer_of(row)
    except _BadRow as e:
        if not (keep_unanswered and e.kind == "no answer"):
            raise
        answer, answer_field = "", "answer"
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    index = extra.get("index", position)
    try:
        index = int(index)
    except (TypeError, ValueError):
        index = position
    used = {"prompt", "problem", "question", "context", "reward_model", answer_field}
    meta.update({k: v for k, v in row.items() if k not in used})
    source = row.get("data_source")
    reference, question = _reference_of(row, extra, release_row="messages" in meta)
    return PromptRecord(
        prompt=prompt,
        answer=answer,
        data_source=source if isinstance(source, str) and source else default_source,
        index=index,
        meta=meta,
        reference=reference,
        question=question,
    )


# A row (a JSONL line, a parquet row's prompt) over this many bytes is a bad row: no prompt
# needs it (1 MiB is ~250k tokens), and tokenising one costs ~350x its size in memory (a 60 MB
# line took a rank to 21 GB).
MAX_ROW_BYTES = 1 << 20


def _too_big(n: int) -> _BadRow:
    return _BadRow(f"row is {n / 2**20:.1f} MiB > {MAX_ROW_BYTES >> 20} MiB (MAX_ROW_BYTES); no "
                   "prompt needs that", "too big")


def _rows_jsonl(path: Path, report: LoadReport):
    offset = 0
    with path.open("rb") as fh:
        first = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        if first.startswith(b"["):
            raise DataError(f"{path} holds a JSON array; prompt files are JSON Lines, one object "
                            f"per line (convert it into a new file, never onto itself: "
                            f"jq -c '.[]' {path.name} > {path.stem}.lines.jsonl, then pass "
                            "that as data.path)")
        fh.seek(0)
        for line_no, raw in enumerate(fh, start=1):
            start, offset = offset, offset + len(raw)
            if len(raw) > MAX_ROW_BYTES:  # before decoding, parsing or tokenising it
                report.rows_read += 1
                yield line_no, _too_big(len(raw))
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: invalid UTF-8 at byte offset {start + exc.start} (line {line_no}); "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if line_no == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 byte order mark
            if not line.strip():
                continue
            report.rows_read += 1
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                yield line_no, _BadRow(f"bad JSON: {exc.msg} at column {exc.colno}", "bad JSON")


def _rows_parquet(path: Path, report: LoadReport):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - arrow's errors vary; name the file
        raise DataError(f"{path}: cannot read the parquet file ({exc})") from None
    for row_no, row in enumerate(table.to_pylist(), start=1):
        report.rows_read += 1
        try:
            prompt = _prompt_of(row)[0] if isinstance(row, dict) else ""
        except _BadRow:
            prompt = ""
        n = len(prompt.encode("utf-8", "replace"))
        yield row_no, (_too_big(n) if n > MAX_ROW_BYTES else row)


def _over_limit(prompt: str, tokenizer, max_tokens: int) -> Optional[tuple[str, str]]:
    """None when `prompt` fits in max_tokens tokens, else (its first max_tokens tokens as text,
    how many tokens it has). A huge prompt is never tokenized whole: a prefix that already
    exceeds the limit decides (the 10 MB prompt costs a prefix's tokenization)."""
    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    probe = max_tokens * 16 + 256  # chars
    ids, exact = encode(prompt[:probe]), len(prompt) <= probe
    if len(ids) <= max_tokens and not exact:
        ids, exact = encode(prompt), True
    if len(ids) <= max_tokens:
        return None
    return tokenizer.decode(ids[:max_tokens]), (f"{len(ids)} tokens" if exact
                                                else f"over {len(ids)} tokens")


def load_prompts(
    path: str | Path, data_source: str | None = None, limit: int | None = None, *,
    on_bad_row: str = "skip", keep_unanswered: bool = False,
    max_prompt_tokens: Optional[int] = None, long_prompt: str = "error", tokenizer=None,
    log: Optional[Callable[[str], None]] = None,
    render: Optional[Callable[[PromptRecord], str]] = None,
) -> tuple[list[PromptRecord], LoadReport]:
    """Read a .parquet, .jsonl or .json(l) prompt file. `data_source` is used for rows that do
    not name one (default: the parent folder's name). Returns the records and a LoadReport.

    on_bad_row: "skip" (count and report) or "error" (DataError naming file, line, reason).
    keep_unanswered: keep rows without an answer, with answer "" (verifiable reward 0).
    render: record -> the policy's prompt text (`PromptRecord.text`; the trainer's
    `policy_prompt`); a row it refuses (LayoutError) is a bad row of kind "layout".
    max_prompt_tokens (needs `tokenizer`, an HF tokenizer): counted on the rendered prompt's
    ids (chat template included, no special tokens added: what the engine is given, and what
    the releases' filters count), else on the question; longer prompts are cut to that many
    tokens (long_prompt="truncate"), skipped ("drop"), or refused ("error"). log: called once
    with `LoadReport.text()`.
    """
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row={on_bad_row!r}: expected one of {ON_BAD_ROW}")
    if long_prompt not in LONG_PROMPT:
        raise ValueError(f"long_prompt={long_prompt!r}: expected one of {LONG_PROMPT}")
    if max_prompt_tokens is not None and (max_prompt_tokens <= 0 or tokenizer is None):
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens!r}: must be a positive token "
                         "count and needs the model's tokenizer")
    path = Path(path)
    if path.is_dir():
        raise DataError(f"prompt file {path} is a directory; pass a .parquet or .jsonl file")
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
            if isinstance(row, _BadRow):
                raise row
            rec = _record(row, source, position=line_no - 1, keep_unanswered=keep_unanswered)
            if render is not None:
                try:
                    rec = dataclasses.replace(rec, text=render(rec))
                except LayoutError as exc:
                    raise _BadRow(f"not this recipe's prompt layout: {exc}", "layout") from None
            if max_prompt_tokens is not None:
                counted = rec.prompt if rec.text is None else rec.text
                over = _over_limit(counted, tokenizer, max_prompt_tokens)
                if over is not None:
                    prompt, many = over
                    if long_prompt == "error":
                        raise DataError(
                            f"{path} line {line_no}: the prompt has {many} > max_prompt_tokens="
                            f"{max_prompt_tokens}; raise the limit or set long_prompt to "
                            "truncate or drop")
                    if long_prompt == "drop":
                        raise _BadRow(f"prompt has {many} > max_prompt_tokens="
                                      f"{max_prompt_tokens}", "too long")
                    rec = dataclasses.replace(rec, **{"prompt" if rec.text is None else
                                                      "text": prompt})
                    report.truncated += 1
        except _BadRow as exc:
            if on_bad_row == "error":
                raise DataError(f"{path} line {line_no}: {exc}; fix the row or set on_bad_row to "
                                "skip") from None
            report.skip(line_no, exc.kind, str(exc))
            continue
        report.unanswered += rec.answer == ""
        if len(report.examples) < _EXAMPLES:
            report.examples.append((rec.prompt, rec.answer))
        records.append(rec)
    report.loaded = len(records)
    if log is not None:
        log(report.text())
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
