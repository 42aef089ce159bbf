"""Whether a PRM can read the policy's text, checked before any rank starts: its tokenizer must
give every policy token the same id (it may add its own, as Qwen2.5-Math-PRM's <extra_0>), its
embedding must have a row for every id, and a PRM megaprm trained is scored only in the layout it
recorded. The case of issue 50: the demo's 36-symbol character PRM under a Qwen2.5 policy (it
scored 0.0003 at every step, exit 0) is one line, exit 2."""
import json
import os
import shutil

import pytest

from megaprm.errors import ConfigError
from megaprm.rewards.prm_input import (
    HF_CONFIG_KEY,
    ChatStepFormat,
    PRMInputFormat,
    check_prm_reads_policy,
    resolve_prm_input_format,
)
from tests.qwen25 import qwen25_tokenizer
from tests.test_megaprm_cli import FAST, MEGAPRM, ROOT, one_line_error, run

CHAR_PRM = os.path.join(ROOT, "megaprm", "assets", "demo", "prm")  # the demo's PRM (char vocab)


@pytest.fixture(scope="module")
def qwen_policy(tmp_path_factory):
    """A tiny Qwen2.5-shaped policy with the real Qwen2.5 tokenizer (tests/qwen25.py)."""
    from megaprm.models.tiny import save_tiny_model

    tok = qwen25_tokenizer()
    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("qwen") / "policy"),
                           tokenizer=tok, vocab_size=len(tok), hidden_size=32, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=64,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def test_the_char_prm_cannot_read_a_qwen_policy(qwen_policy):
    with pytest.raises(ConfigError) as e:
        check_prm_reads_policy(CHAR_PRM, qwen_policy, prm_vocab_size=36)
    msg = str(e.value)
    assert "\n" not in msg and "has 36 embedding rows" in msg and "train-prm" in msg
    # without the embedding size: the tokenizers alone tell
    with pytest.raises(ConfigError, match=r"reads another vocabulary than the policy .* tokens "
                                          r"have another id or none in the PRM's \d+-token"):
        check_prm_reads_policy(CHAR_PRM, qwen_policy)


def test_same_vocabulary_passes_and_an_added_step_token_is_allowed(qwen_policy, tmp_path):
    tok = qwen25_tokenizer()  # the policy's, plus <extra_0> at the end
    check_prm_reads_policy(qwen_policy, qwen_policy, prm_vocab_size=len(tok))
    # a PRM tokenizer with one more token than the policy's reads every policy id the same
    small = tmp_path / "small"
    shutil.copytree(qwen_policy, small)
    cfg = json.loads((small / "tokenizer.json").read_text())
    cfg["added_tokens"] = [t for t in cfg["added_tokens"] if t["content"] != "<extra_0>"]
    (small / "tokenizer.json").write_text(json.dumps(cfg))
    check_prm_reads_policy(qwen_policy, str(small))  # PRM has <extra_0>, the policy does not
    with pytest.raises(ConfigError, match="reads another vocabulary"):  # the other way round
        check_prm_reads_policy(str(small), qwen_policy)
    # one id moved is enough to refuse
    moved = tmp_path / "moved"
    shutil.copytree(qwen_policy, moved)
    cfg = json.loads((moved / "tokenizer.json").read_text())
    vocab = cfg["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (moved / "tokenizer.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"2 of the policy's \d+ tokens .*e\.g\. \['a', 'b'\]"):
        check_prm_reads_policy(str(moved), qwen_policy)


def test_a_megaprm_prm_is_scored_in_the_layout_it_recorded(qwen_policy, tmp_path):
    """train-prm records the layout; naming another one (qwen25_math_prm's chat layout for a PRM
    trained on raw tokens) is refused, auto and megaprm read the record."""
    prm = tmp_path / "prm"
    shutil.copytree(qwen_policy, prm)
    cfg = json.loads((prm / "config.json").read_text())
    cfg["architectures"] = ["Qwen2ForTokenClassification"]
    cfg.update(PRMInputFormat().to_hf())
    (prm / "config.json").write_text(json.dumps(cfg))
    assert resolve_prm_input_format("auto", str(prm)) == PRMInputFormat()
    assert resolve_prm_input_format("raw", str(prm)) == PRMInputFormat()  # the same layout
    tok = qwen25_tokenizer()  # has <extra_0> and Qwen2.5-Math's chat template
    assert isinstance(resolve_prm_input_format("qwen25_math_prm", qwen_policy, tokenizer=tok),
                      ChatStepFormat)  # no record: the name is taken as given
    for name in ("qwen25_math_prm", "pure"):
        with pytest.raises(ConfigError, match=rf"prm.input_format={name} would feed the PRM .* "
                                              rf"another layout .*{HF_CONFIG_KEY}.*auto"):
            resolve_prm_input_format(name, str(prm))


def test_char_prm_with_a_qwen_policy_is_one_line_before_ranks(qwen_policy, tmp_path):
    """As the user of issue 50 typed it (PROF-GRPO's tiny recipe, the demo's PRM, 2 ranks)."""
    p = run([*MEGAPRM, "train", "--config", "configs/prof_grpo_tiny.yaml", "--nproc", "2",
             f"model.path={qwen_policy}", f"prm.path={CHAR_PRM}", "prm.input_format=auto",
             f"trainer.run_dir={tmp_path / 'run'}", *FAST], timeout=300)
    one_line_error(p, "megaprm train: error: prm.path=", "has 36 embedding rows",
                   "megaprm train-prm")
    assert not (tmp_path / "run").exists() and "rank" not in p.stdout
