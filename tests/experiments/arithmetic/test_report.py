"""README's comparison tables and docs/compare.md's tables are generated from the committed
compare.json of each task (docs/compare/compare.json: the short task; docs/compare/long/: the
long one; `megaprm compare --from-json ... --write-readme`): the committed blocks must be
exactly what the generator makes from them."""
import json
from pathlib import Path

import pytest

from megaprm.experiments.arithmetic import report
from megaprm.experiments.readme import read_block

ROOT = Path(__file__).resolve().parents[3]
# the live reports; docs/compare/one-start-2026-11-25/ keeps the one-start pass of that date
# (RLOO, Blend, PRIME's variants) and docs/compare/long/1000x4/ the long task's first pass (the
# PRIME ablations' reference) as they were published, their tables no longer in README
ARCHIVED = ("one-start-2026-11-25", "1000x4")
REPORTS = sorted(p for p in (ROOT / "docs" / "compare").glob("**/compare.json")
                 if not set(ARCHIVED) & set(p.parts))


def _report(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_both_tasks_have_a_committed_report():
    names = sorted(report.block_name(_report(p)) for p in REPORTS)
    assert names == ["compare", "compare-long"], names  # one live report per task


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_block_is_generated_from_the_committed_json(path):
    rep = _report(path)
    want = report.readme_table(rep).strip("\n")
    assert read_block(str(ROOT / "README.md"), report.block_name(rep)) == want, (
        f"README's {report.block_name(rep)} block is stale: run `.venv/bin/megaprm compare "
        f"--from-json {path.relative_to(ROOT)} --write-readme`")


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_block_is_generated_from_the_committed_json(path):
    rep = _report(path)
    want = report.markdown(rep, title=False).strip("\n")
    assert read_block(str(ROOT / "docs" / "compare.md"), report.block_name(rep)) == want


def test_the_before_rl_row_is_the_mean_of_the_starts_as_the_rows_are():
    """The rows are means over starts, so the warm-up row is too (each evaluation path averaged
    over the starts' own baselines), and a row's cell count names its starts; with one start
    both read as before (start 0's warm-up, the bare count)."""
    def base(acc, wrong):
        return {"greedy": {"accuracy": acc, "correct_with_wrong_step": wrong,
                           "all_steps_correct": acc / 2},
                "sampled": {"accuracy": acc / 4, "correct_with_wrong_step": wrong}}

    rep = {"baseline": base(0.2, 0.5),
           "starts": [{"start": 0, "baseline": base(0.2, 0.5)},
                      {"start": 1, "baseline": base(0.1, 0.7)},
                      {"start": 2, "baseline": base(0.9, 0.0)}]}
    label, b = report.warmup_row(rep)
    assert label == "; mean of 3 starts"
    assert b["greedy"]["accuracy"] == pytest.approx(0.4)
    assert b["greedy"]["correct_with_wrong_step"] == pytest.approx(0.4)
    assert b["sampled"]["accuracy"] == pytest.approx(0.1)
    one = {"baseline": base(0.2, 0.5), "starts": [{"start": 0, "baseline": base(0.2, 0.5)}]}
    assert report.warmup_row(one) == ("", one["baseline"])
    assert report._seeds_cell({"seeds": [0, 1, 0], "starts": [0, 0, 1]}) == "3 (2 starts)"
    assert report._seeds_cell({"seeds": [0, 1], "starts": [0, 0]}) == "2"
