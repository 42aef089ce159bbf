"""What a run is, for resuming and locking: the digested config a checkpoint must match (its
fields, digest and the keys that differ), the run-directory lock's environment key, and the one
temperature of the update's log-probs. Imported by the loop, the checkpoint loader and the
launcher's preflight (no import of any of them)."""
from __future__ import annotations

import json

from megaprm.config import Config, to_dict
from megaprm.digest import json_digest

LOCK_ENV = "MEGAPRM_RUN_DIR_LOCKED"  # set by the launcher that holds the run directory's lock

_NOT_DIGESTED = {"trainer": ("steps", "save_every", "resume", "resume_fallback", "replace_run",
                             "eval_every",
                             "eval_problems",
                             "wandb", "progress", "keep_last", "allow_config_change",
                             "export_hf", "log_samples", "run_dir"),
                 # where the state sits while the engine generates, not what is computed: a run
                 # may resume with offload switched on or off (bit-exact either way)
                 "actor": ("offload",), "ref": ("offload",), "prm": ("offload",)}
# where the engine runs (rollout.placement, rollout.ranks) is not what is computed either: an
# on-policy run draws the same samples in both placements (docs/rollout.md)
_NOT_DIGESTED["rollout"] = ("placement", "ranks")
# read only off-policy: on-policy digests stay those of checkpoints written before they existed
_OFF_POLICY = ("rollout.max_staleness", "rollout.correction", "rollout.tis_cap")


def config_digest_fields(cfg: Config) -> dict:
    """The flattened config a checkpoint must match to be resumed: method, model, data, rollout,
    update and seed (not run length, logging or checkpoint cadence)."""
    flat = {}

    def walk(prefix, node):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else k
            if isinstance(v, dict):
                walk(key, v)
            else:
                flat[key] = list(v) if isinstance(v, tuple) else v
    d = to_dict(cfg)
    d.pop("parallel", None)  # the layout is checked separately (world, tp, pp)
    for section, keys in _NOT_DIGESTED.items():
        for k in keys:
            d.get(section, {}).pop(k, None)
    walk("", d)
    if not flat.get("rollout.max_staleness"):
        for k in _OFF_POLICY:
            flat.pop(k, None)
    return flat


def config_digest(config: dict) -> str:
    """The digest of `config_digest_fields` a checkpoint stores and a resume compares (compact
    JSON, as every checkpoint so far stored it)."""
    return json_digest(config, compact=True)


def _flatten(d, prefix=""):
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_diff(old: dict, new: dict) -> list:
    """['advantage.method: prof_grpo -> grpo', ...] for every dotted key that differs."""
    a, b = _flatten(json.loads(json.dumps(old, default=str))), _flatten(
        json.loads(json.dumps(new, default=str)))
    missing = object()
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)]


def logprob_temperature(cfg: Config) -> float:
    """The temperature of every log-prob the update uses (`actor.logprob_temperature`):
    rollout.temperature unless a number is set (PURE's release: T = 1 while sampling at 0.5)."""
    t = cfg.actor.logprob_temperature
    return float(cfg.rollout.temperature if t == "rollout" else t)
