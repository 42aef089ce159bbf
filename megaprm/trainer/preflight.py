"""Everything `megaprm train` can check before any rank starts (so a user error costs a second,
prints one line and never reaches torchrun): layout, model and PRM paths vs tp/pp, data, batch
arithmetic, and whether an existing checkpoint can be resumed with this layout and config."""
from __future__ import annotations

import json
import os
import sys

from megaprm.config import Config, ConfigError
from megaprm.parallel.init import check_layout


def check_rl_launch(cfg: Config, world_size: int) -> None:
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.trainer import model_source

    dp = check_layout(world_size, cfg.parallel.tp, cfg.parallel.pp)
    src = model_source.resolve(cfg.model.path, "model.path")
    spec_from_hf(src.hf_dir).check_parallel(cfg.parallel.tp, cfg.parallel.pp)
    if cfg.prm.kind == "discriminative":
        prm = model_source.resolve(cfg.prm.path, "prm.path")
        spec_from_hf(prm.hf_dir).check_parallel(cfg.parallel.tp, cfg.parallel.pp)
    if cfg.prm.kind == "judge":  # the grader runs in its own engine: any layout, weights needed
        model_source.resolve(cfg.prm.path, "prm.path")
    # a key this setting makes meaningless: a warning, not an error, as the compare driver
    # passes its one prm.path to every run
    if cfg.prm.kind in ("oracle", "none") and cfg.prm.path:
        print(f"megaprm train: warning: prm.path={cfg.prm.path!r} is not read with prm.kind="
              f"{cfg.prm.kind}", file=sys.stderr)
    if cfg.data.task == "math" and not os.path.isfile(cfg.data.path):
        raise ConfigError(f"data.path={cfg.data.path!r} does not exist; pass a .jsonl or "
                          "verl-style .parquet prompt file")
    check_batch(cfg, dp)
    check_resume(cfg, world_size)


def check_batch(cfg: Config, dp: int) -> None:
    P = cfg.data.prompts_per_step
    if P % dp:
        raise ConfigError(f"data.prompts_per_step={P} must be a multiple of dp={dp}")
    rows = P // dp * cfg.rollout.n
    if rows % cfg.actor.mini_batches:
        raise ConfigError(
            f"actor.mini_batches={cfg.actor.mini_batches} does not divide the {rows} rollouts per "
            f"dp rank (data.prompts_per_step={P} / dp={dp} x rollout.n={cfg.rollout.n}); choose "
            "a divisor of it")


def check_resume(cfg: Config, world_size: int) -> None:
    """A run directory with a checkpoint resumes only with the same layout and config."""
    from megaprm.trainer import checkpoint

    if not cfg.trainer.resume:
        return
    root = os.path.join(cfg.trainer.run_dir, "checkpoints")
    try:
        path = checkpoint.latest_checkpoint(root)
    except checkpoint.CheckpointError:
        return  # the ranks report it (and may fall back to an older checkpoint)
    if path is None or not os.path.isfile(os.path.join(path, "trainer.json")):
        return
    with open(os.path.join(path, "trainer.json"), encoding="utf-8") as f:
        state = json.load(f)
    have = (state.get("world_size"), state.get("tp"), state.get("pp"))
    want = (world_size, cfg.parallel.tp, cfg.parallel.pp)
    if have != want:
        raise checkpoint.CheckpointError(
            f"{path} was written with (world, tp, pp) = {have} but this run has {want}; resume "
            "with the same layout, or export the policy (checkpoint_tools export-hf) and start a "
            "new run_dir from it")
    from megaprm.trainer.loop import config_digest_fields

    if state.get("config") is not None and not cfg.trainer.allow_config_change:
        changed = checkpoint.config_diff(state["config"], config_digest_fields(cfg))
        if changed:
            raise checkpoint.CheckpointError(
                f"{path} was trained with another config: {', '.join(changed[:6])}; use a new "
                "trainer.run_dir, or trainer.allow_config_change=true to resume anyway")
