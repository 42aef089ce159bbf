import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megaprm.rewards.steps import build_prm_inputs, segment_steps, separator_token_ids
from megaprm.tasks.arithmetic import (
    ArithmeticConfig,
    generate_problems,
    reference_solution,
    split_steps,
)
from megaprm.tasks.tokenizer import build_char_tokenizer

# a tiny vocabulary with merged separators, like a BPE vocab (".\n\n", "\n\n\n", "b\n\n")
MERGED_VOCAB = ["<pad>", "<eos>", "a", "b", ".", "\n", "\n\n", ".\n\n", "\n\n\n", "b\n\n", "\n\na"]


def merged_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(MERGED_VOCAB)}, unk_token="<pad>"))
    pieces = sorted(MERGED_VOCAB[2:], key=len, reverse=True)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(p.replace(".", "\\.") for p in pieces)), "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<pad>", "<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


TOK = merged_tokenizer()
SEP_IDS = separator_token_ids(TOK)


def reference_segmentation(ids, mask, tok, sep="\n\n"):
    """Slow loop: decode each valid token; a token whose text ends with sep, or the last valid
    token, closes a step. Returns per row: list of (closing position, L_k), token -> step."""
    rows, t2s = [], []
    for b in range(ids.shape[0]):
        valid = [t for t in range(ids.shape[1]) if mask[b, t]]
        steps, length, step_of = [], 0, [-1] * ids.shape[1]
        for j, t in enumerate(valid):
            step_of[t] = len(steps)
            if tok.decode([int(ids[b, t])]).endswith(sep) or j == len(valid) - 1:
                steps.append((t, length))
                length = 0
            else:
                length += 1
        rows.append(steps)
        t2s.append(step_of)
    return rows, t2s


def check_against_reference(ids, mask):
    seg = segment_steps(ids, mask, SEP_IDS)
    rows, t2s = reference_segmentation(ids, mask, TOK)
    assert seg.token_to_step.tolist() == t2s
    assert seg.num_steps.tolist() == [len(r) for r in rows]
    assert seg.step_mask.shape[1] == max([1] + [len(r) for r in rows])
    for b, steps in enumerate(rows):
        K = len(steps)
        assert seg.step_mask[b].tolist() == [k < K for k in range(seg.step_mask.shape[1])]
        assert seg.step_end_index[b, :K].tolist() == [t for t, _ in steps]
        assert seg.step_lengths[b, :K].tolist() == [n for _, n in steps]
        assert not seg.step_end_index[b, K:].any() and not seg.step_lengths[b, K:].any()
        assert int(seg.step_lengths[b].sum()) == int(mask[b].sum()) - K  # sum L_k = |y| - K
        assert seg.is_step_end[b].nonzero().flatten().tolist() == [t for t, _ in steps]
    return seg


def test_separator_ids_include_merged_tokens():
    assert {MERGED_VOCAB[i] for i in SEP_IDS} == {"\n\n", ".\n\n", "\n\n\n", "b\n\n"}  # not "\n\na"
    char = build_char_tokenizer()
    assert separator_token_ids(char) == {char.convert_tokens_to_ids("\n\n")}


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda B: st.integers(0, 12).flatmap(
            lambda T: st.tuples(
                st.lists(st.lists(st.integers(0, len(MERGED_VOCAB) - 1), min_size=T, max_size=T), min_size=B, max_size=B),
                st.lists(st.integers(0, T), min_size=B, max_size=B),
                st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B),
                st.booleans(),
            )
        )
    )
)
def test_matches_loop_reference(data):
    ids_list, lengths, holes, use_holes = data
    ids = torch.tensor(ids_list, dtype=torch.long).reshape(len(ids_list), -1)
    T = ids.shape[1]
    if use_holes:  # arbitrary masks, not just right padding
        mask = torch.tensor(holes, dtype=torch.bool).reshape(len(ids_list), T)
    else:
        mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    check_against_reference(ids, mask)


def _batch(token_lists):
    T = max(len(t) for t in token_lists)
    ids = torch.tensor([t + [0] * (T - len(t)) for t in token_lists])
    mask = torch.tensor([[1] * len(t) + [0] * (T - len(t)) for t in token_lists]).bool()
    return ids, mask


def test_explicit_cases():
    v = {t: i for i, t in enumerate(MERGED_VOCAB)}
    a, b, dot, sep, dsep, eos = v["a"], v["b"], v["."], v["\n\n"], v[".\n\n"], v["<eos>"]
    ids, mask = _batch(
        [
            [a, dsep, b, eos],  # merged separator: 2 steps, L = [1, 1]
            [a, sep, sep, b, eos],  # empty step in the middle: L = [1, 0, 1]
            [a, b, dot, eos],  # no separator: one step ending at EOS
            [a, sep, b, b],  # truncated (no EOS): last step ends at the cut
            [a, b, sep],  # truncated right after a separator: it closes the final step
            [eos],  # EOS only: one empty step
            [],  # empty response: no steps
        ]
    )
    seg = check_against_reference(ids, mask)
    assert seg.num_steps.tolist() == [2, 3, 1, 2, 1, 1, 0]
    assert seg.step_lengths[0, :2].tolist() == [1, 1] and seg.step_end_index[0, :2].tolist() == [1, 3]
    assert seg.step_lengths[1, :3].tolist() == [1, 0, 1]
    assert seg.step_end_index[2, 0].item() == 3 and seg.step_lengths[2, 0].item() == 3
    assert seg.step_end_index[3, :2].tolist() == [1, 3] and seg.step_lengths[3, :2].tolist() == [1, 1]
    assert seg.step_end_index[4, 0].item() == 2 and seg.step_lengths[4, 0].item() == 2
    assert seg.step_lengths[5, 0].item() == 0 and not seg.step_mask[6].any()
    assert seg.token_to_step[6].tolist() == [-1] * ids.shape[1]


