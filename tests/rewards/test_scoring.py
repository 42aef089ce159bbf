"""PRM input layout and step-score math against slow, obvious loops (random shapes and seeds).

The model side (any tp/pp vs transformers) is tests/models/test_prm.py.
"""
import pytest
import torch

from megaprm.models.prm import (gather_positions, head_step_scores, implicit_step_scores,
                                implicit_token_rewards)
from megaprm.rewards.scoring import PRMInputFormat, batch_from_rollouts, micro_batches

SEP, MARK = 4, 5


def _random_rollouts(seed, B=6, P=7, T=15):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(6, 30, (B, P), generator=g)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    response_ids = torch.randint(6, 30, (B, T), generator=g)
    response_ids[torch.rand(B, T, generator=g) < 0.25] = SEP
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        n_p = int(torch.randint(1, P + 1, (1,), generator=g))
        n_r = int(torch.randint(0 if i == 0 else 1, T + 1, (1,), generator=g))
        prompt_mask[i, P - n_p:] = True  # left-padded prompt
        response_mask[i, :n_r] = True     # right-padded response
    return prompt_ids, prompt_mask, response_ids, response_mask


def _loop_layout(prompt_ids, prompt_mask, response_ids, response_mask, marker):
    """Per row: PRM input ids and the positions of each step's closing token, by hand."""
    rows = []
    for i in range(prompt_ids.shape[0]):
        prompt = prompt_ids[i][prompt_mask[i]].tolist()
        resp = response_ids[i][response_mask[i]].tolist()
        ends = [t for t, tok in enumerate(resp) if tok == SEP or t == len(resp) - 1]
        if marker is not None:
            resp = [marker if t in ends else tok for t, tok in enumerate(resp)]
        rows.append((prompt + resp, [len(prompt) + t for t in ends]))
    return rows


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("marker", [None, MARK])
def test_prm_batch_matches_loop(seed, marker):
    rollouts = _random_rollouts(seed)
    batch, seg = batch_from_rollouts(*rollouts, {SEP}, PRMInputFormat(marker), pad_id=0)
    for i, (ids, ends) in enumerate(_loop_layout(*rollouts, marker)):
        assert batch.lengths[i] == len(ids)
        assert batch.input_ids[i, : len(ids)].tolist() == ids
        assert (batch.input_ids[i, len(ids):] == 0).all()
        assert batch.step_mask[i].sum() == len(ends)
        assert batch.score_index[i, : len(ends)].tolist() == ends
        assert seg.num_steps[i] == len(ends)


def test_micro_batches_pad_rows_for_pipeline():
    batch, _ = batch_from_rollouts(*_random_rollouts(0, B=5), {SEP}, PRMInputFormat())
    labels = torch.ones_like(batch.step_mask, dtype=torch.long)
    mbs = micro_batches(batch, 2, pp=2, labels=labels)
    assert [mb.input_ids.shape[0] for mb in mbs] == [2, 2, 2]
    assert not mbs[-1].payload[1][1].any()  # the padding row has no steps
    assert [mb.input_ids.shape[0] for mb in micro_batches(batch, 2, pp=1)] == [2, 2, 1]


@pytest.mark.parametrize("head", ["token_cls", "prm_mlp"])
def test_head_step_scores(head):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 9, 2, generator=g)
    mask = torch.rand(4, 9, generator=g) < 0.7
    out = head_step_scores(logits, mask, head, keep_logits=True)
    for i in range(4):
        for k in range(9):
            p0, p1 = torch.softmax(logits[i, k], -1).tolist()
            expected = (p1 - p0 if head == "token_cls" else p1) if mask[i, k] else 0.0
            assert abs(float(out.scores[i, k]) - expected) < 1e-6
    assert torch.equal(out.logits, logits)


def test_gather_positions():
    x = torch.randn(3, 8, 2)
    index = torch.tensor([[0, 7], [3, 3], [5, 1]])
    out = gather_positions(x, index)
    for i in range(3):
        for k in range(2):
            assert torch.equal(out[i, k], x[i, index[i, k]])


@pytest.mark.parametrize("seed", range(3))
def test_implicit_step_scores_sum_q_over_each_step(seed):
    rollouts = _random_rollouts(seed)
    _, _, response_ids, response_mask = rollouts
    _, seg = batch_from_rollouts(*rollouts, {SEP}, PRMInputFormat())
    g = torch.Generator().manual_seed(seed)
    lp_a, lp_b = torch.randn(2, *response_ids.shape, generator=g)
    q = implicit_token_rewards(lp_a, lp_b, response_mask)
    steps = implicit_step_scores(q, seg.token_to_step, seg.step_mask)
    for i in range(response_ids.shape[0]):
        n = int(response_mask[i].sum())
        assert torch.allclose(q[i, :n], lp_a[i, :n] - lp_b[i, :n])
        assert (q[i, n:] == 0).all()
        sums, acc = [], 0.0
        for t in range(n):  # a step closes at a separator or at the last token
            acc += float(q[i, t])
            if int(response_ids[i, t]) == SEP or t == n - 1:
                sums.append(acc)
                acc = 0.0
        assert steps.step_mask[i].sum() == len(sums)
        assert torch.allclose(steps.scores[i, : len(sums)], torch.tensor(sums), atol=1e-5)


