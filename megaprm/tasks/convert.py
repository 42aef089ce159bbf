"""`megaprm data`: a prompt file of plain questions (JSONL or parquet; the layouts
`tasks.datasets` reads) written out in one paper's released row layout, with the recipe's
prompt settings (`data.prompt_template`, `data.system_prompt`) put where the release's
preprocessing puts them:

* prime: PRIME's training/scripts/data_prepare.py rows: `prompt` = [system, user: question +
  instruction], `ability`, `reward_model` {style rule, ground_truth}, `extra_info` {split,
  index} (the release writes index 0 for every row; the row's own index here);
* prof_grpo: PROF-GRPO's data_preprocess/numina_math.py rows (the same shape: [system, user]);
* papo: PAPO's data/convert_numina_math.py --process_reward rows: `prompt` = [user: the
  wrapped question], `reward_model` {ground_truth, style llm_process}, `extra_info` {question,
  reference_solution} (the grader's inputs; the release grades a row without a reference 0);
* pure: PURE's JSON rows {question, answer} (its input_template is applied when it loads them).

A release-format row in the input is read back to its question first, so converting twice
gives the same file; a row of neither layout is skipped and reported, as `megaprm train` does.
The output is written to a temporary file next to it and renamed into place: an existing file
is never overwritten without `force`, and never the input file itself.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from megaprm.tasks.datasets import DataError, LoadReport, PromptRecord, load_prompts, \
    question_of_messages

LAYOUTS = ("prime", "prof_grpo", "papo", "pure")


def _question(rec: PromptRecord, data) -> str:
    messages = rec.meta.get("messages")
    if messages is None:
        return rec.prompt
    return question_of_messages(messages, fmt=data.prompt_format, template=data.prompt_template,
                                system=data.system_prompt)[0]


def release_row(layout: str, rec: PromptRecord, data) -> dict:
    """One row of `layout` for record `rec` (its question in `rec.text`), under the recipe's
    `data` settings."""
    question = rec.text
    user = data.prompt_template.format(question=question)
    messages = ([] if data.system_prompt is None else
                [{"role": "system", "content": data.system_prompt}]) + \
        [{"role": "user", "content": user}]
    if layout == "pure":
        return {"question": question, **({"answer": rec.answer} if rec.answer else {})}
    if layout == "papo":
        return {"data_source": "numina_math_process", "prompt": messages,
                "reward_model": {"ground_truth": rec.answer, "style": "llm_process"},
                "extra_info": {"question": rec.question or question,
                               "reference_solution": rec.reference or ""}}
    return {"data_source": rec.data_source, "prompt": messages, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": rec.answer},
            "extra_info": {"split": "train", "index": rec.index}}


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if dst.suffix not in (".jsonl", ".parquet"):
        raise DataError(f"--out {dst}: the extension names the format; use .jsonl or .parquet")
    if src.exists() and dst.exists() and os.path.samefile(src, dst):
        raise DataError(f"--out {dst} is the input file; write the converted rows to a new file")
    if dst.is_dir():
        raise DataError(f"--out {dst} is a directory; pass a .jsonl or .parquet file path")
    if dst.exists() and not force:
        raise DataError(f"--out {dst} exists; pass --force to replace it, or another path")


def _write(rows: list, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    os.close(fd)
    try:
        if dst.suffix == ".parquet":
            import pyarrow as pa  # deferred: pyarrow only for parquet output
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def convert(src: str | Path, dst: str | Path, layout: str, data, *, force: bool = False,
            log=None) -> tuple[list, LoadReport]:
    """Read `src`, write its rows in `layout` to `dst` (module docstring); `data` is the
    recipe's DataConfig. Returns (the rows written, the load report). Raises DataError
    (nothing written) when no row is usable or a path is refused."""
    if layout not in LAYOUTS:
        raise DataError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst, force)
    records, report = load_prompts(src, keep_unanswered=layout == "pure", log=log,
                                   render=lambda rec: _question(rec, data))
    if not records:
        raise DataError(f"{src}: no usable rows ({report.summary()}); nothing written")
    rows = [release_row(layout, r, data) for r in records]
    _write(rows, dst)
    return rows, report
