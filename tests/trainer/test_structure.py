"""The launcher's preflight stays independent of the RL loop: no import in preflight.py, at
module level or inside a function, names the loop or one of its phase modules (the config
digest it needs lives in run_config.py, which both import), so the two cannot import each other
(once a cycle: preflight.check_resume imported loop.config_digest_fields)."""
import ast
import os

import megaprm.trainer

TRAINER = os.path.dirname(megaprm.trainer.__file__)
LOOP_SIDE = {"loop", "actor_update", "advantages", "implicit_prm", "refill", "resume", "rewards",
             "rollout_source", "step_metrics", "policy", "batch", "data", "correction"}


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
