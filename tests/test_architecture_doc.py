"""docs/architecture.md is the map of the code as it is: every path it names exists, its layer
table is the one tests/test_layering.py enforces, and every section a source file cites
(`docs/architecture.md "Section"`) is a heading there."""
import os
import re

from tests.test_layering import LAYERS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "architecture.md")


def _doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def test_every_path_named_exists():
    paths = set(re.findall(r"`((?:megaprm|checkpoint_tools|eval|tests)/[\w/.]*)`", _doc()))
    assert len(paths) > 20, paths
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_layer_table_is_the_enforced_one():
    rows = re.findall(r"^\| (-?\d+) \| (.+) \|$", _doc(), re.M)
    doc = {name: int(layer) for layer, names in rows for name in re.findall(r"`([\w.]+)`", names)}
    assert doc == LAYERS


def test_every_cited_section_is_there():
    headings = set(re.findall(r"^## (.+)$", _doc(), re.M))
    cited, bad = 0, []
    for pkg in ("megaprm", "checkpoint_tools", "eval"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                text = open(os.path.join(dirpath, f), encoding="utf-8").read()
                assert "ARCHITECTURE.md" not in text, f"{f} cites a page not in the repository"
                for section in re.findall(r'docs/architecture\.md "([^"]+)"', text):
                    cited += 1
                    if section not in headings:
                        bad.append((f, section))
    assert cited >= 4 and not bad, bad
