"""README's comparison table and docs/compare.md's tables are generated from the committed
docs/compare/compare.json (`megaprm compare --from-json ... --write-readme`): the committed
blocks must be exactly what the generator makes from it."""
import json
from pathlib import Path

from megaprm.experiments.arithmetic import report
from megaprm.experiments.readme import read_block

ROOT = Path(__file__).resolve().parents[3]


def _report():
    with open(ROOT / "docs" / "compare" / "compare.json", encoding="utf-8") as f:
        return json.load(f)


def test_readme_block_is_generated_from_the_committed_json():
    want = report.readme_table(_report()).strip("\n")
    assert read_block(str(ROOT / "README.md"), "compare") == want, (
        "README's compare block is stale: run `.venv/bin/megaprm compare --from-json "
        "docs/compare/compare.json --write-readme`")


def test_doc_block_is_generated_from_the_committed_json():
    want = report.markdown(_report(), title=False).strip("\n")
    assert read_block(str(ROOT / "docs" / "compare.md"), "compare") == want
