"""Everything `megaprm train` can check before any rank starts (so a user error costs a second,
prints one line and never reaches torchrun): layout, model and PRM paths vs tp/pp, data, batch
arithmetic, and whether an existing checkpoint can be resumed with this layout and config."""
from __future__ import annotations

import os
import sys

from checkpoint_tools import model_source
from megaprm.config import Config
from megaprm.errors import ConfigError
from megaprm.models.hf_spec import spec_from_hf
from megaprm.outputs import check_output
from megaprm.parallel.init import ParallelConfigError, check_layout
from megaprm.planner import plan as planner
from megaprm.planner.hardware import local_gpu
from megaprm.rewards.prm_input import check_prm_reads_policy, resolve_prm_input_format
from megaprm.rollout.factory import check_engine, resolve_engine
from megaprm.trainer.checkpoint.load import other_runs
from megaprm.trainer.checkpoint.run_dir import refuse_lost_checkpoints, refuse_overwrite
from megaprm.trainer.checkpoint.store import CheckpointError, step_dirs, verified_trainer_json
from megaprm.trainer.run_config import config_diff, config_digest_fields


def check_launch_layout(cfg: Config, world_size: int) -> int:
    """The checks of a launch of `world_size` ranks that need no file: the trainer's share of
    them, tp/pp against it, the batch against dp. Returns dp. `megaprm train` (before any rank
    starts) and `megaprm plan` (before it says "fits") both run it: one refusal everywhere."""
    trainers = trainer_world(cfg, world_size)
    try:
        dp = check_layout(trainers, cfg.parallel.tp, cfg.parallel.pp, ep=cfg.parallel.ep)
    except ParallelConfigError as e:
        if trainers == world_size:
            raise
        raise ParallelConfigError(f"{world_size} ranks - rollout.ranks={cfg.rollout.ranks} = "
                                  f"{trainers} trainer ranks: {e}") from None
    check_batch(cfg, dp)
    return dp


def check_rollout_tp(cfg: Config) -> None:
    """rollout.tp > 1 (engines of several GPUs on the rollout ranks) runs vLLM engines of tp
    workers (rollout/remote.py); the transformers engine never takes more than one GPU, so
    with it (rollout.engine=hf, or auto where vLLM or CUDA is missing) rollout.tp > 1 is
    refused in one line, before any rank starts. (A tp that does not divide rollout.ranks is
    refused by the config itself.)"""
    tp = cfg.rollout.tp
    if tp > 1 and resolve_engine(cfg.rollout.engine)[0] == "hf":
        raise ConfigError(f"rollout.tp={tp}: the transformers engine (rollout.engine="
                          f"{cfg.rollout.engine}, here hf) runs on one GPU; set rollout.tp=1, "
                          "or rollout.engine=vllm on a CUDA machine with vLLM")


def check_rl_launch(cfg: Config, world_size: int):
    """Every check of `megaprm train` before its ranks start. Returns the trainer.json of the
    checkpoint the ranks will resume from (None: a fresh start)."""
    check_launch_layout(cfg, world_size)
    world_size = trainer_world(cfg, world_size)
    src = model_source.resolve(cfg.model.path, "model.path")
    spec_from_hf(src.hf_dir).check_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)
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
    model_source.check_tokenizer(src.hf_dir, "model.path")
    if cfg.prm.kind == "discriminative":  # the PRM reads the policy's text, as it was trained
        prm_config = spec_from_hf(prm.hf_dir).hf_config
        check_prm_reads_policy(prm.hf_dir, src.hf_dir, prm_vocab_size=prm_config.get("vocab_size"))
        resolve_prm_input_format(cfg.prm.input_format, prm.hf_dir, hf_config=prm_config)
    check_engine(cfg.rollout.engine)
    check_rollout_tp(cfg)
    if cfg.prm.kind == "judge":
        check_engine(cfg.prm.judge.engine, "prm.judge.engine")
    if cfg.rollout.engine == "auto":
        print(f"megaprm train: {resolve_engine('auto')[1]}", flush=True)
    for key in ("path", "eval_path"):
        path = getattr(cfg.data, key)
        if cfg.data.task != "math" or (path is None and key == "eval_path"):
            continue
        if os.path.isdir(path):
            raise ConfigError(f"data.{key}={path!r} is a directory; pass a .jsonl or verl-style "
                              ".parquet prompt file inside it")
        if not os.path.isfile(path):
            raise ConfigError(f"data.{key}={path!r} does not exist; pass a .jsonl or verl-style "
                              ".parquet prompt file")
    # the inputs are known good: now the output, which must not be, hold or lie in any of them
    reads = {"model.path": cfg.model.path, "data.path": cfg.data.path,
             "data.eval_path": cfg.data.eval_path,
             "prm.path": cfg.prm.path if cfg.prm.kind not in ("oracle", "none") else None}
    check_output(cfg.trainer.run_dir, "trainer.run_dir", reads, own_run=True)
    return check_resume(cfg, world_size)


