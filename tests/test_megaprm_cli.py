"""The CLI as users run it: subprocesses of the `megaprm` entry point (README and docs commands),
multi-rank through the launcher, two "nodes" on one machine, the HF -> RL -> export -> eval round
trip, the demo's cached warm-up, and each README troubleshooting row -> one line, exit 2."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megaprm.parallel.ports import free_port

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
_BIN = os.path.join(os.path.dirname(sys.executable), "megaprm")
MEGAPRM = [_BIN] if os.path.exists(_BIN) else [sys.executable, "-m", "megaprm.cli"]
FAST = ["trainer.wandb=disabled", "trainer.progress=false", "rollout.max_tokens=12",
        "data.prompts_per_step=2", "rollout.n=4", "actor.micro_batch_size=8",
        "actor.mini_batches=1"]


def run(args, timeout=600, extra_env=None, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env, **kw)


def start(args, extra_env=None):
    """`run` in the background: the Popen; `finish` waits for it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)


def finish(proc, timeout=600):
    """The CompletedProcess of a `start`ed command (killed if it overruns the timeout)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line_error(p, *needles):
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert len(lines) == 1, p.stderr[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny Qwen2 policy with the task's char tokenizer (4 heads, 2 KV heads, 2 layers)."""
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    d = tmp_path_factory.mktemp("cli") / "policy"
    return save_tiny_model("qwen2", str(d), tokenizer=tok, vocab_size=len(tok), hidden_size=32,
                           num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def train_cmd(policy, run_dir, *extra, config="configs/grpo_tiny.yaml"):
    return [*MEGAPRM, "train", "--config", config, f"model.path={policy}",
            f"trainer.run_dir={run_dir}", *FAST, *extra]


TWO_RANKS = ("--nproc", "2", "trainer.steps=2", "trainer.eval_every=1", "trainer.eval_problems=4")


@pytest.fixture(scope="module")
def two_rank_run(policy, tmp_path_factory):
    """`megaprm train --nproc 2` under torchrun: (the finished process, its run directory)."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    return run(train_cmd(policy, run_dir, *TWO_RANKS)), run_dir


@pytest.mark.slow
def test_train_two_ranks_export_verify_eval(two_rank_run, policy, tmp_path):
    """`megaprm train --nproc 2` -> `checkpoint_tools export-hf` of the trainer checkpoint ->
    transformers' logits equal Megatron's on it (verify) -> `megaprm eval --model <checkpoint>`."""
    p, run_dir = two_rank_run
    assert p.returncode == 0, p.stderr[-4000:]
    # the last line says where to look (after wandb's summary), and the plots are drawn
    assert p.stdout.strip().splitlines()[-1].startswith(f"[train] done: run {run_dir} "), p.stdout
    assert (run_dir / "plots" / "reward.png").is_file()
    for noise in ("not installed", "Falling back", "FutureWarning", "full scope is deprecated"):
        assert noise not in p.stderr, (noise, p.stderr[-3000:])
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["guard/skipped_total"] == 0 for r in rows)
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/problems"] == 4 for r in rows)
    assert all(k in rows[0] for k in ("actor/entropy_token_mean", "actor/lr", "timing/step_s",
                                      "throughput/tokens_per_s", "response/length_max"))
    samples = [json.loads(x) for x in open(run_dir / "samples.jsonl")]
    assert {s["step"] for s in samples} == {0, 1} and all("response" in s for s in samples)
    step_dir = run_dir / "checkpoints" / "step_000001"
    assert (step_dir / "actor" / "megaprm_checkpoint.json").is_file()
    # the commands below only read the run (plot writes its plots/): the plot and the eval run
    # alongside the export, verify and the new run (seconds of imports each)
    side = {"plot": start([*MEGAPRM, "plot", str(run_dir)]),
            "eval": start([*MEGAPRM, "eval", "--model", str(step_dir), "--benchmarks", "math500",
                           "--limit", "2", "--k", "1", "--max-tokens", "4", "--no-progress",
                           "--out", str(tmp_path / "eval.json")])}
    try:
        _export_verify_and_restart(policy, run_dir, step_dir, tmp_path)
        p = finish(side["plot"])
        assert p.returncode == 0, p.stderr[-2000:]
        assert all((run_dir / "plots" / f"{f}.png").is_file()
                   for f in ("actor", "eval", "reward"))
        p = finish(side["eval"])
        assert p.returncode == 0, p.stderr[-4000:]
        assert json.load(open(tmp_path / "eval.json"))
    finally:  # none left behind when a check fails first
        for proc in side.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _export_verify_and_restart(policy, run_dir, step_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "exported"
    p = run([sys.executable, "-m", "checkpoint_tools", "export-hf", "--ckpt", str(run_dir),
             "--out", str(out)])
    assert p.returncode == 0, p.stderr[-4000:]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out))  # loads as a plain HF directory
    trained, initial = load_file(str(out / "model.safetensors")), load_file(
        os.path.join(policy, "model.safetensors"))
    moved = [k for k in initial if not torch.equal(trained[k], initial[k])]
    assert moved, "two RL steps at lr 2e-4 changed no weight: the export is not the trained policy"
    p = run([sys.executable, "-m", "checkpoint_tools", "verify", "--hf", str(out), "--ckpt",
             str(step_dir / "actor")])
    assert p.returncode == 0 and json.loads(p.stdout)["passed"], p.stdout + p.stderr[-2000:]

    # a new run starts from the trainer's Megatron checkpoint (model.path = its step dir): the
    # engine is built without weights and receives the checkpoint's, so sampler and trainer agree
    p = run(train_cmd(policy, tmp_path / "from-ckpt", "--nproc", "1", "trainer.steps=1",
                      f"model.path={step_dir}"))
    assert p.returncode == 0, p.stderr[-4000:]
    row = json.loads(open(tmp_path / "from-ckpt" / "metrics.jsonl").readline())
    assert row["rollout/logprob_diff_max"] <= 1e-4, row["rollout/logprob_diff_max"]


def test_resume_with_other_layout_and_config_is_refused_before_ranks(policy, tmp_path):
    run_dir = tmp_path / "run"
    p = run(train_cmd(policy, run_dir, "--nproc", "1", "trainer.steps=1"))
    assert p.returncode == 0, p.stderr[-4000:]
    one_line_error(run(train_cmd(policy, run_dir, "--nproc", "2", "trainer.steps=2")),
                   "(world, tp, pp) = (1, 1, 1)", "(2, 1, 1)")
    line = one_line_error(run(train_cmd(policy, run_dir, "--nproc", "1", "trainer.steps=2",
                                        "advantage.method=rloo")),
                          "another config", "advantage.method")
    assert "grpo" in line and "rloo" in line
    # the same run resumed as it finished: one line, exit 0, no rank started, nothing written
    before = _tree(run_dir)
    p = run(train_cmd(policy, run_dir, "--nproc", "1", "trainer.steps=1"))
    assert p.returncode == 0 and p.stderr.strip() == "", p.stderr[-3000:]
    assert p.stdout.strip().splitlines() == [
        f"[train] {run_dir} already finished at step 0 (trainer.steps=1): nothing to train; "
        "raise trainer.steps to train on, or pass a new trainer.run_dir"], p.stdout
    assert _tree(run_dir) == before
    # its checkpoints removed, the default trainer.resume=true once rewrote metrics.jsonl from
    # step 0 without a word: refused before any rank, as trainer.resume=false is
    shutil.rmtree(run_dir / "checkpoints")
    before = _tree(run_dir)
    one_line_error(run(train_cmd(policy, run_dir, "--nproc", "1", "trainer.steps=1")),
                   "no checkpoint", "trainer.replace_run=true")
    assert _tree(run_dir) == before


def _tree(root) -> dict:
    """Every path under `root` with its bytes (None for a directory)."""
    return {p.relative_to(root): p.read_bytes() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_two_nodes_on_one_machine_train_together(policy, tmp_path, placement):
    """Two launchers, --nnodes 2 --node-rank 0|1 --nproc 1, one master: one world of 2 ranks.
    separate: node 1 is a whole rollout node (rollout.ranks=1, one step ahead), node 0 the
    trainer (docs/rollout.md "Placement")."""
    run_dir = tmp_path / "run"
    port = str(free_port())
    extra = (["rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=1"]
             if placement == "separate" else [])
    cmds = [train_cmd(policy, run_dir, "--nnodes", "2", "--node-rank", str(r), "--nproc", "1",
                      "--master-addr", "127.0.0.1", "--master-port", port, "trainer.steps=2",
                      *extra)
            for r in (0, 1)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    state = json.load(open(run_dir / "checkpoints" / "step_000001" / "trainer.json"))
    if placement == "separate":  # the trainer's world is node 0 alone; step 1 drew a stale block
        assert state["world_size"] == 1
        assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0]
    else:
        assert state["world_size"] == 2


@pytest.mark.slow
def test_train_prm_two_ranks(policy, tmp_path):
    p = run([*MEGAPRM, "train-prm", "--config", "configs/prm/tiny.yaml", "--nproc", "2",
             f"model_dir={policy}", f"output_dir={tmp_path / 'prm'}", "num_train=64",
             "num_eval=32", "stage1_steps=1", "stage2_steps=2", "warmup_steps=0",
             "global_batch_size=8", "micro_batch_size=4"])
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert 0.0 <= report["auroc"] <= 1.0
    assert os.path.isfile(tmp_path / "prm" / "config.json")


def test_prm_path_unread_by_the_prm_kind_is_announced_before_ranks(policy, tmp_path, capsys):
    from megaprm.config import load_config
    from megaprm.trainer.preflight import check_rl_launch

    base = ["trainer.wandb=disabled", f"model.path={policy}", f"trainer.run_dir={tmp_path}"]
    for kind in ("oracle", "none"):
        cfg = load_config("configs/grpo_tiny.yaml", [*base, f"prm.kind={kind}",
                                                     f"prm.path={policy}"])
        check_rl_launch(cfg, 1)
        assert capsys.readouterr().err == (f"megaprm train: warning: prm.path={policy!r} is not "
                                           f"read with prm.kind={kind}\n")
    check_rl_launch(load_config("configs/grpo_tiny.yaml", [*base, "prm.kind=none"]), 1)
    assert capsys.readouterr().err == ""


def _six_head_model(root):
    from megaprm.models.tiny import save_tiny_model
    from megaprm.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    return save_tiny_model("qwen2", str(root / "six"), tokenizer=tok, vocab_size=len(tok),
                           hidden_size=48, num_layers=4, num_heads=6, num_kv_heads=6,
                           intermediate_size=64, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)


def _mistral_dir(root, policy):
    import shutil

    d = root / "mistral"
    shutil.copytree(policy, d)
    cfg = json.load(open(d / "config.json"))
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    json.dump(cfg, open(d / "config.json", "w"))
    return str(d)


def _missing_tensor_dir(root, policy):
    import shutil

    from safetensors.torch import load_file, save_file

    d = root / "missing"
    shutil.copytree(policy, d)
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return str(d)


# README "Troubleshooting": each row as a user would type it -> exactly one line, exit 2
TROUBLE = {
    "world_not_divisible": (lambda root, pol: ["--nproc", "3", "parallel.tp=2",
                                               f"model.path={pol}"],
                            ["world size 3 is not divisible by tp*pp*cp"]),
    "tp_vs_heads": (lambda root, pol: ["--nproc", "4", "parallel.tp=4",
                                       f"model.path={_six_head_model(root)}"],
                    ["tp=4 does not divide num_attention_heads=6"]),
    "pp_vs_layers": (lambda root, pol: ["--nproc", "3", "parallel.pp=3",
                                        f"model.path={_six_head_model(root)}"],
                     ["pp=3 does not divide num_hidden_layers=4"]),
    "unsupported_arch": (lambda root, pol: ["--nproc", "1",
                                            f"model.path={_mistral_dir(root, pol)}"],
                         ["MistralForCausalLM", "is not supported"]),
    "missing_tensor": (lambda root, pol: ["--nproc", "1",
                                          f"model.path={_missing_tensor_dir(root, pol)}"],
                       ["model.layers.1.mlp.up_proj.weight"]),
    "no_config_json": (lambda root, pol: ["--nproc", "1", f"model.path={root}"],
                       ["has no config.json"]),
    "rollout_n_1": (lambda root, pol: ["--nproc", "1", f"model.path={pol}", "rollout.n=1"],
                    ["rollout.n=1 is not valid"]),
    "data_path_with_arithmetic": (lambda root, pol: ["--nproc", "1", f"model.path={pol}",
                                                     "data.path=mine.jsonl"],
                                  ["data.path='mine.jsonl' would be ignored: data.task="]),
    "prime_needs_implicit": (lambda root, pol: ["--nproc", "1", f"model.path={pol}",
                                                "advantage.method=prime", "prm.kind=none"],
                             ["advantage.method='prime' needs prm.kind=implicit"]),
    "mini_batches": (lambda root, pol: ["--nproc", "1", f"model.path={pol}",
                                        "actor.mini_batches=3"],
                     ["actor.mini_batches=3 does not divide the 8 rollouts"]),
    "bad_override": (lambda root, pol: ["--nproc", "1", f"model.path={pol}", "actor.lrr=1"],
                     ["unknown key(s) ['actor.lrr']"]),
    "nproc_zero": (lambda root, pol: ["--nproc", "0", f"model.path={pol}"],
                   ["--nproc=0"]),
    "ray_address_silent": (lambda root, pol: ["--nproc", "1", f"model.path={pol}", "--launcher",
                                              "ray", "--ray-address", f"127.0.0.1:{free_port()}"],
                           ["no Ray head answers there"]),
    "ray_no_cluster": (lambda root, pol: ["--nproc", "1", f"model.path={pol}", "--launcher",
                                          "ray", "--ray-address", "auto"],
                       ["--ray-address=auto: Could not find any running Ray instance"]),
}


@pytest.mark.parametrize("case", sorted(TROUBLE))
def test_troubleshooting_rows_are_one_line(policy, tmp_path, case):
    make, needles = TROUBLE[case]
    argv = make(tmp_path, policy)
    p = run([*MEGAPRM, "train", "--config", "configs/grpo_tiny.yaml",
             f"trainer.run_dir={tmp_path / 'run'}", *FAST, *argv], timeout=300)
    one_line_error(p, "megaprm train: error:", *needles)


def _pids_with(marker: str) -> list:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(pid))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and prctl")
def test_second_start_refused_and_kill_9_of_the_launcher_leaves_no_rank(policy, tmp_path):
    run_dir = str(tmp_path / "orphan-check")
    launcher = subprocess.Popen(train_cmd(policy, run_dir, "--nproc", "2", "trainer.steps=500"),
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # wait until both ranks are training
            if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
                break
            time.sleep(1)
        others = [p for p in _pids_with(run_dir) if p != launcher.pid]
        assert len(others) >= 3, others  # torchrun + 2 ranks
        # a second start on the same run directory is refused while the first one runs
        one_line_error(run(train_cmd(policy, run_dir, "--nproc", "1", "trainer.steps=500")),
                       "is in use by pid")
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    _assert_none_left(lambda: _pids_with(run_dir), "ranks outlived their launcher")


# ------------------------------------------------------------------------------ --launcher ray

CLOCK_METRICS = ("timing/", "throughput/", "weight_sync/seconds", "weight_sync/gbps")


def _pids_with_env(tag: str) -> list:
    """Live processes whose environment holds `tag`: the launcher's descendants, Ray's head
    processes and workers included (they inherit the launcher's environment), however they
    were reparented."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                found = tag.encode() in f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
        except OSError:
            continue
        if found and state != "Z":
            out.append(int(pid))
    return out


def _assert_none_left(find, what: str = "processes outlived the Ray launcher") -> None:
    """Within 30 s no process `find()` (pids, or an environment tag) names is left; any found
    after that is killed (never left behind, even when the test fails) and fails the test."""
    if isinstance(find, str):
        tag = find
        find = lambda: _pids_with_env(tag)  # noqa: E731
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and find():
        time.sleep(0.5)
    survivors = find()
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"{what}: {survivors}"


ray_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


@pytest.mark.slow
@ray_only
def test_ray_launcher_trains_like_torchrun_and_leaves_no_process(two_rank_run, policy,
                                                                 tmp_path):
    """The same command with `--launcher ray` (a local Ray started by the command): the same
    metrics and samples as the torchrun run, step for step; no Ray process left behind."""
    torchrun_p, torchrun_dir = two_rank_run
    assert torchrun_p.returncode == 0, torchrun_p.stderr[-4000:]
    tag = f"MEGAPRM_TEST_TAG=ray-{os.getpid()}-{time.time_ns()}"
    run_dir = tmp_path / "ray"
    p = run(train_cmd(policy, run_dir, *TWO_RANKS, "--launcher", "ray"),
            extra_env=dict([tag.split("=", 1)]))
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.strip().splitlines()[-1].startswith(f"[train] done: run {run_dir} "), p.stdout
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "pid=" not in p.stderr, p.stderr[-3000:]  # the ranks' output as under torchrun
    _assert_none_left(tag)

    def rows(d, name):
        return [json.loads(x) for x in (d / name).read_text().splitlines()]

    ray_rows, torchrun_rows = rows(run_dir, "metrics.jsonl"), rows(torchrun_dir, "metrics.jsonl")
    assert [r["step"] for r in ray_rows] == [0, 1]
    for a, b in zip(ray_rows, torchrun_rows):
        assert a.keys() == b.keys()
        same = [k for k in a if not k.startswith(CLOCK_METRICS)]
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert rows(run_dir, "samples.jsonl") == rows(torchrun_dir, "samples.jsonl")


def _rank_pids(tag: str) -> dict:
    """{RANK: pid} of the rank processes (`python -m megaprm.cli` with RANK set) carrying tag."""
    out = {}
    for pid in _pids_with_env(tag):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"megaprm.cli" in cmd and b"RANK" in env:
            out[int(env[b"RANK"])] = pid
    return out


@pytest.mark.slow
@ray_only
def test_ray_killed_actor_ends_the_run_in_one_line(policy, tmp_path):
    """SIGKILL of rank 1's Ray actor while its rank runs: the launcher stops the other rank,
    prints one line naming rank 1 and exits 1; no rank, actor or Ray process is left."""
    tag = f"MEGAPRM_TEST_TAG=ray-kill-{os.getpid()}-{time.time_ns()}"
    key, value = tag.split("=", 1)
    launcher = subprocess.Popen(
        train_cmd(policy, tmp_path / "run", "--launcher", "ray", "--nproc", "2",
                  "trainer.steps=500"), cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **{key: value}))
    try:
        deadline = time.monotonic() + 180
        ranks = {}
        while time.monotonic() < deadline and len(ranks) < 2 and launcher.poll() is None:
            time.sleep(0.5)
            ranks = _rank_pids(tag)
        assert len(ranks) == 2, (ranks, launcher.poll())
        with open(f"/proc/{ranks[1]}/stat") as f:
            actor = int(f.read().split(")")[-1].split()[2])  # the rank's parent: its actor
        os.kill(actor, signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        _assert_none_left(tag)
    assert launcher.returncode == 1, err[-3000:]
    ours = [ln for ln in err.splitlines() if ln.startswith("megaprm")]
    assert len(ours) == 1 and "rank 1's Ray actor died" in ours[0], err[-3000:]
