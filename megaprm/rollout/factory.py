"""Build the rollout engine a run asks for (`rollout.engine`: auto | hf | vllm), placed like the
trainer.

The trainer calls this once per rank, after its models exist:

    engine = build_engine(cfg.rollout, cfg.model.path, tokenizer, world_size=groups.world_size,
                          tp_size=groups.tp_size, seed=cfg.trainer.seed, device=device)

and then drives the lifecycle of `engine.RolloutEngine` (generate -> sleep -> update_weights).
Building never changes the caller's RNG states or current CUDA device.
"""
from __future__ import annotations

import importlib.util

import torch

from megaprm.errors import ConfigError
from megaprm.models.hf_files import has_weights
from megaprm.rollout.config import RolloutConfig
from megaprm.rollout.engine import RolloutEngine, preserved_rng_and_device
from megaprm.rollout.hf_engine import HFEngine, HFEngineConfig
from megaprm.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig


def resolve_engine(name: str) -> tuple[str, str]:
    """`rollout.engine` as this machine runs it, and the one line that says why: `auto` is vllm
    where vLLM is installed and CUDA is present, else hf (the transformers engine); hf and vllm
    are themselves. vLLM is looked up, not imported (an import costs seconds)."""
    if name != "auto":
        return name, f"rollout.engine={name}"
    missing = [what for what, ok in (("vLLM", importlib.util.find_spec("vllm") is not None),
                                     ("CUDA", torch.cuda.is_available())) if not ok]
    if not missing:
        return "vllm", "rollout.engine=auto: vLLM (installed, CUDA present)"
    return "hf", (f"rollout.engine=auto: the transformers engine (no {' and no '.join(missing)} "
                  "here; vLLM needs both)")


def check_engine(name: str, key: str = "rollout.engine") -> None:
    """Before any rank starts: `key`=vllm on a machine without vLLM or CUDA is one line naming
    the settings that run here (rather than a traceback from every rank)."""
    if name != "vllm":
        return
    fix = f"pass {key}=hf (transformers)" + (" or rollout.engine=auto" if key ==
                                             "rollout.engine" else "")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{key}=vllm: vLLM is not installed (pip install -e '.[gpu]' on a "
                          f"CUDA machine); {fix}")
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}=vllm: vLLM needs CUDA and this machine has none; {fix}")


def build_engine(rollout_cfg: RolloutConfig, model_path: str, tokenizer, *, world_size: int,
                 tp_size: int, seed: int, device, load_weights: bool = True,
                 external_launcher: bool | None = None) -> RolloutEngine:
    """One engine for this rank. `device`: the rank's device (the HF engine runs there; vLLM
    takes LOCAL_RANK's GPU under external_launcher, which must be the same one).

    vllm: tensor_parallel_size = `tp_size` (the trainer's tp colocated, rollout.tp on the
    rollout ranks); `external_launcher` (None: whenever world_size > 1; a separate placement's
    rollout ranks always pass True, so that even a lone rollout rank takes LOCAL_RANK's GPU
    rather than the single-process executor's GPU 0); the same `seed` on every rank (one seed
    per tp group). hf: the model at `model_path` on
    `device` in fp32, stopping on the tokenizer's EOS, padding with its pad id (the model
    config's when the tokenizer has none).
    """
    if world_size < 1 or tp_size < 1 or world_size % tp_size:
        raise ValueError(f"build_engine: world_size={world_size} must be a positive multiple of "
                         f"tp_size={tp_size}")
    # a megaprm checkpoint's hf/ has the config but no weights, and a trainer's engine gets the
    # actor's weights with its first update_weights anyway (`load_weights=False`: the trainer
    # syncs before any generation): the engine then starts from random weights, reading no file
    # twice and judging none (the trainer checks the policy's files against config.json itself)
    weights = load_weights and has_weights(model_path)
    eos = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    pad = tokenizer.pad_token_id
    if resolve_engine(rollout_cfg.engine)[0] == "vllm":
        pad = pad if pad is not None else (eos or (0,))[0]

        launcher = world_size > 1 if external_launcher is None else external_launcher
        cfg = VLLMEngineConfig(tensor_parallel_size=tp_size, external_launcher=launcher,
                               seed=seed, pad_token_id=int(pad), eos_token_ids=eos,
                               gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                               sleep_level=rollout_cfg.sleep_level,
                               load_format="auto" if weights else "dummy")
        return VLLMEngine(model_path, cfg)  # saves/restores RNG and device itself

    ecfg = HFEngineConfig(device=str(torch.device(device)), pad_token_id=pad, eos_token_ids=eos)
    with preserved_rng_and_device():
        if not weights:
            from transformers import AutoConfig

            return HFEngine.from_config(AutoConfig.from_pretrained(model_path), ecfg, seed=seed)
        return HFEngine.from_pretrained(model_path, ecfg)
