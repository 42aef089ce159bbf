"""README's layout block names every top-level module and package of megaprm, and the
repository's top-level code folders: the tree a newcomer reads is the tree that exists."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layout_block() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^## Layout\n(?:[^`\n][^\n]*\n|\n)*```\n(.*?)\n```", text, re.S | re.M)
    assert m, "README.md has no '## Layout' code block"
    return m.group(1)


def test_layout_block_names_every_module_and_package():
    block = _layout_block()
    pkg = os.path.join(ROOT, "megaprm")
    names = []
    for e in sorted(os.listdir(pkg)):
        full = os.path.join(pkg, e)
        if e.endswith(".py") and e != "__init__.py":
            names.append(f"megaprm/{e}")
        elif os.path.isdir(full) and not e.startswith(("_", ".")):
            names.append(f"megaprm/{e}/")
    sub = os.path.join(pkg, "experiments")
    names += [f"megaprm/experiments/{e}" for e in sorted(os.listdir(sub))
              if e.endswith(".py") and e != "__init__.py"]
    trainer = os.path.join(pkg, "trainer")  # its sub-packages: the RL step's, checkpoint, ...
    names += [f"{e}/" for e in sorted(os.listdir(trainer))
              if os.path.isdir(os.path.join(trainer, e)) and not e.startswith(("_", "."))]
    names += ["checkpoint_tools/", "eval/", "scripts/", "configs/"]
    missing = [n for n in names if n not in block and n.rstrip("/") + ":" not in block
               and not (n.startswith("megaprm/") and n.rstrip("/").split("/")[-1] + "/" in block)]
    assert not missing, f"README's layout block does not name {missing}"
