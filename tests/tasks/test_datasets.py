import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megaprm.tasks.datasets import (
    BENCHMARKS,
    EVAL_DATA_DIR,
    load_benchmark,
    load_prompts,
)

EXPECTED_ROWS = {"math500": 500, "aime24": 30, "amc23": 40, "minerva_math": 272, "olympiadbench": 675}


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmarks_load_fully(name):
    records, report = load_benchmark(name)
    assert report.skipped == [], report.summary()
    assert len(records) == report.loaded == EXPECTED_ROWS[name]
    assert all(r.prompt.strip() and r.answer.strip() and r.data_source == name for r in records)
    assert [r.index for r in records] == list(range(len(records)))


def test_benchmark_answer_normalisation():
    amc, _ = load_benchmark("amc23")
    assert amc[0].answer == "27"  # the float 27.0
    minerva, _ = load_benchmark("minerva_math", limit=3)
    assert [r.answer for r in minerva] == ["1.6", "4.5e33", "41.8"]  # last \boxed{} of solution
    olympiad, _ = load_benchmark("olympiadbench", limit=2)
    assert olympiad[0].answer == "2" and "solution" in olympiad[0].meta
    math500, _ = load_benchmark("math500", limit=1)
    assert math500[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)" and len(math500) == 1


def test_shipped_copies_keep_provenance():
    readme = (EVAL_DATA_DIR / "README.md").read_text()
    assert "Hendrycks" in readme and "OlympiadBench" in readme


def test_verl_parquet_layout(tmp_path):
    rows = [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"split": "train", "index": 7},
        },
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": "2+2?"}],
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"split": "train", "index": 8},
        },
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    records, report = load_prompts(path)
    assert report.skipped == [] and report.loaded == 2
    assert records[0].prompt == "1+1?" and records[0].answer == "2" and records[0].index == 7
    assert records[0].data_source == "gsm8k" and records[0].meta["messages"][0]["role"] == "system"
    assert records[1].index == 8


def test_string_prompt_parquet(tmp_path):
    path = tmp_path / "arith.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+2=", "answer": 3}]), path)
    records, _ = load_prompts(path, data_source="arith")
    assert (records[0].prompt, records[0].answer, records[0].data_source) == ("1+2=", "3", "arith")


def test_malformed_rows_skipped_and_reported(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"problem": "ok 1", "answer": "1"}),
        "{not json",
        json.dumps({"problem": "no answer here"}),
        "",
        json.dumps({"answer": "5"}),
        json.dumps({"question": "ok 2", "final_answer": ["$3$"]}),
        json.dumps([1, 2]),
        json.dumps({"problem": "empty answer", "answer": "  "}),
    ]
    path.write_text("\n".join(lines) + "\n")
    records, report = load_prompts(path)
    assert [r.prompt for r in records] == ["ok 1", "ok 2"]
    assert [line for _, line, _ in report.skipped] == [2, 3, 5, 7, 8]
    assert all(p == str(path) for p, _, _ in report.skipped)
    reasons = [why for _, _, why in report.skipped]
    assert "bad JSON" in reasons[0] and "no answer" in reasons[1] and "no prompt" in reasons[2]
    assert report.rows_read == 7 and report.loaded == 2
    assert "skipped 5" in report.summary() and "line 2" in report.summary()


def test_missing_file_and_bad_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="eval/data"):
        load_benchmark("math500", data_dir=tmp_path)
    with pytest.raises(ValueError, match="valid names"):
        load_benchmark("gsm8k")
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n")
    with pytest.raises(ValueError, match="extension"):
        load_prompts(bad)
