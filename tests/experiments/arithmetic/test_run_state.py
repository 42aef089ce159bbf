"""`megaprm compare --state-dir`: what a resumed comparison reads back, kept in a second
directory with a sha256 manifest (run_state.py). Checked here on a run directory laid out as
compare.py writes it: the right files kept and the rest not, incremental and additive saves,
a restore that refuses a state not matching its manifest, keeps a complete unit of the live run
directory and replaces an incomplete one; and the CLI's one line for a bad state. The end to end
(a tiny comparison saved, its run directory gone, the report rebuilt from the state alone):
test_compare.py."""
import hashlib
import json
import os

import pytest

from checkpoint_tools import manifest
from megaprm.experiments.arithmetic import run_state
from tests.test_megaprm_cli import MEGAPRM, one_line_error, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def _write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _run_dir(root):
    """start0 with both stages built, a finished cell, an unfinished one, a superseded one;
    start1 with its warm-up done and its PRM still training."""
    files = {}
    for stage in ("sft", "prm"):
        for name in ("model.safetensors", "config.json", "demo_stage.json"):
            files[f"start0/{stage}/{name}"] = f"{stage}/{name}".encode() * 3
    files["start0/baseline.json"] = b'{"greedy": 1}'
    files["start0/prm_judged.json"] = b'{"f1": 0.5}'
    files["start0/rl/grpo-learned-s0/result.json"] = b'{"digest": "a"}'
    files["start0/rl/grpo-learned-s0/metrics.jsonl"] = b'{"step": 0}\n'
    files["start1/sft/model.safetensors"] = b"w" * 10
    files["start1/sft/demo_stage.json"] = b'{"digest": "c"}'
    for name, data in files.items():
        _write(os.path.join(root, name), data)
    not_kept = ["start0/init/model.safetensors", "start0/prm_init/model.safetensors",
                "start0/rl/grpo-learned-s0/samples.jsonl",
                "start0/rl/grpo-learned-s0/checkpoints/step_2/model.pt",
                "start0/rl/grpo-learned-s0/config.yaml",
                "start0/rl/pure-learned-s0/metrics.jsonl",  # unfinished: no result.json
                "start0/rl/superseded/papo-learned-s0.1234abcd/result.json",
                "start0/sft/model.safetensors.tmp",
                "start1/prm/model.safetensors",  # no stage record yet: still training
                "compare.json", ".megaprm.lock"]
    for name in not_kept:
        _write(os.path.join(root, name), b"x")
    return sorted(files), not_kept


def _tree(root):
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def test_save_keeps_exactly_what_a_resumed_run_reads_back(tmp_path):
    rd, sd = str(tmp_path / "run"), str(tmp_path / "state")
    kept, _ = _run_dir(rd)
    assert run_state.resumable_files(rd) == kept
    assert run_state.save(rd, sd) == len(kept)
    tree = _tree(sd)
    assert sorted(tree) == sorted([*kept, "MANIFEST.json"])
    head = json.loads(tree["MANIFEST.json"])  # checkpoint_tools.manifest's format, sha256
    assert (head["manifest_version"], head["checksum"], head["format"]) == (
        manifest.MANIFEST_VERSION, "sha256", run_state.STATE_FORMAT)
    man = head["files"]
    for rel in kept:  # the manifest is each file's own size and sha256
        data = open(os.path.join(rd, rel), "rb").read()
        assert man[rel] == [len(data), hashlib.sha256(data).hexdigest()]
        assert tree[rel] == data
    # incremental: nothing changed, nothing copied; one cell finishes, its two files are copied
    assert run_state.save(rd, sd) == 0
    _write(os.path.join(rd, "start0/rl/pure-learned-s0/result.json"), b'{"digest": "b"}')
    assert run_state.save(rd, sd) == 2
    # additive: a cell moved aside in the run directory stays in the state
    os.rename(os.path.join(rd, "start0/rl/pure-learned-s0"),
              os.path.join(rd, "start0/rl/superseded/pure-learned-s0.b"))
    assert run_state.save(rd, sd) == 0
    assert "start0/rl/pure-learned-s0/result.json" in run_state.verify(sd)


