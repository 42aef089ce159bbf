"""BENCHMARKS.md is a reference, not a notebook: it opens with the table of current figures, its
headings name benchmarks (never a work item, a pass or a rerun), and scripts/results/ holds one
file per benchmark and device, each one named by BENCHMARKS.md and none named after a pass."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
RESULTS = ROOT / "scripts" / "results"


def _table(text: str) -> list[list[str]]:
    """The first markdown table of `text`, as rows of cells (header first)."""
    rows, started = [], False
    for line in text.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in re.sub(r"`[^`]*`", lambda m: m.group(0).replace("|", "/"),
                                              line).strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif started:
            break
    return rows


def test_the_first_table_holds_every_column_and_opens_the_doc():
    first_heading = re.findall(r"(?m)^## (.+)$", DOC)[0]
    assert first_heading == "Current figures"
    header, *rows = _table(DOC)
    for column in ("benchmark", "figure", "baseline", "ratio", "date", "commit", "machine", "JSON",
                   "command"):
        assert any(column.lower() in h.lower() for h in header), column
    assert len(rows) >= 10 and all(len(r) == len(header) for r in rows)


def test_no_heading_names_an_issue_a_pass_or_a_rerun():
    bad = [h for h in re.findall(r"(?m)^#+ .*$", DOC)
           if re.search(r"\b(issue|pass|passes|rerun|re-run)\b|#\d", h, re.IGNORECASE)]
    assert not bad, bad


def test_results_are_one_file_per_benchmark_each_named_by_the_doc():
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file())
    assert files
    assert not [f for f in files if re.search(r"pass\d|partial|_head\b|crosscheck", f)], files
    unnamed = [f for f in files if f.endswith(".json") and f not in DOC]
    assert not unnamed, f"result files BENCHMARKS.md does not name: {unnamed}"
    # every result file the table names exists
    header, *rows = _table(DOC)
    col = next(i for i, h in enumerate(header) if "JSON" in h)
    named = {n for r in rows for n in re.findall(r"`([\w.]+\.json)`", r[col])}
    assert named and not [n for n in named if not (RESULTS / n).is_file()], named
    # a plot for every benchmark JSON that the plotter reads
    for f in files:
        if f.startswith("bench_") and f.endswith(".json"):
            assert f[:-5] + ".png" in files, f
