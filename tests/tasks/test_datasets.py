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


# ---------------------------------------------------------------- report, bad rows, UTF-8, length

from megaprm.tasks.datasets import DataError  # noqa: E402


def _mixed(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"problem": "ok 1", "answer": "1"}),
        "{not json",
        json.dumps({"problem": "no answer here"}),
        json.dumps({"answer": "5"}),
        json.dumps({"question": "ok 2", "final_answer": ["$3$"]}),
        json.dumps([1, 2]),
        json.dumps({"problem": "empty answer", "answer": "  "}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_report_counts_reasons_and_shows_examples(tmp_path):
    path = _mixed(tmp_path)
    printed = []
    records, report = load_prompts(path, log=printed.append)
    assert dict(report.skip_kinds) == {"bad JSON": 1, "no answer": 1, "no prompt": 1,
                                       "not an object": 1, "bad field": 1}
    assert report.examples == [("ok 1", "1"), ("ok 2", "$3$")]
    assert printed == [report.text()]
    text = report.text()
    assert "loaded 2 of 7 rows, skipped 5 [" in text and "no answer 1" in text
    assert "e.g. 'ok 1' -> '1'" in text and "e.g. 'ok 2' -> '$3$'" in text


def test_on_bad_row_error_names_the_row(tmp_path):
    path = _mixed(tmp_path)
    with pytest.raises(DataError, match=rf"{path} line 2: bad JSON.*on_bad_row"):
        load_prompts(path, on_bad_row="error")
    with pytest.raises(ValueError, match="on_bad_row='warn'"):
        load_prompts(path, on_bad_row="warn")


def test_keep_unanswered_keeps_rows_with_empty_answer(tmp_path):
    path = _mixed(tmp_path)
    records, report = load_prompts(path, keep_unanswered=True)
    assert [(r.prompt, r.answer) for r in records] == [("ok 1", "1"), ("no answer here", ""),
                                                       ("ok 2", "$3$")]
    assert report.unanswered == 1 and "1 kept without an answer" in report.summary()
    assert report.skip_kinds["no answer"] == 0 and report.skip_kinds["bad field"] == 1


def test_invalid_utf8_is_an_error_with_byte_offset(tmp_path):
    first = (json.dumps({"problem": "caf\u00e9 1", "answer": "1"}) + "\n").encode()
    second = b'{"problem": "bad \xff byte", "answer": "2"}\n'
    path = tmp_path / "latin.jsonl"
    path.write_bytes(first + second)
    offset = len(first) + second.index(b"\xff")
    with pytest.raises(DataError, match=rf"{path}: invalid UTF-8 at byte offset {offset} "
                                        r"\(line 2\)"):
        load_prompts(path)
    path.write_bytes(b"\xef\xbb\xbf" + first)  # a BOM is fine
    records, _ = load_prompts(path)
    assert records[0].prompt == "caf\u00e9 1"


def test_max_prompt_tokens_truncate_drop_error(tmp_path):
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()  # one token per character here: a length is a token count
    rows = [{"problem": "1+2=", "answer": "3"}, {"problem": "12345*6789=", "answer": "x"},
            {"problem": "9-1=", "answer": "8"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = dict(max_prompt_tokens=6, tokenizer=tok)
    recs, rep = load_prompts(path, long_prompt="truncate", **kw)
    assert [r.prompt for r in recs] == ["1+2=", "12345*", "9-1="] and rep.truncated == 1
    recs, rep = load_prompts(path, long_prompt="drop", **kw)
    assert [r.prompt for r in recs] == ["1+2=", "9-1="]
    assert rep.skipped == [(str(path), 2, "prompt has 11 tokens > max_prompt_tokens=6")]
    with pytest.raises(DataError, match=r"line 2: the prompt has 11 tokens > max_prompt_tokens=6"):
        load_prompts(path, **kw)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        load_prompts(path, max_prompt_tokens=6)


def test_huge_prompt_refused_without_tokenizing_it_whole(tmp_path):
    from megaprm.tasks.tokenizer import build_char_tokenizer

    calls = []
    tok = build_char_tokenizer()

    def counting(text, **kw):
        calls.append(len(text))
        return tok(text, **kw)

    counting.decode = tok.decode
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"problem": "1+" * 400_000 + "1=", "answer": "2"}) + "\n")  # < 1 MiB
    with pytest.raises(DataError, match=r"line 1: the prompt has over \d+ tokens"):
        load_prompts(path, max_prompt_tokens=100, tokenizer=counting)
    assert max(calls) <= 100 * 16 + 256
