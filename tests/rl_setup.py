"""Tiny RL runs for the trainer's tests (CPU tier and GPU tier): a tiny policy + PRM in the real
HF format with the task's char tokenizer, and the demo recipe shrunk to seconds per step."""
from __future__ import annotations

import os

DEMO_YAML = os.path.join(os.path.dirname(__file__), "..", "megaprm", "configs", "demo.yaml")
SMALL = ["trainer.wandb=disabled", "trainer.progress=false", "data.prompts_per_step=4",
         "rollout.n=4", "actor.optim.lr=1e-3", "advantage.prof.remove=2",
         "prm.input_format=raw"]


def tiny_policy_and_prm(root, hidden: int = 32) -> tuple[str, str]:
    """A tiny Qwen2 policy and a token-classification PRM of the same shape under `root`."""
    from megaprm.models.tiny import build_hf_model, save_tiny_model, tiny_config
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    kw = dict(vocab_size=len(tok), hidden_size=hidden, num_layers=2, num_heads=4,
              num_kv_heads=2, intermediate_size=2 * hidden, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    policy = save_tiny_model("qwen2", str(root / "policy"), tokenizer=tok, **kw)
    prm = build_hf_model(tiny_config("qwen2", head="token_cls", **kw), seed=1)
    prm.save_pretrained(str(root / "prm"))
    tok.save_pretrained(str(root / "prm"))
    return policy, str(root / "prm")


def rl_config(run_dir, policy, prm, method, extra=()):
    """The demo recipe for `method` on the tiny models (PRIME's implicit PRM: the policy)."""
    from megaprm.config import load_config

    kind = "implicit" if method == "prime" else (
        "discriminative" if method in ("pure", "prof_grpo", "papo", "blend") else "none")
    return load_config(DEMO_YAML, [f"trainer.run_dir={run_dir}", f"model.path={policy}",
                                   f"prm.path={'null' if method == 'prime' else prm}",
                                   f"prm.kind={kind}", f"advantage.method={method}", *SMALL,
                                   *extra])