def test_restore_verifies_then_fills_what_the_run_directory_lacks(tmp_path):
    rd, sd = str(tmp_path / "run"), str(tmp_path / "state")
    kept, _ = _run_dir(rd)
    run_state.save(rd, sd)
    # a fresh machine: the run directory is gone; the state rebuilds every kept file
    fresh = str(tmp_path / "fresh")
    copied, already = run_state.restore(sd, fresh)
    # units: start0's two stages, its two files and one cell; start1's warm-up
    assert (copied, already) == (6, 0)
    assert _tree(fresh) == {rel: open(os.path.join(rd, rel), "rb").read() for rel in kept}
    assert run_state.restore(sd, fresh) == (0, 6)  # again: everything is there
    # the live run directory's complete units stay as they are; an incomplete one (a cell
    # without result.json, restarting from step 0 anyway) is replaced by the state's
    _write(os.path.join(fresh, "start0/baseline.json"), b"newer")
    cell = os.path.join(fresh, "start0/rl/grpo-learned-s0")
    os.remove(os.path.join(cell, "result.json"))
    _write(os.path.join(cell, "samples.jsonl"), b"of the interrupted rerun")
    assert run_state.restore(sd, fresh) == (1, 5)
    assert open(os.path.join(fresh, "start0/baseline.json"), "rb").read() == b"newer"
    assert sorted(os.listdir(cell)) == ["metrics.jsonl", "result.json"]


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "start0/sft/model.safetensors does not match its sha256 in MANIFEST.json"),
    ("remove", "start0/rl/grpo-learned-s0/result.json is in MANIFEST.json but missing"),
    ("manifest", "MANIFEST.json is not a state manifest"),
])
def test_a_damaged_state_is_refused_before_anything_is_copied(tmp_path, damage, needle):
    rd, sd = str(tmp_path / "run"), str(tmp_path / "state")
    _run_dir(rd)
    run_state.save(rd, sd)
    if damage == "truncate":
        with open(os.path.join(sd, "start0/sft/model.safetensors"), "r+b") as f:
            f.truncate(4)
    elif damage == "remove":
        os.remove(os.path.join(sd, "start0/rl/grpo-learned-s0/result.json"))
    else:
        _write(os.path.join(sd, "MANIFEST.json"), b"{not json")
    with pytest.raises(run_state.StateError, match=needle):
        run_state.restore(sd, str(tmp_path / "fresh"))
    assert not os.path.exists(tmp_path / "fresh")
    with pytest.raises(run_state.StateError, match="overlap"):
        run_state.restore(rd, os.path.join(rd, "inner"))


def test_compare_with_a_damaged_state_is_one_line_before_any_rank(tmp_path):
    rd, sd = str(tmp_path / "run"), str(tmp_path / "state")
    _run_dir(rd)
    run_state.save(rd, sd)
    os.remove(os.path.join(sd, "start0/prm/config.json"))
    p = run([*MEGAPRM, "compare", "--run-dir", str(tmp_path / "x"), "--state-dir", sd])
    one_line_error(p, "megaprm compare: error:", "start0/prm/config.json is in MANIFEST.json "
                                                 "but missing")
    # the lock the preflight took goes with the error, and the run directory it made
    assert not os.path.exists(tmp_path / "x")


def _legacy(sd):
    """Rewrite state `sd`'s manifest in run_state's first format (as the committed
    docs/compare/*/run-state hold it): {"format": 1, "files": {path: {"sha256", "bytes"}}}."""
    files = run_state.read_manifest(sd)
    with open(os.path.join(sd, "MANIFEST.json"), "w", encoding="utf-8") as f:
        json.dump({"format": 1, "files": {rel: {"sha256": digest, "bytes": size}
                                          for rel, (size, digest) in files.items()}}, f)
    return files


def test_a_state_of_the_first_format_is_read_and_the_next_save_writes_the_shared_one(tmp_path):
    """Both formats read to the same entries; a restore from the first format fills a run
    directory; the next save that copies a file writes checkpoint_tools.manifest's format."""
    rd, sd = str(tmp_path / "run"), str(tmp_path / "state")
    kept, _ = _run_dir(rd)
    run_state.save(rd, sd)
    shared = run_state.read_manifest(sd)
    assert _legacy(sd) == shared and run_state.read_manifest(sd) == shared
    assert "manifest_version" not in json.load(open(os.path.join(sd, "MANIFEST.json")))
    assert run_state.restore(sd, str(tmp_path / "fresh")) == (6, 0)
    assert run_state.save(rd, sd) == 0  # nothing new: the first format stays as it is
    _write(os.path.join(rd, "start0/rl/pure-learned-s0/result.json"), b'{"digest": "b"}')
    assert run_state.save(rd, sd) == 2  # the cell finished: its result.json and metrics.jsonl
    head = json.load(open(os.path.join(sd, "MANIFEST.json")))
    assert head["manifest_version"] == manifest.MANIFEST_VERSION and head["checksum"] == "sha256"
    assert {k: v for k, v in run_state.verify(sd).items()
            if not k.startswith("start0/rl/pure-learned-s0/")} == shared


@pytest.mark.parametrize("head,needle", [
    ({"manifest_version": 99, "checksum": "sha256"}, "manifest_version 99"),
    ({"manifest_version": 2, "checksum": "crc32"}, "a state's are sha256"),
    ({"format": 2}, "checksum"),  # neither format: a version-1 checkpoint manifest is crc32
])
def test_a_manifest_of_another_version_or_checksum_is_not_a_state_manifest(tmp_path, head,
                                                                          needle):
    sd = tmp_path / "state"
    _write(str(sd / "MANIFEST.json"), json.dumps({**head, "files": {}}).encode())
    with pytest.raises(run_state.StateError, match=f"is not a state manifest .*{needle}"):
        run_state.read_manifest(str(sd))


@pytest.mark.parametrize("state", ["docs/compare/run-state", "docs/compare/long/run-state"])
def test_the_committed_states_read_and_verify(state):
    """The committed run states (saved in the first format, not rewritten) still restore:
    every file they list is there with its sha256."""
    files = run_state.verify(os.path.join(ROOT, state))
    assert len(files) > 100 and all(len(d) == 64 for _, d in files.values())
