"""`megaprm --help` and `megaprm <cmd> --help` stay fast: building the parser imports no torch,
transformers, megatron or numpy (each costs seconds). Checked by the modules a fresh interpreter
has loaded after printing each help (no wall-clock assertion); the help text is for users."""
import json
import subprocess
import sys

from megaprm.experiments.arithmetic.demo_command import DEMO_METHODS

COMMANDS = ["", "demo", "compare", "train", "train-prm", "plan", "plot", "convert", "eval",
            "bench"]
HEAVY = ("torch", "transformers", "megatron", "numpy")

_PROBE = """
import contextlib, io, json, sys
from megaprm.cli import main
out = {}
for cmd in %r:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main([*cmd.split(), "--help"])
        except SystemExit as e:
            assert e.code == 0, (cmd, e.code)
    out[cmd] = buf.getvalue()
print(json.dumps({"help": out, "heavy": sorted({m.split(".")[0] for m in sys.modules} & %r)}))
"""


def test_help_of_every_command_imports_no_heavy_module():
    p = subprocess.run([sys.executable, "-c", _PROBE % (COMMANDS, set(HEAVY))],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["heavy"] == [], res["heavy"]
    helps = res["help"]
    assert set(helps) == set(COMMANDS) and all(h.startswith("usage: megaprm") for h in helps.values())
    assert "megaprm demo" in helps[""] and "Megatron-Core" in helps[""]
    assert "{" + ",".join(DEMO_METHODS) + "}" in helps["demo"].replace("\n", "").replace(" ", "")
    assert "section.key=value" in helps["train"] and "valid keys" in helps["train"]


def test_demo_method_choices_are_the_registry_methods():
    from megaprm.algorithms.registry import METHODS

    assert sorted(DEMO_METHODS) == sorted(METHODS)


def test_each_command_starts_its_own_clock(monkeypatch):
    """The launch time the ranks inherit is the command's own, not one left in the environment
    by an earlier command run in the same process (a demo's 'wall Ns since started' line)."""
    import time

    import pytest

    from megaprm.cli import main
    from megaprm.parallel.launch import LAUNCH_T0_ENV, seconds_since_launch

    monkeypatch.setenv(LAUNCH_T0_ENV, str(time.time() - 1000))
    with pytest.raises(SystemExit):
        main(["--help"])
    assert seconds_since_launch() < 100
    # a rank (RANK/WORLD_SIZE set by torchrun) keeps the launcher's clock
    t0 = str(time.time() - 1000)
    monkeypatch.setenv(LAUNCH_T0_ENV, t0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert seconds_since_launch() > 900
