"""Snapshot of the suite's time: run `make test`'s pytest command once with a JUnit report and
write docs/testing-durations.md (wall time, load, machine, commit, counts, every file and the
slowest tests) - the page docs/testing.md points to, and the order tests/conftest.py starts the
modules in (slowest first, so two xdist workers finish together). Progress is pytest's own output.

    .venv/bin/python scripts/test_durations.py                   # runs the suite (~15 min)
    .venv/bin/python scripts/test_durations.py --junit J.xml --wall 812   # from a finished run

The figures are one run on one machine; the load average before and after says how quiet it was.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "testing-durations.md")
VERSION = 1  # of the page's header line (`durations-snapshot v1`), which its test reads
# `make test`'s pytest, as the Makefile runs it (workers, marker), plus the JUnit report
SUITE = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
         "--timeout=900",
         "-m", "not second_path", "tests"]


def _git(*args: str) -> str:
    p = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return p.stdout.strip()


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def read_junit(path: str) -> tuple[dict, dict]:
    """({test id: seconds}, {outcome: count}) from a pytest JUnit XML report."""
    times, counts = {}, collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        module = cls.replace(".", "/") + ".py"
        times[f"{module}::{name}"] = float(case.get("time", 0.0))
        kids = {c.tag for c in case}
        counts["failed" if kids & {"failure", "error"} else
               "skipped" if "skipped" in kids else "passed"] += 1
    return times, dict(counts)


def markdown(times: dict, counts: dict, wall: float, meta: dict, top: int = 25) -> str:
    per_file = collections.Counter()
    for test, t in times.items():
        per_file[test.split("::")[0]] += t
    total = sum(times.values())
    lines = [f"<!-- durations-snapshot v{VERSION}: written by scripts/test_durations.py -->",
             "# Test suite durations", "",
             f"`make test` ({meta['command']}), {meta['date']}, commit {meta['commit']}"
             f"{' (dirty tree)' if meta['dirty'] else ''}, on {meta['machine']}; load average "
             f"{meta['load_before']} before, {meta['load_after']} after.", "",
             f"- wall: **{wall:.0f} s** ({wall / 60:.1f} min)",
             f"- tests: {counts.get('passed', 0)} passed, {counts.get('skipped', 0)} skipped, "
             f"{counts.get('failed', 0)} failed",
             f"- summed test time: {total:.0f} s (over the workers; wall is less where they "
             f"overlap)", "",
             "## Slowest files", "",
             "Every file, slowest first (tests/conftest.py starts the modules in this order).", "",
             "| seconds | file |", "| ---: | --- |"]
    lines += [f"| {t:.1f} | `{f}` |" for f, t in per_file.most_common()]
    lines += ["", "## Slowest tests", "", "| seconds | test |", "| ---: | --- |"]
    lines += [f"| {t:.1f} | `{n}` |" for n, t in sorted(times.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/test_durations.py", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--junit", help="a finished run's JUnit XML instead of running the suite")
    ap.add_argument("--wall", type=float, help="that run's wall seconds (with --junit)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    if bool(a.junit) != (a.wall is not None):
        ap.error("--junit and --wall go together")
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta = {"date": datetime.date.today().isoformat(), "commit": _git("rev-parse", "--short",
                                                                      "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "machine": f"{_cpu()}, {os.cpu_count()} cores", "load_before": load_before,
            "command": "pytest " + " ".join(SUITE[2:])}
    with tempfile.TemporaryDirectory() as tmp:
        junit, wall = a.junit, a.wall
        if junit is None:
            junit = os.path.join(tmp, "junit.xml")
            t0 = time.monotonic()
            rc = subprocess.call([sys.executable, *SUITE, f"--junitxml={junit}"], cwd=ROOT)
            wall = time.monotonic() - t0
            if not os.path.exists(junit):
                print(f"test_durations: the suite wrote no report (exit {rc})", file=sys.stderr)
                return 1
        meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        times, counts = read_junit(junit)
    text = markdown(times, counts, wall, meta)
    tmp_out = a.out + ".tmp"
    with open(tmp_out, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp_out, a.out)
    print(f"test_durations: {len(times)} tests, wall {wall:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
