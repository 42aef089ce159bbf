"""The trainer's shape. The launcher's preflight stays independent of the RL loop: no import in
preflight.py, at module level or inside a function, names the loop or one of its phase modules
(the config digest it needs lives in run_config.py, which both import), so the two cannot import
each other (once a cycle: preflight.check_resume imported loop.config_digest_fields). The RL
step is a short list of phases that hand each other typed values, not trainer attributes."""
import ast
import os

import megaprm.trainer

TRAINER = os.path.dirname(megaprm.trainer.__file__)
LOOP_SIDE = {"loop", "actor_update", "advantage_phase", "implicit_prm", "refill", "resume",
             "reward_phase", "logprob_phase", "rollout_source", "step_metrics", "policy", "batch",
             "data", "correction"}
# attributes phases once used to hand data to each other through the trainer
SIDE_CHANNELS = ("tr._checks", "tr._judge_metrics", "tr._fallback_metrics",
                 "update_logprobs_t", '"row_versions")', "last_sync")


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
           if n.startswith("megaprm.trainer.") and n.split(".")[2] in LOOP_SIDE}
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
    loop = os.path.join(TRAINER, "loop.py")
    step = _function(loop, "RLTrainer", "step")
    assert step.end_lineno - step.lineno + 1 <= 60
    tree = ast.parse(open(loop).read())
    assigned = {t.id for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert "__all__" not in assigned and not assigned, assigned  # no re-exports, no aliases


def test_no_phase_hands_data_through_trainer_attributes():
    for f in sorted(os.listdir(TRAINER)):
        if f.endswith(".py"):
            text = open(os.path.join(TRAINER, f)).read()
            found = [s for s in SIDE_CHANNELS if s in text]
            assert not found, (f, found)
