"""`digest.source_digest`: the version of the code a cached result was built by (the
comparison's start cache key holds it), over a module and what it imports, transitively."""
import importlib.util
import shutil

import torch

import megaprm.digest
from megaprm.digest import source_digest


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
