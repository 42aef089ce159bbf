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
REPORTS = sorted((ROOT / "docs" / "compare").glob("**/compare.json"))


def _report(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_both_tasks_have_a_committed_report():
    names = {report.block_name(_report(p)) for p in REPORTS}
    assert names >= {"compare"}, names


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
