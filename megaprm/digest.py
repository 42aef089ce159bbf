"""The short digest that names a JSON-able thing: a config a checkpoint must match, a cached
stage's recipe, a set of tensor hashes."""
from __future__ import annotations

import hashlib
import json


def json_digest(obj, *, compact: bool = False) -> str:
    """sha256 (first 16 hex) of `obj` as key-sorted JSON, so key order never matters (values
    JSON cannot hold are written as str). `compact` drops the spaces after separators: the
    trainer checkpoint's config digest is stored that way, and older checkpoints must still
    match."""
    seps = (",", ":") if compact else None
    text = json.dumps(obj, sort_keys=True, default=str, separators=seps)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _megaprm_imports(path: str) -> set:
    """The megaprm modules a source file imports (top-level and function-local alike)."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "megaprm")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "megaprm":
            out.add(node.module)
            # `from megaprm.x import y` may name a submodule y
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _code_of(path: str) -> str:
    """What a source file computes, without what only explains it: the dump of its syntax tree
    with comments, layout and docstrings dropped (a docstring is a module's, class's or
    function's first statement when it is a string constant), so an edit to prose alone keeps
    the version. The dump's format is the running Python's, hence `python` in the version."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def source_closure(roots, exclude=()) -> dict:
    """{module name: file} of `roots` (module names) and every megaprm module they import,
    transitively, with their parent packages (read from the files with `ast`, so
    function-local imports count and nothing is imported). `exclude`: module names (and their
    submodules) left out, with what only they import."""
    import os

    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def file_of(mod: str):
        rel = os.path.join(*mod.split("."))
        for cand in (rel + ".py", os.path.join(rel, "__init__.py")):
            p = os.path.join(root_dir, cand)
            if os.path.isfile(p):
                return p
        return None

    def excluded(mod: str) -> bool:
        return any(mod == e or mod.startswith(e + ".") for e in exclude)

    seen, todo = {}, list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen or excluded(mod):
            continue
        path = file_of(mod)
        if path is None:  # a name imported from a module, not a module
            continue
        seen[mod] = path
        parts = mod.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages
        todo.extend(_megaprm_imports(path))
    return seen


def source_digest(roots, exclude=()) -> dict:
    """The version of the code a cached result was built by: sha256 (first 16 hex) over the
    code of `source_closure(roots, exclude)` (the code is `_code_of`'s: comments and
    docstrings do not count), with torch's and Python's versions. Returns {"code": digest,
    "files": n, "torch": version, "python": version}. `exclude`: e.g. reporting code that never
    changes a result."""
    import platform

    import torch

    seen = source_closure(roots, exclude)
    h = hashlib.sha256()
    for mod in sorted(seen):
        h.update(mod.encode() + b"\0" + _code_of(seen[mod]).encode() + b"\0")
    return {"code": h.hexdigest()[:16], "files": len(seen), "torch": torch.__version__,
            "python": platform.python_version()}
