"""What a CPU `megaprm train` / `train-prm` prints (issue 50, item 10): Megatron's
CUDA_DEVICE_MAX_CONNECTIONS advice (a CUDA stream setting), wandb's `reinit` deprecation and its
~30-line history/summary are gone by default; megaprm's own lines say what runs before the long
phases (model build, the first step; train-prm's data and PRM build) and end with the last
step's headline metrics. At main f0de1ae the train run below printed 41 lines; now 5 (+ the bar)."""
import json
import os
import subprocess

import pytest

from tests.test_megaprm_cli import MEGAPRM, ROOT


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return save_tiny_model("qwen2", str(tmp_path_factory.mktemp("out") / "policy"), tokenizer=tok,
                           vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, intermediate_size=64, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)


def run(args):
    # the user's environment without any WANDB_* choice: wandb's defaults, as a new user has
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(env, OMP_NUM_THREADS="1"))


def _lines(p) -> list:
    """Output lines, the progress bar's frames (one line on a terminal) counted as one."""
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    bar = [ln for ln in lines if ln.startswith("RL ")]
    return [ln for ln in lines if not ln.startswith("RL ")] + bar[-1:]


@pytest.mark.slow
def test_cpu_train_and_train_prm_are_quiet_and_say_what_runs(policy, tmp_path):
    # tp=2: the layers' async grad all-reduce path, where Megatron warns; wandb offline (the
    # default), the progress bar on (the default)
    p = run([*MEGAPRM, "train", "--config", "configs/grpo_tiny.yaml", "--nproc", "2",
             "parallel.tp=2", "trainer.steps=1", f"model.path={policy}",
             f"trainer.run_dir={tmp_path / 'run'}", "rollout.max_tokens=12",
             "data.prompts_per_step=2", "rollout.n=4", "actor.micro_batch_size=8",
             "actor.mini_batches=1"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = _lines(p)
    for noise in ("CUDA_DEVICE_MAX_CONNECTIONS", "reinit", "wandb:", "Warning"):
        assert not [ln for ln in out if noise in ln], (noise, out)
    said = [ln for ln in out if ln.startswith("[train]")]
    assert [ln.split(" ")[1] for ln in said] == ["building", "models", "step", "last", "done:"], said
    assert "reward/outcome_mean=" in said[3] and "timing/step_s=" in said[3]
    assert len(out) <= 6, "\n".join(out)  # the five lines + the bar
    assert os.path.isdir(tmp_path / "run" / "wandb")  # wandb still writes its files

    p = run([*MEGAPRM, "train-prm", "--config", "configs/prm/tiny.yaml", "--nproc", "2",
             f"model_dir={policy}", f"output_dir={tmp_path / 'prm'}", "num_train=64",
             "num_eval=32", "stage1_steps=1", "stage2_steps=2", "warmup_steps=0",
             "global_batch_size=8", "micro_batch_size=4"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = _lines(p)
    first_step = next(i for i, ln in enumerate(out) if "stage 1 step 0/" in ln)
    before = out[:first_step]
    assert any("building the PRM from" in ln for ln in before), out
    assert any(ln.startswith("training: 1 head step(s), then 2 whole-model") for ln in before)
    assert not [ln for ln in out if "CUDA_DEVICE_MAX_CONNECTIONS" in ln or "Warning" in ln], out
    json.loads(out[-1])  # the report stays the last line


def test_make_install_names_each_step_before_it_runs():
    """The install (minutes, pip -q) says each of its steps first (it was silent ~4 min)."""
    p = subprocess.run(["make", "-n", "-B", "install"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60, check=True)
    lines = p.stdout.splitlines()
    said = [i for i, ln in enumerate(lines) if ln.startswith('echo "[install')]
    assert [lines[i].split("]")[0] for i in said] == [
        'echo "[install 1/4', 'echo "[install 2/4', 'echo "[install 3/4', 'echo "[install 4/4',
        'echo "[install']
    pips = [i for i, ln in enumerate(lines) if "pip install" in ln]
    # every pip call comes after a line that names it, the last line says it is done
    assert len(pips) == 3 and all(any(s < i for s in said) for i in pips), lines
    assert said[1] < pips[0] and said[2] < pips[1] and said[3] < pips[2] < said[4], lines
