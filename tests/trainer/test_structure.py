"""The trainer's shape. The launcher's preflight stays independent of the RL loop: no import in
preflight.py, at module level or inside a function, names the loop or one of its phase modules
(the config digest it needs lives in run_config.py, which both import), so the two cannot import
each other (once a cycle: preflight.check_resume imported loop.config_digest_fields). The RL
step is a short list of phases that hand each other typed values, not trainer attributes: no
module of megaprm/trainer but the loop takes or reads an RLTrainer."""
import ast
import os

import megaprm.trainer

TRAINER = os.path.dirname(megaprm.trainer.__file__)
STEP = os.path.join(TRAINER, "rl")  # the RL step's package: the loop, its batches and phases
# The modules of megaprm/trainer that may hold an RLTrainer: the loop that defines it, and a
# command module that builds one and runs it (`megaprm train`). Every other module is a phase, a source or a helper,
# given the parts it reads.
TRAINER_HOLDERS = {"rl/loop.py", "commands/train.py"}  # the loop, and the command that runs it
TRAINER_NAMES = {"tr", "trainer", "rl_trainer"}  # a parameter or attribute so named is one


def _imported(path: str) -> set:
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_preflight_imports_no_part_of_the_loop():
    bad = {n for n in _imported(os.path.join(TRAINER, "preflight.py"))
           if n == "megaprm.trainer.rl" or n.startswith("megaprm.trainer.rl.")}
    assert not bad, bad
    # and the shared module imports neither side
    shared = _imported(os.path.join(TRAINER, "run_config.py"))
    assert not {n for n in shared if n.startswith("megaprm.trainer")}, shared


def _function(path: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return next(f for f in node.body if isinstance(f, ast.FunctionDef)
                        and f.name == name)
    raise AssertionError(f"{cls}.{name} not found in {path}")


def test_the_step_is_a_short_list_of_phases_and_the_loop_reexports_nothing():
    loop = os.path.join(STEP, "loop.py")
    step = _function(loop, "RLTrainer", "step")
    assert step.end_lineno - step.lineno + 1 <= 60
    tree = ast.parse(open(loop).read())
    assigned = {t.id for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert "__all__" not in assigned and not assigned, assigned  # no re-exports, no aliases


def _trainer_reads(tree: ast.AST) -> list:
    """Where a module takes or reads an RLTrainer: an import of the loop or of RLTrainer, the
    name RLTrainer anywhere (annotations included, string annotations parsed), a function or
    lambda parameter named like the trainer, or an object's attribute so named (`self.tr`)."""
    found = []

    def annotation_names(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval")
            except SyntaxError:
                return set()
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}

    for node in ast.walk(tree):
        where = getattr(node, "lineno", "?")
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "megaprm.trainer.rl.loop" or (
                    node.module == "megaprm.trainer" and any(a.name == "loop"
                                                              for a in node.names)):
                found.append((where, f"imports from {node.module}"))
            found += [(where, "imports RLTrainer") for a in node.names if a.name == "RLTrainer"]
        elif isinstance(node, ast.Import):
            found += [(where, f"imports {a.name}") for a in node.names
                      if a.name == "megaprm.trainer.rl.loop"]
        elif isinstance(node, ast.Name) and node.id == "RLTrainer":
            found.append((where, "names RLTrainer"))
        elif isinstance(node, ast.Attribute) and (node.attr == "RLTrainer" or (
                node.attr in TRAINER_NAMES and isinstance(node.value, ast.Name)
                and node.value.id == "self")):  # not `cfg.trainer`, the config's section
            found.append((where, f"reads .{node.attr}"))
        elif isinstance(node, ast.arg):
            if node.arg in TRAINER_NAMES:
                found.append((where, f"a parameter named {node.arg!r}"))
            if node.annotation is not None and "RLTrainer" in annotation_names(node.annotation):
                found.append((where, f"parameter {node.arg!r} annotated RLTrainer"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            if "RLTrainer" in annotation_names(node.returns):
                found.append((where, f"{node.name} returns an RLTrainer"))
    return found


def _trainer_modules():
    for root, _, files in os.walk(TRAINER):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                yield os.path.relpath(path, TRAINER), path


def test_no_phase_or_source_module_takes_or_reads_the_trainer():
    """The rule (docs/architecture.md "One RL step"; "rollout sources, engines and resume take parts,
    not the trainer"): outside rl/loop.py (and the command that runs it) no module of megaprm/trainer has a parameter that is the
    trainer, by name or annotation, nor imports, names or reaches into an RLTrainer. Phases,
    sources, engines and checkpoints are given what they read; the trainer's position travels
    as a TrainState value."""
    checked, bad = [], {}
    for rel, path in _trainer_modules():
        if rel in TRAINER_HOLDERS:
            continue
        checked.append(rel)
        found = _trainer_reads(ast.parse(open(path).read()))
        if found:
            bad[rel] = found
    assert not bad, bad
    assert {os.path.join("rl", m) for m in ("rollout_source.py", "resume.py", "reward_phase.py",
                                            "refill.py", "lifecycle.py")} | {
        os.path.join("checkpoint", "save.py")} <= set(checked), checked


def test_the_trainer_rule_catches_what_it_names():
    """The checker itself: each way of taking or reading the trainer is found."""
    cases = {
        "def build_engine(tr): pass": "a parameter named 'tr'",
        "def save(trainer, step): pass": "a parameter named 'trainer'",
        "class S:\n    def __init__(self, tr, engine): pass": "a parameter named 'tr'",
        "def f(x: 'RLTrainer'): pass": "parameter 'x' annotated RLTrainer",
        "def f(x: loop.RLTrainer): pass": "parameter 'x' annotated RLTrainer",
        "from megaprm.trainer.rl.loop import RLTrainer": "imports from megaprm.trainer.rl.loop",
        "from megaprm.trainer import loop": "imports from megaprm.trainer",
        "def sync(self): return self.tr.actor": "reads .tr",
        "g = lambda tr: tr.cfg": "a parameter named 'tr'",
        "def f(x): return x.RLTrainer": "reads .RLTrainer",
    }
    for src, want in cases.items():
        assert any(want in what for _, what in _trainer_reads(ast.parse(src))), src
    assert not _trainer_reads(ast.parse(
        "def make_source(cfg, groups, engine, actor_model, data, tok, eos, offloaded):\n"
        "    return cfg.trainer.seed"))
