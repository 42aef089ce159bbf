"""`megaprm data` (tasks.convert): a plain question file written in each paper's released row
layout. With the real Qwen2.5 tokenizer, the converted file and the plain one give every recipe
the same prompts (and the released rows' fields); refusals leave every file as it was."""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megaprm import cli
from megaprm.config import load_config
from megaprm.trainer.rl.data import make_data
from tests.qwen25 import qwen25_tokenizer
from tests.tasks.test_prompt_format import PRIME_SYSTEM, PRIME_USER, QUESTION

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PLAIN = [{"problem": QUESTION, "answer": "5", "solution": "Since $3 \\cdot 5 = 15$, n=5."},
         {"question": "What is $1+1$?", "answer": 2},
         {"problem": "Compute $\\frac{1}{2}+\\frac{1}{3}$.", "solution": "It is $\\boxed{\\frac56}$."}]


@pytest.fixture(scope="module")
def tok():
    return qwen25_tokenizer()


def _texts(recipe, path, tok):
    cfg = load_config(str(CONFIGS / f"{recipe}.yaml"),
                      [f"data.path={path}", "data.prompts_per_step=3", "data.on_bad_row=error"])
    return make_data(cfg, tok)(0).texts


@pytest.mark.parametrize("recipe, suffix", [("prime", ".parquet"), ("prof_grpo", ".parquet"),
                                            ("papo", ".parquet"), ("pure", ".jsonl")])
def test_converted_rows_are_the_release_layout_and_prompt_the_same(recipe, suffix, tok,
                                                                   tmp_path, capsys):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in PLAIN))
    out = tmp_path / f"{recipe}{suffix}"
    assert cli.main(["data", str(CONFIGS / f"{recipe}.yaml"), "--in", str(plain),
                     "--out", str(out)]) == 0
    assert f"wrote 3 rows in {recipe}'s released layout" in capsys.readouterr().out
    rows = pq.read_table(out).to_pylist() if suffix == ".parquet" else \
        [json.loads(line) for line in out.read_text().splitlines()]
    first = rows[0]
    if recipe == "prime":  # training/scripts/data_prepare.py:55-70
        assert first["prompt"] == [{"role": "system", "content": PRIME_SYSTEM},
                                   {"role": "user", "content": PRIME_USER}]
        assert first["reward_model"] == {"style": "rule", "ground_truth": "5"}
        assert first["ability"] == "math"
    elif recipe == "prof_grpo":  # data_preprocess/numina_math.py:80-103
        assert [m["role"] for m in first["prompt"]] == ["system", "user"]
        assert first["prompt"][1]["content"] == QUESTION + (
            " Let's think step by step and output the final answer within \\boxed{}.")
    elif recipe == "papo":  # data/convert_numina_math.py:51-68
        assert first["prompt"] == [{"role": "user", "content": (
            "You are a knowledgeable math assistant. Answer the following questions and think "
            "step by step. " + QUESTION + " Please output the final answer within \\boxed{}.")}]
        assert first["reward_model"] == {"ground_truth": "5", "style": "llm_process"}
        assert first["extra_info"] == {"question": QUESTION,
                                       "reference_solution": PLAIN[0]["solution"]}
        assert rows[1]["extra_info"]["reference_solution"] == ""  # graded 0, as released
    else:  # PURE's JSON rows: the question; its input_template applies at load
        assert rows == [{"question": QUESTION, "answer": "5"},
                        {"question": "What is $1+1$?", "answer": "2"},
                        {"question": PLAIN[2]["problem"], "answer": "\\frac56"}]
    assert [r.get("reward_model", r)["ground_truth" if "reward_model" in r else "answer"]
            for r in rows] == ["5", "2", "\\frac56"]
    assert _texts(recipe, out, tok) == _texts(recipe, plain, tok)

    # converting the converted file again gives the same rows
    again = tmp_path / f"again{suffix}"
    assert cli.main(["data", str(CONFIGS / f"{recipe}.yaml"), "--in", str(out),
                     "--out", str(again)]) == 0
    reread = pq.read_table(again).to_pylist() if suffix == ".parquet" else \
        [json.loads(line) for line in again.read_text().splitlines()]
    assert reread == rows


def test_refusals_leave_every_file_as_it_was(tmp_path, capsys):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in PLAIN))
    before = plain.read_bytes()
    prime = str(CONFIGS / "prime.yaml")
    out = tmp_path / "out.jsonl"
    out.write_text("keep me\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"note": "no question"}) + "\n")
    cases = [(["--in", str(plain), "--out", str(plain), "--force"], "is the input file"),
             (["--in", str(plain), "--out", str(out)], "exists; pass --force"),
             (["--in", str(empty), "--out", str(tmp_path / "new.jsonl")], "no usable rows"),
             (["--in", str(plain), "--out", str(tmp_path / "x.csv")], "use .jsonl or .parquet")]
    for argv, why in cases:
        capsys.readouterr()
        assert cli.main(["data", prime, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0] and err[0].startswith("megaprm data: error:")
    assert plain.read_bytes() == before and out.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "out.jsonl",
                                                          "plain.jsonl"]
    # a recipe without a released layout names the choice
    assert cli.main(["data", str(CONFIGS / "grpo.yaml"), "--in", str(plain), "--out",
                     str(tmp_path / "g.jsonl")]) == 2
    assert "--layout" in capsys.readouterr().err
    assert cli.main(["data", str(CONFIGS / "grpo.yaml"), "--in", str(plain), "--out",
                     str(tmp_path / "g.jsonl"), "--layout", "prof_grpo", "--force"]) == 0


def test_papo_judge_inputs_as_released_and_as_the_preprocessing_fills_them(tok, tmp_path):
    """A release row is read as PAPO's grader reads it: extra_info only (no reference: graded 0,
    no question: an empty problem); a plain row as convert_numina_math.py would fill them: its
    solution column and the question itself."""
    wrapped = ("You are a knowledgeable math assistant. Answer the following questions and "
               "think step by step. " + QUESTION + " Please output the final answer within "
               "\\boxed{}.")
    rows = [{"prompt": [{"role": "user", "content": wrapped}], "solution": "n=5",
             "reward_model": {"ground_truth": "5"}},
            {"prompt": [{"role": "user", "content": wrapped}],
             "reward_model": {"ground_truth": "5"},
             "extra_info": {"question": QUESTION, "reference_solution": "n=5"}},
            {"problem": QUESTION, "answer": "5", "solution": "n=5"}]
    path = tmp_path / "papo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(str(CONFIGS / "papo.yaml"), [f"data.path={path}", "data.prompts_per_step=3"])
    block = make_data(cfg, tok)(0)
    assert block.references == [None, "n=5", "n=5"]
    assert block.problems == ["", QUESTION, QUESTION]
    assert block.texts == [wrapped] * 3