def test_input_format_round_trips_through_hf_config():
    for fmt in (PRMInputFormat(), PRMInputFormat(MARK)):
        assert PRMInputFormat.from_hf(fmt.to_hf()) == fmt
    assert PRMInputFormat.from_hf({"architectures": ["Qwen2ForTokenClassification"]}) \
        == PRMInputFormat()


# ------------------------------------------------------------------ named PRM input formats

import json  # noqa: E402
import re  # noqa: E402
import string  # noqa: E402

from megaprm.errors import ConfigError  # noqa: E402
from megaprm.rewards.scoring import (PROF_PRM_SYSTEM, ChatStepFormat,  # noqa: E402
                                     chat_batch_from_rollouts, resolve_prm_input_format)

# Qwen2.5's special tokens, the PRM's step token, and a ChatML template of the same shape as the
# Qwen2.5-Math-PRM tokenizer's (one "<|im_start|>role\n...<|im_end|>\n" block per message).
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<extra_0>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _qwen_like_tokenizer(save_dir):
    """A character-level fast tokenizer carrying Qwen2.5-Math-PRM's special tokens and a ChatML
    template, saved in HF format and loaded back the way the resolver loads it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(QWEN_SPECIALS + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(QWEN_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>",
                                  eos_token="<|im_end|>", clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    tok.save_pretrained(str(save_dir))
    with open(save_dir / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen2ForProcessRewardModel"], "model_type": "qwen2"}, f)
    return PreTrainedTokenizerFast.from_pretrained(str(save_dir)), vocab


def _by_hand_ids(text, vocab):
    """Independent tokenisation: special tokens whole, every other character on its own."""
    ids = []
    for piece in re.split("(" + "|".join(re.escape(s) for s in QWEN_SPECIALS) + ")", text):
        ids += [vocab[piece]] if piece in QWEN_SPECIALS else [vocab[c] for c in piece]
    return ids


def test_qwen25_math_prm_input_as_released(tmp_path):
    """prof_dp_rm.py:264-299: decode without special tokens, drop PROF's (double-brace) system
    string from the prompt text, split the response into PROF steps, "<extra_0>" after each,
    chat template with the system message; scores read at every "<extra_0>"."""
    tok, vocab = _qwen_like_tokenizer(tmp_path)
    fmt = resolve_prm_input_format("auto", str(tmp_path))
    assert isinstance(fmt, ChatStepFormat) and fmt.name == "qwen25_math_prm"
    assert resolve_prm_input_format("qwen25_math_prm", str(tmp_path)) == fmt
    system = "Please reason step by step, and put your final answer within \\boxed{}."
    prompt = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
              "<|im_start|>assistant\n")
    responses = ["\n\nOne plus one.\n\n\n\nSo \\boxed{2}.\n\n", "", "no separators at all"]
    P = len(_by_hand_ids(prompt, vocab))
    resp_ids = [_by_hand_ids(r, vocab) + [vocab["<|im_end|>"]] for r in responses]
    T = max(map(len, resp_ids)) + 2
    pad = vocab["<|endoftext|>"]
    prompt_ids = torch.tensor([[pad] * 3 + _by_hand_ids(prompt, vocab)] * 3)  # left-padded
    prompt_mask = torch.tensor([[False] * 3 + [True] * P] * 3)
    response_ids = torch.full((3, T), pad)
    response_mask = torch.zeros(3, T, dtype=torch.bool)
    for i, r in enumerate(resp_ids):
        response_ids[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = True
    batch = chat_batch_from_rollouts(prompt_ids, prompt_mask, response_ids, response_mask, fmt)

    # the released system string keeps "{{}}", so it is not found in the decoded prompt and the
    # role words stay in the query (research notes §3.1)
    assert PROF_PRM_SYSTEM.endswith("\\boxed{{}}.")
    query = f"system\n{system}\nuser\nWhat is 1+1?\nassistant"
    steps = [["One plus one.", "So \\boxed{2}."], [""], ["no separators at all"]]
    for i in range(3):
        want = (f"<|im_start|>system\n{PROF_PRM_SYSTEM}<|im_end|>\n<|im_start|>user\n{query}"
                f"<|im_end|>\n<|im_start|>assistant\n"
                + "".join(s + "<extra_0>" for s in steps[i]) + "<|im_end|>\n")
        ids = _by_hand_ids(want, vocab)
        assert batch.lengths[i] == len(ids)
        assert batch.input_ids[i, : len(ids)].tolist() == ids
        marks = [t for t, x in enumerate(ids) if x == vocab["<extra_0>"]]
        assert batch.step_mask[i].sum() == len(steps[i])
        assert batch.score_index[i, : len(marks)].tolist() == marks


def test_qwen25_math_prm_caps_steps_and_truncates(tmp_path):
    tok, vocab = _qwen_like_tokenizer(tmp_path)
    fmt = resolve_prm_input_format("qwen25_math_prm", str(tmp_path))
    from megaprm.rewards.scoring import build_chat_prm_batch

    long = "\n\n".join("s" for _ in range(130))
    b = build_chat_prm_batch(["q"], [long], fmt)
    assert int(b.step_mask.sum()) == 100  # released make_step_rewards keeps 100 columns
    short = ChatStepFormat(tokenizer=tok, max_length=150)
    b = build_chat_prm_batch(["q"], [long], short)
    assert b.lengths.tolist() == [150]  # right truncation, as the released tokenizer call
    n_marks = _by_hand_ids(short.conversation("q", long), vocab)[:150].count(vocab["<extra_0>"])
    assert int(b.step_mask.sum()) == n_marks and 0 < n_marks < 100


def _pure_released_layout(prompt, resp, sep_ids, eos_index, newline):
    """CJReinforce/PURE experience_maker.py:300-316 and 831-852 as a loop: score_ids = each
    separator position + 1, then the EOS index + 1; step tokens solution[prev:j-1], then '\\n'.
    Returns (PRM input ids, positions read: score_ids - 1 + prompt length)."""
    score_ids = [t + 1 for t, x in enumerate(resp) if x in sep_ids] + [eos_index + 1]
    ids, prev = list(prompt), 0
    for j in score_ids:
        ids += resp[prev:j - 1] + [newline]
        prev = j
    return ids, [j - 1 + len(prompt) for j in score_ids]


def test_pure_input_as_released(tmp_path):
    """PURE's PRM sees the policy prompt, each step without its "\\n\\n" closing token, then one
    "\\n" token; read at the "\\n" (resolved by name from a tokenizer where "\\n" is one token)."""
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(tmp_path)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen2ForTokenClassification"], "model_type": "qwen2"}, f)
    fmt = resolve_prm_input_format("pure", str(tmp_path), tokenizer=tok)
    newline = tok.convert_tokens_to_ids("\n")
    assert fmt == PRMInputFormat(step_marker_id=newline)
    sep = tok.convert_tokens_to_ids("\n\n")
    texts = ["1+1=2\n\n2+2=4\n\n\\boxed{4}", "\n\n3\n\n\n\n4", "5"]
    eos = tok.eos_token_id
    prompt = tok("what is 2+2?\n\n", add_special_tokens=False).input_ids
    rows = [tok(t, add_special_tokens=False).input_ids + [eos] for t in texts]
    T = max(map(len, rows))
    response_ids = torch.full((3, T), tok.pad_token_id)
    response_mask = torch.zeros(3, T, dtype=torch.bool)
    for i, r in enumerate(rows):
        response_ids[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = True
    prompt_ids = torch.tensor([prompt] * 3)
    batch, _ = batch_from_rollouts(prompt_ids, torch.ones_like(prompt_ids, dtype=torch.bool),
                                   response_ids, response_mask, {sep}, fmt,
                                   pad_id=tok.pad_token_id)
    for i, r in enumerate(rows):
        ids, reads = _pure_released_layout(prompt, r, {sep}, len(r) - 1, newline)
        assert batch.input_ids[i, : len(ids)].tolist() == ids
        assert batch.score_index[i][batch.step_mask[i]].tolist() == reads
        assert all(batch.input_ids[i, p] == newline for p in reads)


def test_input_format_resolution_refuses_to_guess(tmp_path):
    def write(arch, **extra):
        with open(tmp_path / "config.json", "w") as f:
            json.dump({"architectures": [arch], "model_type": "qwen2", **extra}, f)

    write("Qwen2ForTokenClassification")  # PURE's PRM or any downloaded token classifier
    with pytest.raises(ConfigError, match="qwen25_math_prm, pure, raw, megaprm"):
        resolve_prm_input_format("auto", str(tmp_path))
    with pytest.raises(ConfigError, match="no 'megaprm_prm_input' record"):
        resolve_prm_input_format("megaprm", str(tmp_path))
    with pytest.raises(ConfigError, match="one of auto, qwen25_math_prm"):
        resolve_prm_input_format("chatml", str(tmp_path))
    assert resolve_prm_input_format("raw", str(tmp_path)) == PRMInputFormat()
    with pytest.raises(ConfigError, match="needs the PRM's tokenizer"):
        resolve_prm_input_format("pure", str(tmp_path))
    write("Qwen2ForProcessRewardModel")  # the right head, but no tokenizer to confirm it
    with pytest.raises(ConfigError, match="set prm.input_format"):
        resolve_prm_input_format("auto", str(tmp_path))
    # a PRM written by megaprm train-prm records its format: auto and megaprm read it
    write("Qwen2ForTokenClassification", **PRMInputFormat(MARK).to_hf())
    assert resolve_prm_input_format("auto", str(tmp_path)) == PRMInputFormat(MARK)
    assert resolve_prm_input_format("megaprm", str(tmp_path)) == PRMInputFormat(MARK)
    from megaprm.config import load_config
    with pytest.raises(ConfigError, match="prm.input_format='nope'"):
        load_config(None, ["prm.input_format=nope"])
