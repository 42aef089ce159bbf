"""scripts/bench_peer_trl.py's megaprm half of the loss/gradient cross-check, against an
independent transformers reference, on a batch laid out as TRL hands it over (left-padded
prompts, right-padded completions). The TRL half needs TRL, which megaprm never depends on: it
is checked by the bench itself (its `cross_check` row compares TRL's loss and gradient with
this side's), not here.

Reference: at ratio 1 (old log-probs = detached new ones), PPO's clipped token-mean loss is
-sum(A * mask) / sum(mask) and its gradient that of -sum(A * logp * mask) / sum(mask)
(d/dθ exp(logp - sg(logp)) = dlogp/dθ): computed with the HF model's own forward.
"""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_peer_trl.py")


def _batch(vocab: int, gen: torch.Generator) -> dict:
    b, p, c = 6, 5, 7
    prompt_ids = torch.randint(7, vocab, (b, p), generator=gen)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    completion_ids = torch.randint(7, vocab, (b, c), generator=gen)
    completion_mask = torch.ones(b, c, dtype=torch.long)
    for i, (np_, nc) in enumerate([(5, 7), (3, 4), (4, 7), (2, 1), (5, 6), (1, 3)]):
        prompt_mask[i, :p - np_] = 0  # left padding
        prompt_ids[i, :p - np_] = 0
        completion_mask[i, nc:] = 0  # right padding
        completion_ids[i, nc:] = 0
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": torch.randn(b, generator=gen)}


def _reference(model_dir: str, b: dict) -> tuple:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss, n = 0.0, int(b["completion_mask"].sum())
    for i in range(b["advantages"].shape[0]):  # one row at a time: no padding involved
        prompt = b["prompt_ids"][i][b["prompt_mask"][i].bool()]
        comp = b["completion_ids"][i][b["completion_mask"][i].bool()]
        ids = torch.cat([prompt, comp])[None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        lp = logp[len(prompt) - 1:].gather(-1, comp[:, None]).sum()
        loss = loss - b["advantages"][i] * lp / n
    loss.backward()
    value = float(-(b["advantages"] * b["completion_mask"].sum(1)).sum() / n)
    return value, {k: p.grad for k, p in model.named_parameters()}


def test_megaprm_side_of_the_cross_check_matches_transformers(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_rl_step import make_model

    model_dir = make_model(str(tmp_path / "policy"))
    from transformers import AutoConfig

    batch = _batch(AutoConfig.from_pretrained(model_dir).vocab_size,
                   torch.Generator().manual_seed(0))
    path = str(tmp_path / "batch.pt")
    torch.save(batch, path)
    r = subprocess.run([sys.executable, "-W", "ignore", SCRIPT, "--phase", "megaprm-loss",
                        "--model", model_dir, "--batch", path], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, check=False,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(path + ".megaprm")
    value, grads = _reference(model_dir, batch)
    assert got["tokens"] == float(batch["completion_mask"].sum())
    assert got["loss"] == pytest.approx(value, rel=1e-5, abs=1e-7)
    assert set(got["grads"]) == set(grads)
    for k, g in grads.items():
        torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-6, msg=k)



def test_paired_ratios_are_taken_within_each_round():
    """The bench's paired statistic: numerator over denominator inside each round, then the
    median of those (not the ratio of the two medians, which mixes rounds)."""
    import importlib.util
    import statistics

    spec = importlib.util.spec_from_file_location("bench_peer_trl", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    num, den = [0.5, 0.9, 0.4], [1.0, 1.0, 0.5]  # the medians' ratio is 0.5 / 1.0
    runs = {"a": [{"cpu_s_per_step": x} for x in num], "b": [{"cpu_s_per_step": x} for x in den]}
    out = bench._paired(runs, "a", "b", "r")
    per = [n / d for n, d in zip(num, den)]
    assert out == {"r_rounds": per, "r_paired_median": statistics.median(per)}
    assert out["r_paired_median"] != statistics.median(num) / statistics.median(den)
    assert bench._paired({"a": runs["a"][:1], "b": runs["b"][:1]}, "a", "b", "r") == {}
