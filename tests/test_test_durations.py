"""scripts/test_durations.py: the committed snapshot page is one it wrote (its versioned header,
figures that add up), and the page it writes from a JUnit report counts and ranks what the
report holds (a hand-built report, checked against a loop over its cases)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "test_durations.py")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.a.test_x" name="test_one" time="12.5"/>
<testcase classname="tests.a.test_x" name="test_two" time="0.5"><skipped message="no"/></testcase>
<testcase classname="tests.test_y" name="test_slow[p1]" time="30.0"/>
<testcase classname="tests.test_y" name="test_bad" time="1.0"><failure message="x"/></testcase>
</testsuite></testsuites>
"""


def test_a_page_from_a_report_ranks_and_counts_its_cases(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(JUNIT)
    out = tmp_path / "d.md"
    p = subprocess.run([sys.executable, SCRIPT, "--junit", str(junit), "--wall", "40",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert text.startswith("<!-- durations-snapshot v1")
    assert "1 passed" not in text and "2 passed, 1 skipped, 1 failed" in text
    files = re.findall(r"^\| ([\d.]+) \| `(tests/[^`:]+)` \|$", text, re.M)
    assert files == [("31.0", "tests/test_y.py"), ("13.0", "tests/a/test_x.py")]
    tests = re.findall(r"^\| ([\d.]+) \| `([^`]+::[^`]+)` \|$", text, re.M)
    assert tests[0] == ("30.0", "tests/test_y.py::test_slow[p1]") and len(tests) == 4
    assert "**40 s**" in text


def test_the_committed_snapshot_is_a_written_page_whose_figures_add_up():
    text = open(os.path.join(ROOT, "docs", "testing-durations.md"), encoding="utf-8").read()
    assert text.startswith("<!-- durations-snapshot v1: written by scripts/test_durations.py")
    wall = float(re.search(r"wall: \*\*(\d+) s\*\*", text).group(1))
    summed = float(re.search(r"summed test time: (\d+) s", text).group(1))
    files = [float(t) for t, _ in re.findall(r"^\| ([\d.]+) \| `(tests/[^`:]+)` \|$", text, re.M)]
    assert files == sorted(files, reverse=True) and sum(files) <= summed + 1
    assert 0 < wall <= summed * 1.5  # two workers: wall is at most the summed time, plus start-up
    assert re.search(r"(\d+) passed, (\d+) skipped, 0 failed", text)
