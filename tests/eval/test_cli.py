"""`megaprm eval` end to end on a tiny random model, offline, over all five benchmarks."""
import json
import os
import re
import sys

import pytest
import torch

from eval import run
from megaprm.cli import main
from megaprm.tasks.datasets import BENCHMARKS


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    out = tmp_path_factory.mktemp("policy")
    return save_tiny_model("qwen2", str(out), tokenizer=tok, vocab_size=len(tok),
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model; threads only contend on a shared box
    yield
    torch.set_num_threads(threads)


def test_eval_cli_writes_report_for_all_benchmarks(tiny_model, tmp_path, one_thread, capsys):
    out = tmp_path / "report.json"
    rc = main(["eval", "--model", tiny_model, "--limit", "1", "--k", "2", "--max-tokens", "6",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["benchmarks"]) == list(BENCHMARKS)
    for name, r in report["benchmarks"].items():
        assert r["problems"] == 1 and len(r["per_problem"]) == 1, name
        assert 0.0 <= r["avg@k"] <= r["pass@k"] <= 1.0
    per = report["benchmarks"].values()
    assert set(report["average"]) == {"avg@k", "pass@k", "time_s"}
    # the "average" row's time is the mean over benchmarks, not the total (model load included)
    assert report["average"]["time_s"] == pytest.approx(sum(r["time_s"] for r in per) / len(per))
    assert report["total_time_s"] > sum(r["time_s"] for r in per)
    assert report["config"]["k"] == 2 and report["exported_from_megatron"] is False
    table = capsys.readouterr().out
    assert "avg@2" in table and "pass@2" in table and "average" in table


def test_default_max_tokens_is_capped_to_the_models_positions(tiny_model, tmp_path, one_thread,
                                                               capsys):
    """README's `eval --limit 8 --k 1` on a 512-position model: the 4096 default is capped to
    what the model allows (positions - longest prompt), with one line saying so."""
    from transformers import AutoTokenizer

    from megaprm.tasks.datasets import load_benchmark

    out = tmp_path / "report.json"
    assert main(["eval", "--model", tiny_model, "--benchmarks", "math500", "--limit", "2",
                 "--k", "1", "--out", str(out), "--no-progress"]) == 0
    tok = AutoTokenizer.from_pretrained(tiny_model)
    longest = max(len(run.prompt_ids(tok, r.prompt)) for r in load_benchmark("math500", limit=2)[0])
    report = json.loads(out.read_text())
    assert report["config"]["max_tokens"] == 512 - longest
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "positions" in ln]
    expected = (f"eval: max_tokens 4096 + the longest prompt ({longest} tokens) exceed the "
                f"model's 512 positions; generating up to {512 - longest} tokens")
    assert notes == [expected]


def test_eval_cli_rejects_unknown_benchmark(tiny_model, capsys):
    assert main(["eval", "--model", tiny_model, "--benchmarks", "gsm8k"]) == 2
    assert "gsm8k" in capsys.readouterr().err


def test_prompt_template_and_chat_template(tiny_model):
    from transformers import AutoTokenizer

    assert run.format_prompt("What is 1+1?") == (
        "What is 1+1? Let's think step by step and output the final answer within \\boxed{}.")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert not tok.chat_template
    assert run.prompt_ids(tok, "1+1") == tok.encode(run.format_prompt("1+1"),
                                                    add_special_tokens=False)
    tok.chat_template = "{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}<eos>"
    ids = run.prompt_ids(tok, "1+1")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id


def test_resolve_model_paths(tiny_model, tmp_path, monkeypatch):
    assert run.resolve_model(tiny_model, str(tmp_path)) == tiny_model
    with pytest.raises(FileNotFoundError):
        run.resolve_model(str(tmp_path / "nope"), str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither an HF model directory"):
        run.resolve_model(str(empty), str(tmp_path))

    # a checkpoint_tools Megatron checkpoint is exported with `checkpoint_tools export-hf`
    ckpt = tmp_path / "ckpt"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "megaprm_checkpoint.json").write_text("{}")
    calls = []

    class Done:
        returncode, stderr = 0, ""

    monkeypatch.setattr(run.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or Done())
    out = run.resolve_model(str(ckpt), str(tmp_path / "work"))
    assert out == os.path.join(str(tmp_path / "work"), "hf")
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "checkpoint_tools", "export-hf"]
    assert cmd[cmd.index("--ckpt") + 1] == str(ckpt) and cmd[cmd.index("--out") + 1] == out


def test_progress_names_each_sample_batch_before_it_runs(tiny_model, one_thread, capsys,
                                                         monkeypatch):
    """Issue 50: `eval --limit 4` sat at 0/4 for 11 minutes (one generate call of 4 x k=16
    samples). The workload is said up front and each sample batch in one line before its
    generate call starts (the engine's calls are marked in the same stream to show the order)."""
    real = run.build_engine

    def marked(cfg, hf_dir, tok):
        engine = real(cfg, hf_dir, tok)
        generate = engine.generate

        def gen(prompts, params):
            print(f"<generate {len(prompts)}x{params.n}>", file=sys.stderr)
            return generate(prompts, params)

        engine.generate = gen
        return engine

    monkeypatch.setattr(run, "build_engine", marked)
    assert main(["eval", "--model", tiny_model, "--benchmarks", "math500", "--limit", "3",
                 "--k", "2", "--max-tokens", "4", "--batch-prompts", "2"]) == 0
    # the lines and marks in order (the bar's frames, between them, left out)
    err = re.findall(r"eval: [^\r\n]*|eval math500: [^\r\n]*|<generate \d+x\d+>",
                     capsys.readouterr().err)
    assert err == [
        "eval: 3 problem(s) x k=2 samples of up to 4 tokens on the hf engine, 2 problem(s) per "
        "generate call (--k and --max-tokens shrink it)",
        "eval math500: problems 1-2 of 3, 4 samples (k=2) of up to 4 tokens ...",
        "<generate 2x2>",
        "eval math500: problems 3-3 of 3, 2 samples (k=2) of up to 4 tokens ...",
        "<generate 1x2>"], err
