"""Every command in every doc file (README.md, docs/*.md, BENCHMARKS.md), as written.

A command is a line of a fenced block, or an inline code span, that starts with a program
(`.venv/bin/...`, `make`, `python...`, `megaprm`, `torchrun`, `pytest`, `scripts/...`), with
its `\\` continuations and heredoc. Two checks:

* the interpreter form: after the README's two commands (`make demo` / `make test`) only
  `.venv/bin/...` and `make ...` work (bare `python` has no torch, `megaprm` is not on PATH);
  any other form fails this test. Excepted: the GPU install line that creates `.venv` itself,
  and `source .venv/bin/activate`.
* each command is handled in one of four ways, decided by its form (so a new doc command is
  covered without editing this test):
    run    as written, in the doc's order, with the documented tiny substitutions: paths under
           /tmp/ and runs/ go to a temporary directory, where `runs/prof_grpo-tiny` is a tiny
           checkpoint (`checkpoint_tools import-hf` of a 2-layer policy) with a two-row
           metrics.jsonl in place of `megaprm train`'s output (the README's tiny training itself
           runs in tests/test_megaprm_cli.py), and `pytest ... tests` collects tests/gpu only;
    dry    `megaprm train/train-prm/demo/compare/bench/eval` whose run takes minutes or a GPU
           (`megaprm plan`, `eval`, `eval-prm`, `plot` and `data` run as written):
           argv parsed by megaprm's own parser and the config + overrides loaded and validated
           (everything short of starting ranks);
    flags  synopses with placeholders (HF_DIR, [--x a|b]), the benchmark and repeat scripts,
           scripts/test_durations.py and tests.kernel_paths (minutes each): every --flag must
           appear in the program's own --help;
    make   `make -n TARGET` (the target exists; nothing runs).
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "BENCHMARKS.md"]
PROGRAM = re.compile(r"^(\.venv/bin/\S+|make|python[\d.]*|megaprm|torchrun|pytest|source|"
                     r"scripts/\S+)(\s|$)")
GPU_INSTALL = 'python3.11 -m venv .venv && .venv/bin/pip install -e ".[gpu,dev]" && make install'
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|[\[\]|]|^\.\.\.$")


def _inline(prose: str) -> list[str]:
    """Inline spans that are commands; `megaprm train` / `megaprm train ...` name a command."""
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
    return [s for s in spans if PROGRAM.match(s)
            and len([w for w in s.split() if w != "..."]) > (1 if re.match(r"\.venv/|make ", s)
                                                            else 2)]


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line).rstrip()


def extract(path: Path) -> list[str]:
    """The commands of one markdown file, in document order."""
    text = path.read_text(encoding="utf-8")
    cmds, pos = [], 0
    for m in re.finditer(r"(?ms)^```[^\n]*\n(.*?)^```", text):
        prose = text[pos:m.start()]
        pos = m.end()
        cmds += _inline(prose)
        lines = m.group(1).splitlines()
        i = 0
        while i < len(lines):
            line = _strip_comment(lines[i])
            i += 1
            if not PROGRAM.match(line):
                continue
            while line.endswith("\\") and i < len(lines):
                line = line[:-1].rstrip() + " " + _strip_comment(lines[i]).strip()
                i += 1
            heredoc = re.search(r"<<'?(\w+)'?", line)
            if heredoc:
                body = []
                while i < len(lines) and lines[i].strip() != heredoc.group(1):
                    body.append(lines[i])
                    i += 1
                i += 1
                line = "\n".join([line, *body, heredoc.group(1)])
            cmds.append(line)
    cmds += _inline(text[pos:])
    return cmds


ALL = {str(p.relative_to(ROOT)): extract(p) for p in DOCS}


def test_every_doc_command_uses_a_form_that_works_after_make():
    assert sum(map(len, ALL.values())) > 30 and all(ALL[d] for d in ("README.md",
                                                                     "BENCHMARKS.md"))
    bad = [f"{doc}: {c}" for doc, cmds in ALL.items() for c in bad_forms(cmds)]
    assert not bad, "\n".join(bad)


def bad_forms(cmds: list[str]) -> list[str]:
    """The commands (first lines) that do not work after `make demo` / `make test`."""
    bad = []
    for c in cmds:
        if c == GPU_INSTALL or c == "source .venv/bin/activate":
            continue
        for part in re.split(r"\s*&&\s*", c.splitlines()[0]):
            first = part.split()[0]
            if not (first.startswith(".venv/bin/") or first == "make"):
                bad.append(c.splitlines()[0])
    return bad


def test_the_form_check_catches_a_bare_interpreter(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Run `python scripts/bench_actor.py --out x`; `megaprm train` is a name.\n\n"
                   "```bash\n"
                   "megaprm train --config c.yaml \\\n  trainer.steps=1   # note\n"
                   ".venv/bin/python - <<'EOF'\nprint(1)\nEOF\nmake demo\n```\n")
    cmds = extract(doc)
    assert cmds == ["python scripts/bench_actor.py --out x",
                    "megaprm train --config c.yaml trainer.steps=1",
                    ".venv/bin/python - <<'EOF'\nprint(1)\nEOF", "make demo"]
    assert bad_forms(cmds) == cmds[:2]


# ------------------------------------------------------------------------------ running them

def kind(cmd: str) -> str:
    words = cmd.splitlines()[0].split()  # a heredoc's body is not argv
    if cmd == GPU_INSTALL:
        return "skip"  # a GPU machine's install (downloads vLLM); the extras are checked below
    if words[0] == "source":
        return "skip"
    if words[0] == "make":
        return "make"
    if any(PLACEHOLDER.search(w) for w in words):
        return "flags"
    if words[0] == ".venv/bin/megaprm":
        return "run" if words[1] in ("eval", "eval-prm", "plot", "plan", "data") else "dry"
    if words[1:3] == ["-m", "checkpoint_tools"] and len(words) == 3:
        return "flags"  # the program's name in prose
    if re.match(r"\.venv/bin/python scripts/(bench_\w+|repeat_\w+|test_durations)\.py", cmd):
        return "flags"  # benchmarks, repeat counts, the suite's own timing: minutes each
    if words[1:3] == ["-m", "tests.kernel_paths"]:
        return "flags"  # the learning tests under every kernel path: minutes
    return "run"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _env(tmp):
    return dict(os.environ, OMP_NUM_THREADS="1", MEGAPRM_BENCH_RESULTS=str(tmp / "bench"),
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                         os.environ.get("PYTHONPATH")])))


def _substitute(cmd: str, tmp: Path) -> str:
    cmd = cmd.replace("/tmp/", f"{tmp}/tmp/")
    cmd = re.sub(r"(?<![\w/.])runs/", f"{tmp}/runs/", cmd)
    if "-m pytest" in cmd:
        cmd = re.sub(r" tests$", " tests/gpu", cmd)
    return cmd


def _megaprm_dry(words: list[str], tmp: Path) -> None:
    """megaprm's parser and config loading on the argv, no ranks. What the docs name as made
    or downloaded elsewhere (`make demo`'s runs/demo/sft, /models/..., a PRM800K JSONL) is the
    tiny policy and an empty stand-in file here."""
    from megaprm import cli

    try:
        args, rest = cli._parser().parse_known_args(words)
    except SystemExit as e:  # --help
        assert e.code == 0 and "--help" in words, (words, e.code)
        return
    assert not [r for r in rest if r.startswith("-")], rest
    if args.cmd == "train":
        from megaprm.config import load_config

        load_config(args.config, [*args.overrides, *rest])
    elif args.cmd == "train-prm":
        import yaml

        from megaprm.trainer.prm_training import load_prm_config

        # PRM800K-style data files: stand-ins
        data = yaml.safe_load((ROOT / args.config).read_text(encoding="utf-8"))
        stand_in = [f"{k}={tmp / 'stand_in.jsonl'}" for k in ("train_jsonl", "eval_jsonl")
                    if data.get(k)]
        (tmp / "stand_in.jsonl").touch()
        load_prm_config(args.config, [*args.overrides, *rest, f"model_dir={tmp / 'policy'}",
                                      *stand_in])


_HELP: dict = {}


def _help_has_flags(prog: list[str], args: list[str], tmp: Path) -> None:
    key = tuple(prog)
    if key not in _HELP:  # the benchmark scripts are quoted many times: one --help each
        p = subprocess.run([*prog, "--help"], cwd=ROOT, env=_env(tmp), capture_output=True,
                           text=True, timeout=300, check=False)
        assert p.returncode == 0, (prog, p.stderr[-2000:])
        _HELP[key] = p.stdout
    for flag in re.findall(r"(?<![\w-])--[\w-]+", " ".join(args)):
        assert re.search(rf"{re.escape(flag)}\b", _HELP[key]), (prog, flag)


def _flags(cmd: str, tmp: Path) -> None:
    """Every --flag of `cmd` appears in its program's --help (torchrun: its own flags, then the
    module's)."""
    words = cmd.split()
    if words[0] == ".venv/bin/torchrun":
        i = words.index("-m")
        _help_has_flags(words[:1], words[1:i], tmp)
        words = [".venv/bin/python", *words[i:]]
    n = 2
    if words[1:3] == ["-m", "checkpoint_tools"]:
        n = 4 if len(words) > 3 and not words[3].startswith("-") else 3
    elif words[1] == "-m":  # python -m module --flag ...
        n = 3
    _help_has_flags(words[:n], words[n:], tmp)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """runs/prof_grpo-tiny of the README as a tiny checkpoint + two metrics rows."""
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tmp = tmp_path_factory.mktemp("doc")
    (tmp / "tmp").mkdir()
    (tmp / "runs").mkdir()
    tok = build_char_tokenizer()
    policy = save_tiny_model("qwen2", str(tmp / "policy"), tokenizer=tok, vocab_size=len(tok),
                             hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=64, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    run = tmp / "runs" / "prof_grpo-tiny"
    p = subprocess.run([sys.executable, "-m", "checkpoint_tools", "import-hf", "--hf", policy,
                        "--out", str(run), "--no-verify"], cwd=ROOT, env=_env(tmp),
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [{"step": step, "reward/outcome_mean": 0.1 * step} for step in (0, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


def _read_only(cmd: str) -> bool:
    """`megaprm plan`: prints a plan, writes nothing, reads only the repository's configs, so
    consecutive ones may run side by side (seconds of imports each)."""
    return cmd.split()[:2] == [".venv/bin/megaprm", "plan"] and "\n" not in cmd


def _check_run(doc: str, cmd: str, p) -> None:
    assert p.returncode == 0, (doc, cmd, p.stdout[-2000:], p.stderr[-3000:])
    if "-m pytest" in cmd:  # README promises the skip reasons
        assert "SKIPPED" in p.stdout and "CUDA" in p.stdout, p.stdout[-2000:]
    else:  # megatron-core's TE/Apex fallbacks and deprecations are not the user's
        for noise in ("not installed", "Falling back", "FutureWarning"):
            assert noise not in p.stderr, (cmd, noise, p.stderr[-3000:])


@pytest.mark.parametrize("doc", list(ALL))
def test_doc_commands_run_as_written(doc, tiny_run, request):
    tmp = tiny_run
    seen = []
    cmds = ALL[doc]
    ahead = {}  # index -> Popen of a read-only command started next to the one before it

    def no_process_left():  # a failed check before its turn came
        for proc in ahead.values():
            proc.kill()
            proc.wait()

    request.addfinalizer(no_process_left)
    for i, cmd in enumerate(cmds):
        k = kind(cmd)
        seen.append(k)
        t0 = time.perf_counter()
        if (k == "run" and _read_only(cmd) and i + 1 < len(cmds) and i + 1 not in ahead
                and kind(cmds[i + 1]) == "run" and _read_only(cmds[i + 1])):
            ahead[i + 1] = subprocess.Popen(["bash", "-c", _substitute(cmds[i + 1], tmp)],
                                            cwd=ROOT, env=_env(tmp), stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True)
        if i in ahead:
            proc = ahead.pop(i)
            out, err = proc.communicate(timeout=600)
            _check_run(doc, cmd, subprocess.CompletedProcess(proc.args, proc.returncode,
                                                             out, err))
            print(f"{k:5s} {time.perf_counter() - t0:5.1f}s {cmd.splitlines()[0][:90]}")
            continue
        if k == "skip":
            if cmd == GPU_INSTALL:
                setup = (ROOT / "setup.py").read_text()
                assert '"gpu": [' in setup and '"dev": [' in setup
            continue
        if k == "make":
            p = subprocess.run(["make", "-n", *cmd.split()[1:]], cwd=ROOT, capture_output=True,
                               text=True, timeout=60, check=False)
            assert p.returncode == 0, (cmd, p.stderr)
        elif k == "flags":
            _flags(cmd, tmp)
        elif k == "dry":
            _megaprm_dry(cmd.split()[1:], tmp)
        else:
            if "-m pytest" in cmd and _cuda():
                continue  # the GPU tier itself: run on its own, not inside this test
            p = subprocess.run(["bash", "-c", _substitute(cmd, tmp)], cwd=ROOT, env=_env(tmp),
                               capture_output=True, text=True, timeout=600, check=False)
            _check_run(doc, cmd, p)
        print(f"{k:5s} {time.perf_counter() - t0:5.1f}s {cmd.splitlines()[0][:90]}")
    print(doc, {k: seen.count(k) for k in set(seen)})


def test_no_doc_train_command_resumes_a_run_an_earlier_one_finished():
    """In doc order (README first, then docs/*.md), a `megaprm train` whose run directory an
    earlier doc command already trained as far would print 'already finished' and train
    nothing (README's Ray command and docs/lifecycle.md's offload command resumed the finished
    runs/prof_grpo-tiny and trained 0 steps): each such command takes a run directory of its
    own."""
    from megaprm import cli
    from megaprm.config import load_config

    trained, clashes = {}, []
    for doc, cmds in ALL.items():
        for cmd in cmds:
            words = cmd.splitlines()[0].split()
            if words[:2] != [".venv/bin/megaprm", "train"] or kind(cmd) != "dry":
                continue
            args, rest = cli._parser().parse_known_args(words[1:])
            t = load_config(args.config, [*args.overrides, *rest]).trainer
            if PLACEHOLDER.search(t.run_dir):  # RUN_DIR: "a directory of its own" per run
                continue
            run_dir = os.path.normpath(t.run_dir)
            if t.resume and trained.get(run_dir, -1) >= t.steps:
                clashes.append(f"{doc}: {cmd.splitlines()[0]} (trainer.run_dir={run_dir} "
                               f"already trained to {trained[run_dir]} steps)")
            trained[run_dir] = max(trained.get(run_dir, 0), t.steps)
    assert not clashes, "\n".join(clashes)
    assert len(trained) >= 5  # README's and the docs' train commands were read