def test_trailing_separator_closes_the_final_step():
    v = {t: i for i, t in enumerate(MERGED_VOCAB)}
    ids, mask = _batch([[v["a"], v["\n\n"], v["b"], v["\n\n"]]])
    seg = check_against_reference(ids, mask)
    assert seg.num_steps.tolist() == [2]
    assert seg.step_end_index[0].tolist() == [1, 3] and seg.step_lengths[0].tolist() == [1, 1]


def test_all_empty_batch_and_zero_width():
    seg = segment_steps(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0, dtype=torch.bool), SEP_IDS)
    assert seg.num_steps.tolist() == [0, 0, 0] and seg.step_mask.shape == (3, 1) and not seg.step_mask.any()


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.booleans(), st.floats(0.0, 1.0))
def test_token_steps_match_text_steps_on_arithmetic(seed, add_eos, cut):
    """segment_steps on tokens and arithmetic.split_steps on text give the same steps."""
    tok = build_char_tokenizer()
    text = reference_solution(generate_problems(ArithmeticConfig(), 1, seed=seed)[0])
    text = text[: round(cut * len(text))] if not add_eos else text
    ids_list = tok.encode(text) + ([tok.eos_token_id] if add_eos else [])
    ids, mask = _batch([ids_list])
    seg = segment_steps(ids, mask, separator_token_ids(tok))
    steps = []
    for k in range(int(seg.num_steps[0])):
        positions = (seg.token_to_step[0] == k).nonzero().flatten().tolist()
        closing = ids_list[positions[-1]]
        if closing in (tok.eos_token_id, tok.convert_tokens_to_ids("\n\n")):
            positions = positions[:-1]  # the text of a step excludes its separator / EOS
        steps.append(tok.decode([ids_list[t] for t in positions]))
    assert steps == split_steps(text, ends_with_eos=add_eos)


def test_build_prm_inputs():
    v = {t: i for i, t in enumerate(MERGED_VOCAB)}
    newline = v["\n"]
    ids, mask = _batch([[v["a"], v[".\n\n"], v["b"], v["<eos>"]], [v["a"], v["b"]]])
    seg = segment_steps(ids, mask, SEP_IDS)
    prompt = torch.tensor([[0, v["a"]], [v["b"], v["a"]]])
    prompt_mask = torch.tensor([[0, 1], [1, 1]]).bool()
    out = build_prm_inputs(prompt, ids, seg, newline, prompt_mask=prompt_mask)
    # the merged ".\n\n" becomes a lone "\n" (its "." is lost, as in PURE); EOS becomes "\n"
    assert out.input_ids[0].tolist() == [0, v["a"], v["a"], newline, v["b"], newline]
    assert out.input_ids[1].tolist() == [v["b"], v["a"], v["a"], newline, 0, 0]
    assert out.attention_mask.tolist() == [[False, True, True, True, True, True], [True, True, True, True, False, False]]
    assert out.score_index.tolist() == [[3, 5], [3, 0]] and out.step_mask.tolist() == [[True, True], [True, False]]
    assert (out.input_ids.gather(1, out.score_index)[out.step_mask] == newline).all()
    # every non-closing response token is unchanged
    keep = mask & ~seg.is_step_end
    assert torch.equal(out.input_ids[:, 2:][keep], ids[keep])


# ------------------------------------------------------------------ PROF's text step count (H_i)

from megaprm.rewards.steps import PROF_MAX_STEPS, prof_num_steps, prof_steps  # noqa: E402


def test_prof_num_steps_released_cases():
    """Pinned to prof_dp_rm.py:272 (split the stripped text on "\\n\\n", strip, drop empties,
    an empty response is one step) and :230 (100 score columns)."""
    cases = {
        "a\n\nb": 2,
        "a\n\nb\n\n": 2,            # trailing separator: no empty last step (token count: 3)
        "\n\na\n\nb": 2,            # leading separator: no empty first step
        "a\n\n\n\nb": 2,            # double separator: the empty piece is dropped
        "a\n\n \n\nb": 2,           # a whitespace-only piece is empty after strip
        "a\n\n\nb": 2,              # "\n\n\n": the piece "\nb" strips to "b"
        "one step only": 1,
        "": 1,                      # nothing left: the whole (empty) response is one step
        "\n\n\n\n": 1,
        "\n\n".join(f"s{i}" for i in range(150)): PROF_MAX_STEPS,
        "\n\n".join(f"s{i}" for i in range(100)): 100,
        "\n\n".join(f"s{i}" for i in range(99)): 99,
    }
    got = prof_num_steps(list(cases))
    assert got.dtype == torch.long
    assert got.tolist() == list(cases.values())
    assert prof_steps("  x \n\n\n\n y\n\n") == ["x", "y"]
    assert prof_num_steps(["a\n\nb\n\nc"], max_steps=2).tolist() == [2]


def _scan_steps(text):
    """Independent reference: scan characters, cutting at every "\\n\\n" of the stripped text
    (non-overlapping, left to right); count the pieces with a non-space character."""
    t = text.strip()
    pieces, cur, i = [], "", 0
    while i < len(t):
        if t[i:i + 2] == "\n\n":
            pieces.append(cur)
            cur, i = "", i + 2
        else:
            cur, i = cur + t[i], i + 1
    pieces.append(cur)
    n = sum(1 for p in pieces if any(not c.isspace() for c in p))
    return max(n, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", " ", "\n", "\n\n", "\t", "."]), max_size=40))
def test_prof_num_steps_matches_scan(parts):
    text = "".join(parts)
    assert prof_num_steps([text]).item() == min(_scan_steps(text), PROF_MAX_STEPS)
