"""The benchmark commands quoted in BENCHMARKS.md still parse: every `--flag` they use is one
their script accepts (read from the script's own `--help`). Running them is `make bench`'s job
(minutes to hours on this box); this catches a renamed or removed flag in the documentation."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[list[str]]:
    text = (ROOT / "BENCHMARKS.md").read_text()
    quoted = re.findall(r"`((?:python )?scripts/\w+\.py[^`]*)`", text)
    blocks = re.findall(r"^(python scripts/\w+\.py.*)$", text, re.M)
    cmds = {" ".join(c.split("#")[0].split()) for c in quoted + blocks}
    return [shlex.split(c.removeprefix("python ")) for c in sorted(cmds)]


def test_benchmark_commands_use_flags_their_scripts_accept():
    cmds = _commands()
    scripts = {c[0] for c in cmds}
    assert {"scripts/bench_convert.py", "scripts/bench_weight_sync.py",
            "scripts/bench_advantages.py"} <= scripts  # the regexes found the quoted commands
    helps = {}
    for script in sorted(scripts):
        p = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        assert p.returncode == 0, (script, p.stderr[-2000:])
        helps[script] = p.stdout
    for script, *args in cmds:
        for flag in (a for a in args if a.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", helps[script]), (script, flag)
