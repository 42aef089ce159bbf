"""`digest.source_digest`: the version of the code a cached result was built by (the
comparison's start cache key holds it), over a module and what it imports, transitively."""
import importlib.util
import shutil

import pytest
import torch

import megaprm.digest
from megaprm.digest import source_closure, source_digest


def _package(root, files):
    """A `megaprm` package of `files` under root, with a copy of digest.py whose
    `source_digest` reads that package (it resolves modules next to its own file)."""
    pkg = root / "megaprm"
    pkg.mkdir(exist_ok=True)
    for name, text in files.items():
        (pkg / name).write_text(text)
    shutil.copy(megaprm.digest.__file__, pkg / "digest_copy.py")
    spec = importlib.util.spec_from_file_location("digest_copy", pkg / "digest_copy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.source_digest


def test_a_change_to_an_imported_module_changes_the_version_and_others_do_not(tmp_path):
    digest = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "def f():\n    from megaprm.b import g  # function-local: counts\n    return g()\n",
        "b.py": "from megaprm import c\n\ndef g():\n    return c.K\n",
        "c.py": "K = 1\n",
        "unrelated.py": "X = 1\n"})

    def version(**kw):
        return digest(["megaprm.a"], **kw)

    v0 = version()
    assert v0["files"] == 4 and v0["torch"] == torch.__version__  # __init__, a, b, c
    (tmp_path / "megaprm" / "unrelated.py").write_text("X = 2\n")
    assert version() == v0  # not imported by a: not part of its version
    (tmp_path / "megaprm" / "c.py").write_text("K = 2\n")  # imported through b
    v1 = version()
    assert v1["code"] != v0["code"]
    # an excluded module (and what only it imports) is left out
    ex = version(exclude=("megaprm.b",))
    assert ex["files"] == 2
    (tmp_path / "megaprm" / "c.py").write_text("K = 3\n")
    assert version(exclude=("megaprm.b",)) == ex and version()["code"] != v1["code"]


def test_the_start_version_covers_the_code_that_builds_a_start():
    """The comparison's start key: start.py and what it imports (the warm-up's SFT step, the PRM
    trainer, the models), not the design's knobs in runs.py."""
    from megaprm.experiments.arithmetic import start

    v = start.code_version()
    assert v["files"] > 20
    with_runs = source_digest(start.START_CODE)
    assert with_runs["code"] != v["code"]  # runs.py is what the exclusion leaves out
    # the RL estimators, losses and filters are outside it: a fix to one re-runs RL cells, not
    # starts. Of the start's code only the config's AdvantageConfig registry imports them, and
    # no module that trains a start does
    from megaprm.digest import _megaprm_imports

    rl_only = {"megaprm.algorithms.advantages", "megaprm.algorithms.losses",
               "megaprm.algorithms.filters"}
    closure = source_closure(start.START_CODE, start.START_CODE_EXCLUDE)
    assert not rl_only & set(closure)
    importers = {m for m, path in closure.items()
                 if any(i == r or i.startswith(r + ".") for i in _megaprm_imports(path)
                        for r in rl_only)}
    assert importers == {"megaprm.algorithms.registry"}, importers


def test_no_start_weights_are_shaped_outside_the_start_key(tmp_path):
    """Every model a start trains from is written by start.py (`tiny_qwen2`, inside the key):
    compare.py, outside it, writes no model, so a shape edited there cannot reuse a stale
    start. A random PRM trunk (the short task's) has the policy's head counts and MLP ratio;
    the long task's trunk is the warm-up policy itself, and nothing is written for it."""
    import ast
    import json

    from megaprm.experiments.arithmetic import compare, start
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tree = ast.parse(open(compare.__file__, encoding="utf-8").read())
    called = {n.func.id for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "save_tiny_model" not in called and "megaprm.models.tiny" not in imported
    assert "megaprm.models.tiny" in source_closure(start.START_CODE, start.START_CODE_EXCLUDE)

    tok = build_char_tokenizer()
    trunk = start.prm_trunk("random", str(tmp_path / "trunk"), str(tmp_path / "sft"), tok,
                            seed=3, hidden=64, layers=2, rank=0)
    cfg = json.loads((tmp_path / "trunk" / "config.json").read_text())
    assert trunk == str(tmp_path / "trunk")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (64, 2, 4, 2, 192)
    assert start.prm_trunk("warmup", str(tmp_path / "t2"), "SFT", tok, 3, 64, 2, 0) == "SFT"
    assert not (tmp_path / "t2").exists()
    with pytest.raises(ValueError, match="valid inits"):
        start.prm_trunk("pretrained", str(tmp_path / "t3"), "SFT", tok, 3, 64, 2, 0)


def test_prose_keeps_the_version_and_code_changes_it(tmp_path):
    """Comments, layout and docstrings are not what a start computes: an edit to them alone
    keeps the version (so a doc fix does not rebuild hours of starts); any change to a
    statement, a string that is not a docstring included, changes it."""
    a = ('"""Module doc."""\nimport os\n\n\nclass A:\n    """Class doc."""\n    K = "k"\n\n\n'
         'def f(x):\n    """Function doc."""\n    return x + 1  # a comment\n')
    digest = _package(tmp_path, {"__init__.py": "", "a.py": a})

    def version():
        return digest(["megaprm.a"])

    v0 = version()
    assert v0["python"]
    edits = {  # prose only
        "docstrings": a.replace("Module doc.", "Other.").replace("Class doc.", "Other.")
                       .replace("Function doc.", "Other."),
        "no docstrings": a.replace('"""Module doc."""\n', "").replace('    """Class doc."""\n', "")
                          .replace('    """Function doc."""\n', ""),
        "comments and layout": a.replace("  # a comment", "").replace("x + 1", "(x+1)")
                                + "# trailing\n\n\n"}
    for what, text in edits.items():
        (tmp_path / "megaprm" / "a.py").write_text(text)
        assert version() == v0, what
    changes = {"the arithmetic": a.replace("x + 1", "x + 2"),
               "a string constant": a.replace('K = "k"', 'K = "j"'),
               "a statement where the docstring was": a.replace('"""Function doc."""', "x = -x")}
    for what, text in changes.items():
        (tmp_path / "megaprm" / "a.py").write_text(text)
        assert version()["code"] != v0["code"], what
    # a function whose only statement is its docstring still has a body (and a version)
    (tmp_path / "megaprm" / "a.py").write_text('def g():\n    """Only prose."""\n')
    only = version()
    (tmp_path / "megaprm" / "a.py").write_text("def g():\n    pass\n")
    assert version() == only
