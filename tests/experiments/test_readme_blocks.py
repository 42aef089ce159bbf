import pytest

from megaprm.experiments.readme import BlockMissing, read_block, replace_block


def test_replace_block_rewrites_only_between_its_markers(tmp_path):
    p = tmp_path / "README.md"
    p.write_text("# t\nbefore\n<!-- megaprm:demo begin -->\nold 1\nold 2\n<!-- megaprm:demo end -->\nafter\n")
    replace_block(str(p), "demo", "| a | b |\n| 1 | 2 |\n")
    assert p.read_text() == ("# t\nbefore\n<!-- megaprm:demo begin -->\n| a | b |\n| 1 | 2 |\n"
                             "<!-- megaprm:demo end -->\nafter\n")
    assert read_block(str(p), "demo") == "| a | b |\n| 1 | 2 |"


def test_missing_or_doubled_markers_are_refused(tmp_path):
    p = tmp_path / "README.md"
    p.write_text("<!-- megaprm:demo begin -->\nx\n")
    with pytest.raises(BlockMissing, match="megaprm:demo"):
        replace_block(str(p), "demo", "y")
    p.write_text("<!-- megaprm:c begin -->\n<!-- megaprm:c end -->\n<!-- megaprm:c begin -->\n<!-- megaprm:c end -->\n")
    with pytest.raises(BlockMissing):
        read_block(str(p), "c")
    assert p.read_text().count("megaprm:c") == 4
