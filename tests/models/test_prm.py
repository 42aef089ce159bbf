"""The Megatron PRM equals an independent reference under every (tp, pp) layout.

Reference: transformers' own Qwen2 trunk (`Qwen2ForTokenClassification`, or `Qwen2Model` + the
Qwen2.5-Math-PRM head written in plain torch), run on one unpadded row at a time, with the
closing positions of steps found by a Python loop. Implicit PRM: log-prob differences from
transformers' causal-LM forward of the two models.
"""
import json
import os

import pytest
import torch

from megaprm.models.tiny import build_hf_model, save_tiny_model, tiny_config
from megaprm.parallel import launch

SEP, MARK, EOS = 4, 5, 1  # the char tokenizer's "\n\n", "\n", <eos>
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
TOL = 1e-5


def _rollouts():
    """Left-padded prompts [B, P], right-padded responses [B, T] with separators at known places."""
    g = torch.Generator().manual_seed(11)
    prompt_lens = [6, 3, 5, 1, 4]
    responses = [
        [20, 21, SEP, 22, 23, 24, SEP, 25, EOS],       # 3 steps, EOS-closed
        [20, SEP, SEP, 30, 31, 32, 33, EOS],           # an empty step
        [26, 27, 28, SEP, 29, 30, 31, 32, SEP],        # truncated right after a separator
        [33],                                          # one token, one step
        [21, 22, 23, 24, 25, SEP, 26, 27, 28, 29, 30, 31],  # truncated mid-step
    ]
    B, P, T = len(responses), max(prompt_lens), max(map(len, responses))
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    response_ids = torch.zeros(B, T, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (n, r) in enumerate(zip(prompt_lens, responses)):
        prompt_ids[i, P - n:] = torch.randint(6, 36, (n,), generator=g)
        prompt_mask[i, P - n:] = True
        response_ids[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = True
    return prompt_ids, prompt_mask, response_ids, response_mask


def _closing_positions(resp):
    """Loop reference of the step rule: separators and the last token close steps."""
    return [t for t, tok in enumerate(resp) if tok == SEP or t == len(resp) - 1]


def _save_prm_mlp(out_dir, seed):
    """A Qwen2ForProcessRewardModel checkpoint: transformers' Qwen2 trunk + a random MLP head."""
    from safetensors.torch import save_file

    cfg = tiny_config("qwen2", head="token_cls")
    trunk = build_hf_model(cfg, seed).model
    head = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    tensors = {f"model.{k}": v.contiguous() for k, v in trunk.state_dict().items()}
    tensors.update({f"score.{k}": v.contiguous() for k, v in head.state_dict().items()})
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    hf = cfg.to_dict()
    hf["architectures"] = ["Qwen2ForProcessRewardModel"]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f)
    return trunk, head


def _rank_work(dirs, tp, pp):
    from megaprm.models.hf_spec import spec_from_hf
    from megaprm.models.mapping import load_hf_weights
    from megaprm.models.prm import build_prm
    from megaprm.models.actor import build_stage
    from megaprm.parallel.init import init_distributed
    from megaprm.rollout import weight_sync
    from megaprm.rewards.scoring import PRMInputFormat, implicit_prm_rewards, score_rollouts

    g = init_distributed(tp=tp, pp=pp)
    rollouts = _rollouts()
    out = {}
    for head in ("token_cls", "prm_mlp"):
        spec = spec_from_hf(dirs[head])
        model = build_prm(spec, tp=tp, pp=pp, pp_rank=g.pp_rank)
        load_hf_weights(model, dirs[head], spec, tp_rank=g.tp_rank, tp_size=tp, pp=pp,
                        pp_rank=g.pp_rank)
        names = [n for n, _ in model.named_parameters()]
        assert all(n.split(".")[0] in ("embedding", "decoder", "score") for n in names), names
        assert any(n.startswith("score.") for n in names) == g.is_last_stage
        for fmt_name, fmt in (("raw", PRMInputFormat()), ("marker", PRMInputFormat(MARK))):
            scores, seg = score_rollouts(model, g, *rollouts, sep_ids={SEP}, fmt=fmt, head=head,
                                         micro_batch_size=2)
            out[(head, fmt_name)] = scores
        # prm.forward=released: PROF's left-padded micro-batches with no attention mask
        out[(head, "released")] = score_rollouts(model, g, *rollouts, sep_ids={SEP},
                                                 fmt=PRMInputFormat(), head=head,
                                                 micro_batch_size=2, forward="released")[0]
        # the HF export of the PRM stage-by-stage (weight sync) gives the checkpoint back
        out[(head, "weights")] = dict(weight_sync.iter_hf_weights(model, g))
        out["step_end_index"] = seg.step_end_index
    lms = []
    for name in ("lm_prm", "lm_ref"):
        spec = spec_from_hf(dirs[name])
        m = build_stage(spec, g)
        load_hf_weights(m, dirs[name], spec, tp_rank=g.tp_rank, tp_size=tp, pp=pp,
                        pp_rank=g.pp_rank)
        lms.append(m)
    out["implicit"] = implicit_prm_rewards(lms[0], lms[1], g, *rollouts, sep_ids={SEP},
                                           vocab_size=spec.vocab_size, micro_batch_size=2)
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prm")
    dirs = {"token_cls": str(root / "token_cls"), "prm_mlp": str(root / "prm_mlp"),
            "lm_prm": str(root / "lm_prm"), "lm_ref": str(root / "lm_ref")}
    save_tiny_model("qwen2", dirs["token_cls"], seed=5, head="token_cls")
    _save_prm_mlp(dirs["prm_mlp"], seed=6)
    save_tiny_model("qwen2", dirs["lm_prm"], seed=7)
    save_tiny_model("qwen2", dirs["lm_ref"], seed=8)
    return dirs


def _rows(marker=None):
    """Per row: the unpadded PRM input ids and the closing positions in it."""
    prompt_ids, prompt_mask, response_ids, response_mask = _rollouts()
    rows = []
    for i in range(prompt_ids.shape[0]):
        prompt = prompt_ids[i][prompt_mask[i]].tolist()
        resp = response_ids[i][response_mask[i]].tolist()
        ends = _closing_positions(resp)
        if marker is not None:
            resp = [marker if t in ends else tok for t, tok in enumerate(resp)]
        rows.append((prompt + resp, [len(prompt) + t for t in ends], len(prompt)))
    return rows


@pytest.fixture(scope="module")
def hf_reference(model_dirs):
    """Step scores and implicit rewards from transformers, row by row (no padding involved)."""
    import transformers as tf
    from safetensors.torch import load_file

    ref = {}
    tok_cls = tf.AutoModelForTokenClassification.from_pretrained(model_dirs["token_cls"],
                                                                 dtype=torch.float32).eval()
    sd = load_file(os.path.join(model_dirs["prm_mlp"], "model.safetensors"))
    trunk = build_hf_model(tiny_config("qwen2", head="token_cls"), 0).model
    trunk.load_state_dict({k[6:]: v for k, v in sd.items() if k.startswith("model.")})
    w = {k[6:]: v for k, v in sd.items() if k.startswith("score.")}

    def mlp_head(h):  # Qwen2.5-Math-PRM's score = Linear, ReLU, Linear (plain torch)
        return torch.relu(h @ w["0.weight"].T + w["0.bias"]) @ w["2.weight"].T + w["2.bias"]

    with torch.no_grad():
        for fmt_name, marker in (("raw", None), ("marker", MARK)):
            for head in ("token_cls", "prm_mlp"):
                per_row = []
                for ids, ends, _ in _rows(marker):
                    x = torch.tensor([ids])
                    if head == "token_cls":
                        logits = tok_cls(x).logits[0]
                    else:
                        logits = mlp_head(trunk(x).last_hidden_state[0])
                    p = torch.softmax(logits[ends], -1)
                    per_row.append(p[:, 1] - p[:, 0] if head == "token_cls" else p[:, 1])
                ref[(head, fmt_name)] = per_row
        # PROF-GRPO's released forward (prof_dp_rm.py:282-295): two rows at a time, left-padded
        # with pad id 0 to the longer one, called with input_ids only (no attention mask)
        rows, released = _rows(), []
        for a in range(0, len(rows), 2):
            pair = rows[a:a + 2]
            width = max(len(ids) for ids, _, _ in pair)
            x = torch.tensor([[0] * (width - len(ids)) + ids for ids, _, _ in pair])
            hidden = trunk(x).last_hidden_state
            for j, (ids, ends, _) in enumerate(pair):
                p = torch.softmax(mlp_head(hidden[j])[[e + width - len(ids) for e in ends]], -1)
                released.append(p[:, 1])
        ref[("prm_mlp", "released")] = released
        lms = [tf.AutoModelForCausalLM.from_pretrained(model_dirs[n], dtype=torch.float32).eval()
               for n in ("lm_prm", "lm_ref")]
        qs, steps = [], []
        for ids, ends, plen in _rows():
            x = torch.tensor([ids])
            lp = [torch.log_softmax(m(x).logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
                  for m in lms]
            q = (lp[0] - lp[1])[plen - 1:]  # response tokens plen.. are predicted at plen-1..
            qs.append(q)
            bounds = [plen - 1] + ends
            steps.append(torch.stack([q[a - plen + 1: b - plen + 1].sum()
                                      for a, b in zip(bounds[:-1], bounds[1:])]))
        ref["implicit"] = (qs, steps)
    return ref


_CACHE = {}


def _results(model_dirs, layout):
    if layout not in _CACHE:
        tp, pp = layout
        _CACHE[layout] = launch.spawn(_rank_work, tp * pp, model_dirs, tp, pp)
    return _CACHE[layout]


def _check_against_reference(result, ref):
    for key in [("token_cls", "raw"), ("token_cls", "marker"), ("prm_mlp", "raw"),
                ("prm_mlp", "marker")]:
        scores = result[key]
        for i, expected in enumerate(ref[key]):
            n = len(expected)
            assert scores.step_mask[i].sum() == n
            assert torch.allclose(scores.scores[i, :n], expected, atol=TOL, rtol=0), (key, i)
    qs, steps = ref["implicit"]
    imp = result["implicit"]
    for i, (q, s) in enumerate(zip(qs, steps)):
        assert torch.allclose(imp.q[i, : len(q)], q, atol=TOL, rtol=0), i
        assert (imp.q[i, len(q):] == 0).all()
        assert torch.allclose(imp.steps.scores[i, : len(s)], s, atol=TOL, rtol=0), i


def test_single_process_matches_transformers(model_dirs, hf_reference):
    (result,) = _results(model_dirs, (1, 1))
    _check_against_reference(result, hf_reference)
    # prm.forward=released equals the left-padded, unmasked HF forward, and differs from the
    # exact (compact) scores in rows that were padded
    released, compact = result[("prm_mlp", "released")], result[("prm_mlp", "raw")]
    differ = 0
    for i, expected in enumerate(hf_reference[("prm_mlp", "released")]):
        n = len(expected)
        assert torch.allclose(released.scores[i, :n], expected, atol=TOL, rtol=0), i
        differ += not torch.allclose(released.scores[i, :n], compact.scores[i, :n], atol=1e-4)
    assert differ > 0
    # exported weights: the checkpoint back, under HF names (score.* included, no lm_head)
    from safetensors.torch import load_file

    for head in ("token_cls", "prm_mlp"):
        saved = load_file(os.path.join(model_dirs[head], "model.safetensors"))
        exported = result[(head, "weights")]
        assert set(exported) == set(saved)
        for k, v in saved.items():
            assert torch.equal(exported[k], v), k


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda l: "tp%d-pp%d" % l)
def test_parallel_layouts_match_single_process(model_dirs, hf_reference, layout):
    (single,) = _results(model_dirs, (1, 1))
    for r in _results(model_dirs, layout):  # every rank holds the result
        for key in [("token_cls", "raw"), ("token_cls", "marker"), ("prm_mlp", "raw"),
                    ("prm_mlp", "marker")]:
            assert torch.equal(r[key].step_mask, single[key].step_mask)
            assert (r[key].scores - single[key].scores).abs().max() <= TOL, key
        assert (r["implicit"].q - single["implicit"].q).abs().max() <= TOL
        assert (r["implicit"].steps.scores - single["implicit"].steps.scores).abs().max() <= TOL
        _check_against_reference(r, hf_reference)