def trainer_world(cfg: Config, world_size: int) -> int:
    """The trainer's ranks in a launch of `world_size`: all of them colocated, the first
    world_size - rollout.ranks under a separate placement (the rollout ranks run no Megatron)."""
    if cfg.rollout.placement != "separate":
        return world_size
    if cfg.rollout.ranks >= world_size:
        raise ConfigError(f"rollout.ranks={cfg.rollout.ranks} leaves no trainer rank in a launch "
                          f"of {world_size} processes; launch more (--nproc) or lower "
                          "rollout.ranks")
    return world_size - cfg.rollout.ranks


def check_plan(cfg: Config, world_size: int, gpu=None) -> None:
    """`megaprm plan`'s verdict before any rank starts: a run whose update or rollout does not
    fit the GPU is refused in one line naming the largest terms and an override that fits.
    Applied only where the ranks run on CUDA (`gpu`: default this machine's, None without
    CUDA, so CPU runs are never blocked); `megaprm train --no-plan-check` skips it."""
    gpu = gpu if gpu is not None else local_gpu()
    if gpu is None:
        return
    # the launcher's model.dtype is already resolved for CUDA ("auto" -> bf16)
    w, _ = planner.workload_of(cfg, {"model": {"dtype": cfg.model.dtype}}, world_size)
    plan = planner.plan_workload(w, gpu, exact=False, knobs_of=planner.override_keys(cfg))
    if not plan.fits:
        raise ConfigError(f"{plan.verdict()} on {world_size} x {gpu.name.upper()} "
                          f"({gpu.mem_gb:.0f} GB); `megaprm plan` shows the table, "
                          "--no-plan-check skips this check")


def check_batch(cfg: Config, dp: int) -> None:
    P = cfg.data.prompts_per_step
    if P % dp:
        raise ConfigError(f"data.prompts_per_step={P} must be a multiple of dp={dp} (the "
                          "ranks over tp*pp); choose data.prompts_per_step, or the ranks "
                          "(--nproc), to make it one")
    rows = P // dp * cfg.rollout.n
    if rows % cfg.actor.mini_batches:
        raise ConfigError(
            f"actor.mini_batches={cfg.actor.mini_batches} does not divide the {rows} rollouts per "
            f"dp rank (data.prompts_per_step={P} / dp={dp} x rollout.n={cfg.rollout.n}); choose "
            "a divisor of it")


def finished_line(cfg: Config, state) -> str | None:
    """The one line for a resume of a run that has already run all its trainer.steps (`state`:
    its newest checkpoint's trainer.json), else None."""
    if state is None or state.get("next_step", 0) < cfg.trainer.steps:
        return None
    return (f"[train] {cfg.trainer.run_dir} already finished at step {state['next_step'] - 1} "
            f"(trainer.steps={cfg.trainer.steps}): nothing to train; raise trainer.steps to "
            "train on, or pass a new trainer.run_dir")


def check_resume(cfg: Config, world_size: int):
    """A run directory with a checkpoint resumes only with the same layout and config; a fresh
    start (trainer.resume=false) never overwrites a run there, nor a resume one whose
    checkpoints were removed. Returns the trainer.json resumed from (None: a fresh start).
    Only files that match their checkpoint's MANIFEST are read: a damaged newest checkpoint
    is passed over for the previous one, as the ranks' resume falls back (or refused,
    trainer.resume_fallback=false)."""
    if not cfg.trainer.resume:
        refuse_overwrite(cfg.trainer.run_dir, cfg.trainer.replace_run)
        return None
    root = os.path.join(cfg.trainer.run_dir, "checkpoints")
    state = path = None
    names = step_dirs(root)
    foreign = dict(other_runs(root, names))  # never adopted (load.find_intact)
    for name in (n for n in names if n not in foreign):
        path = os.path.join(root, name)
        state, problem = verified_trainer_json(path)
        if state is not None:
            break
        if not cfg.trainer.resume_fallback:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {problem}; set trainer.resume_fallback=true to "
                "resume from the previous intact checkpoint, or delete it")
    if not names:
        refuse_lost_checkpoints(cfg.trainer.run_dir, cfg.trainer.steps, cfg.trainer.save_every)
    if state is None:
        return None  # none, or none intact: the ranks report it
    have = (state.get("world_size"), state.get("tp"), state.get("pp"))
    want = (world_size, cfg.parallel.tp, cfg.parallel.pp)
    if have != want:
        raise CheckpointError(
            f"{path} was written with (world, tp, pp) = {have} but this run has {want}; resume "
            "with the same layout, or export the policy (checkpoint_tools export-hf) and start a "
            "new run_dir from it")
    if state.get("config") is not None and not cfg.trainer.allow_config_change:
        changed = config_diff(state["config"], config_digest_fields(cfg))
        if changed:
            raise CheckpointError(
                f"{path} was trained with another config: {', '.join(changed[:6])}; use a new "
                "trainer.run_dir, or trainer.allow_config_change=true to resume anyway")
    return state
