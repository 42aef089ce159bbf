"""The HF side of a check: the transformers model of a directory and its outputs on a batch.

Causal LMs and token classifiers load through transformers' Auto classes. The Qwen2.5-Math-PRM
head has no transformers class (it is remote code upstream), so `ProcessRewardReference` rebuilds
it from transformers' `Qwen2Model` + the `score` MLP, with the upstream parameter names.
"""
from __future__ import annotations

import json
import os

import torch

from megaprm.models.hf_spec import ModelSpec
from megaprm.models.mapping import HFWeights


class ProcessRewardReference(torch.nn.Module):
    """Qwen2ForProcessRewardModel: Qwen2Model trunk + score = Linear(h, h), ReLU, Linear(h, 2)."""

    def __init__(self, config):
        import transformers as tf

        super().__init__()
        self.config = config
        self.model = tf.Qwen2Model(config)
        h = config.hidden_size
        self.score = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(),
                                         torch.nn.Linear(h, 2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> per-token label logits [b, s, 2]."""
        return self.score(self.model(input_ids=input_ids).last_hidden_state)


def load_reference(hf_dir: str, spec: ModelSpec, dtype: torch.dtype = torch.float32):
    """The transformers model of `hf_dir` in eval mode (whole model resident: a check, not a
    conversion path)."""
    import transformers as tf

    if spec.head == "lm":
        return tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    if spec.head == "token_cls":
        return tf.AutoModelForTokenClassification.from_pretrained(hf_dir, dtype=dtype).eval()
    model = ProcessRewardReference(tf.AutoConfig.from_pretrained(hf_dir)).to(dtype).eval()
    weights = HFWeights(hf_dir)
    model.load_state_dict({k: weights(k) for k in model.state_dict()})
    return model


@torch.no_grad()
def reference_outputs(model, spec: ModelSpec, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 [b, s, vocab] logits (LM) or [b, s, num_labels] scores (PRM heads)."""
    if spec.head == "prm_mlp":
        return model(input_ids).float()
    return model(input_ids=input_ids).logits.float()


def save_process_reward_model(config, out_dir: str, seed: int = 0) -> str:
    """Write a random Qwen2ForProcessRewardModel as upstream ships it: config.json with that
    architecture + model.safetensors with `model.`-prefixed trunk names and `score.{0,2}.*`."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config.architectures = ["Qwen2ForProcessRewardModel"]
    model = ProcessRewardReference(config).float()
    with torch.no_grad():  # random norms, so a norm mapping bug changes the scores
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["architectures"] == ["Qwen2ForProcessRewardModel"]
    return out_dir
