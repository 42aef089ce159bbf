import random

from transformers import AutoTokenizer

from megaprm.tasks.arithmetic import (
    CORRUPTION_KINDS,
    ArithmeticConfig,
    corrupt_solution,
    generate_problems,
    reference_solution,
)
from megaprm.tasks.tokenizer import STEP_SEP, build_char_tokenizer


def _task_texts(n=300):
    rng = random.Random(0)
    texts = []
    for cfg in (ArithmeticConfig(), ArithmeticConfig(ops="+-*", allow_negative=True, num_ops=(1, 6))):
        for p in generate_problems(cfg, n, seed=1):
            texts += [p.prompt, reference_solution(p), corrupt_solution(p, rng, rng.choice(CORRUPTION_KINDS))]
    return texts


def test_vocab_and_special_tokens():
    tok = build_char_tokenizer()
    assert len(tok) < 64
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.padding_side == "left"
    assert tok.encode("1+2=") == tok.encode("1+2=", add_special_tokens=True)  # nothing added


def test_round_trip_on_task_texts():
    tok = build_char_tokenizer()
    for text in _task_texts() + ["", "b o x\n\n\n", "\n", "(1/2)^3.5, 7?"]:
        ids = tok.encode(text)
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text


def test_step_separator_is_one_token():
    tok = build_char_tokenizer()
    sep = tok.convert_tokens_to_ids(STEP_SEP)
    assert tok.encode(STEP_SEP) == [sep]
    assert tok.encode("\n") == [tok.convert_tokens_to_ids("\n")] != [sep]
    ids = tok.encode("1+1=2\n\n2+1=3\n\n\\boxed{3}")
    assert ids.count(sep) == 2
    # left to right, like str.split: "\n\n\n" -> "\n\n" then "\n"
    assert tok.convert_ids_to_tokens(tok.encode("\n\n\n")) == ["\n\n", "\n"]


def test_unknown_characters_map_to_unk():
    tok = build_char_tokenizer()
    assert tok.encode("1Z") == [tok.convert_tokens_to_ids("1"), tok.unk_token_id]


def test_save_load_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = build_char_tokenizer(save_dir=tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    for text in _task_texts(50):
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    batch = loaded(["1+2=", "10+20-3="], padding=True)
    assert batch["input_ids"][0][:4] == [tok.pad_token_id] * 4  # left padding
