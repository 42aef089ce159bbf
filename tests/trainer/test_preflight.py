"""`megaprm plan` and `megaprm train` refuse the same launches with the same line: plan runs the
launcher's own layout checks (trainer.preflight.check_launch_layout) before it says "fits"."""
import contextlib
import io
import itertools

import pytest

from megaprm.cli import main


def _line(argv) -> tuple:
    """(exit code, the one stderr line or '') of `megaprm <argv>` run in this process."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(argv)
    lines = err.getvalue().strip().splitlines()
    assert rc in (0, 2) and len(lines) <= 1, (rc, err.getvalue())
    return rc, lines[0].split(": error: ", 1)[1] if lines else ""


def _refused(world, tp, pp, prompts, mini_batches, n, rollout_ranks) -> bool:
    """The launch rule written out: the trainer ranks (all, or all but the rollout ranks under
    rollout.placement=separate) split into tp x pp, and the batch into dp and mini-batches."""
    trainers = world - rollout_ranks
    if trainers < 1 or trainers % (tp * pp):
        return True
    dp = trainers // (tp * pp)
    return prompts % dp != 0 or (prompts // dp * n) % mini_batches != 0


CASES = [  # recipe, world size, overrides
    *[("configs/grpo_tiny.yaml", w, []) for w in (3, 5, 6, 8, 16, 128)],
    *[("configs/prof_grpo.yaml", w, []) for w in (1, 3, 7, 8, 2048)],
    *[("configs/grpo_tiny.yaml", w, [f"parallel.tp={tp}", f"parallel.pp={pp}"])
      for w, tp, pp in itertools.product((2, 4, 6), (1, 2), (1, 3))],
    *[("configs/prof_grpo.yaml", w, ["rollout.placement=separate", f"rollout.ranks={r}"])
      for w, r in ((8, 3), (8, 2), (2, 2), (4, 1))],
]


@pytest.mark.parametrize("recipe, world, overrides", CASES)
def test_plan_and_train_refuse_the_same_launches_with_the_same_line(recipe, world, overrides):
    """`megaprm plan --gpus 128` said "fits" where `megaprm train --nproc 128` refused
    (`prompts_per_step=8 must be a multiple of dp=128`)."""
    from megaprm.config import load_config

    c = load_config(recipe, overrides)
    refused = _refused(world, c.parallel.tp, c.parallel.pp, c.data.prompts_per_step,
                       c.actor.mini_batches, c.rollout.n,
                       c.rollout.ranks if c.rollout.placement == "separate" else 0)
    rc, plan_line = _line(["plan", recipe, "--gpus", str(world), *overrides])
    if not refused:
        assert "world size" not in plan_line and "multiple of dp" not in plan_line, plan_line
        return
    assert rc == 2, plan_line
    # train's launcher refuses before it reads the model or starts a rank (no torchrun here)
    rc, train_line = _line(["train", "--config", recipe, "--nproc", str(world), *overrides])
    assert rc == 2 and train_line == plan_line
    assert "--nproc" in train_line and "torchrun" not in train_line
