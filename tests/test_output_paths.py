"""No command writes over what it reads or over a training run's history: for every command
that writes (import-hf, export-hf, train, train-prm, compare, demo, eval, plot), an output that
is, lies inside or contains one of its inputs or a run directory is refused in one line (exit 2)
before anything is written, and every byte on disk stays as it was (`megaprm.outputs.
check_output`, `checkpoint_tools.layout.check_target`). Each command runs in this process up to its refusal; a command
that got past it would start ranks, which the test forbids."""
import hashlib
import os

import pytest

from checkpoint_tools import import_hf
from megaprm.models.tiny import save_tiny_model
from megaprm.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """root/policy (an HF dir), root/run (a trainer run: metrics, config, a checkpoint)."""
    root = tmp_path_factory.mktemp("paths")
    tok = build_char_tokenizer()
    policy = save_tiny_model("qwen2", str(root / "policy"), tokenizer=tok, vocab_size=len(tok),
                             hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=64, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    run = root / "run"
    step = run / "checkpoints" / "step_000000"
    import_hf(policy, str(root / "actor"), verify=False)
    step.mkdir(parents=True)
    os.rename(root / "actor", step / "actor")
    (run / "checkpoints" / "latest").write_text("step_000000\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "reward/outcome_mean": 0.5}\n')
    (run / "config.yaml").write_text("trainer: {steps: 1}\n")
    return root


def _tree(root) -> dict:
    """Every path under `root`: a file's sha256, a directory's None."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = None
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(
                    f.read()).hexdigest()
    return out


# command -> (argv of OUT, the paths it reads: the input relations to try)
COMMANDS = {
    "import-hf": (lambda w, o: ["convert", "import-hf", "--hf", f"{w}/policy", "--out", o,
                                "--no-verify", "--force"], ["policy"]),
    "export-hf": (lambda w, o: ["convert", "export-hf", "--ckpt", f"{w}/run", "--out", o,
                                "--no-verify", "--force"], ["run"]),
    "train": (lambda w, o: ["train", "--config", "configs/grpo_tiny.yaml", "--nproc", "1",
                            f"model.path={w}/policy", f"trainer.run_dir={o}"], ["policy"]),
    "train-prm": (lambda w, o: ["train-prm", "--config", "configs/prm/tiny.yaml", "--nproc",
                                "1", f"model_dir={w}/policy", f"output_dir={o}"], ["policy"]),
    "compare": (lambda w, o: ["compare", "--run-dir", o, "--nproc", "1"], []),
    "demo": (lambda w, o: ["demo", "--run-dir", o, "--nproc", "1"], []),
    "eval": (lambda w, o: ["eval", "--model", f"{w}/policy", "--benchmarks", "math500",
                           "--limit", "1", "--k", "1", "--out", o], ["policy"]),
    "plot": (lambda w, o: ["plot", f"{w}/run", "--out", o], ["run"]),
}
PLACES = {"is": lambda p: p, "lies inside": lambda p: os.path.join(p, "sub"),
          "contains": os.path.dirname}
# what each command's output may legitimately be: train's own run directory is its resume;
# demo's and compare's --run-dir hold the runs they make
EXEMPT = {("train", "run", "is"), ("demo", "run", "contains"), ("compare", "run", "contains")}
CASES = [(cmd, what, how) for cmd, (_, inputs) in COMMANDS.items()
         for what in dict.fromkeys([*inputs, "run"]) for how in PLACES
         if (cmd, what, how) not in EXEMPT]


@pytest.mark.parametrize("cmd, what, how", CASES)
def test_an_output_over_an_input_or_a_run_is_refused_and_nothing_changes(world, cmd, what, how,
                                                                          monkeypatch, capsys):
    from megaprm import cli
    from megaprm.parallel import launch, ray_launch

    def no_ranks(*a, **k):
        raise AssertionError(f"{cmd} got past its output check and started ranks")

    monkeypatch.setattr(launch, "relaunch", no_ranks)
    monkeypatch.setattr(ray_launch, "relaunch", no_ranks)
    monkeypatch.delenv(launch.ERROR_DIR_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    argv_of, _ = COMMANDS[cmd]
    out = PLACES[how](str(world / what))
    before = _tree(world)
    capsys.readouterr()
    rc = cli.main(argv_of(str(world), out))
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, (rc, err)
    assert _tree(world) == before
