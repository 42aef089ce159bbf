"""checkpoint_tools.layout: which directory a user's --ckpt path designates.

The trainer writes RUN/checkpoints/step_NNNNNN/{actor,prm}/ (each a checkpoint_tools checkpoint)
and RUN/checkpoints/latest; the directories here are built by hand in that layout, and the
checkpoint meta by `write_checkpoint_meta`, the helper the trainer calls.
"""
import json
import os

import pytest
import torch

from checkpoint_tools import layout
from checkpoint_tools.layout import (
    ConversionError,
    resolve_checkpoint,
    write_checkpoint_meta,
)


def _hf_side_files(d):
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen2ForCausalLM"]}, f)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(b"weights are not side files")
    return d


def _ckpt(d, hf):
    os.makedirs(os.path.join(d, layout.MODEL_SUBDIR))
    write_checkpoint_meta(d, hf, "Qwen2ForCausalLM", torch.bfloat16, tp=2, pp=1)
    return d


@pytest.fixture
def run(tmp_path):
    """A PRIME-like run: step 2 has actor + prm, step 4 only the actor (latest)."""
    hf = _hf_side_files(str(tmp_path / "hf"))
    ck = tmp_path / "run" / "checkpoints"
    for step, keys in ((2, ("actor", "prm")), (4, ("actor",))):
        for k in keys:
            _ckpt(str(ck / f"step_{step:06d}" / k), hf)
        (ck / f"step_{step:06d}" / "trainer.json").write_text("{}")
    (ck / "latest").write_text("step_000004\n")
    return tmp_path / "run", hf


def test_write_checkpoint_meta(run):
    root, hf = run
    d = str(root / "checkpoints" / "step_000002" / "prm")
    meta = layout.CheckpointMeta.read(d)
    assert (meta.architecture, meta.dtype, meta.tp, meta.pp) == ("Qwen2ForCausalLM", "bf16", 2, 1)
    assert meta.source == os.path.abspath(hf)
    assert sorted(os.listdir(os.path.join(d, layout.HF_SUBDIR))) == ["config.json", "tokenizer.json"]
    with pytest.raises(ConversionError, match="dtype"):
        write_checkpoint_meta(d, hf, "X", "fp8", 1, 1)


def test_resolves_every_accepted_path(run):
    root, _ = run
    ck = root / "checkpoints"
    latest_actor = str(ck / "step_000004" / "actor")
    assert resolve_checkpoint(str(root)) == latest_actor                  # run dir
    assert resolve_checkpoint(str(ck)) == latest_actor                    # checkpoints/ dir
    assert resolve_checkpoint(str(ck / "step_000002"), "prm") == str(ck / "step_000002" / "prm")
    assert resolve_checkpoint(latest_actor) == latest_actor               # the checkpoint itself
    (ck / "latest").write_text(str(ck / "step_000002"))                   # absolute path in latest
    assert resolve_checkpoint(str(root), model="prm") == str(ck / "step_000002" / "prm")


@pytest.mark.parametrize("case, match", [
    ("prm_missing", r"has no prm/ checkpoint \(it has actor/.*pass --model actor"),
    ("no_latest", r"no latest file .* pass a step directory, e.g. .*step_000004"),
    ("latest_dangling", r"names 'step_000009', which is not a directory"),
    ("half_written", r"not a complete checkpoint: it holds hf/, model/, expected"),
    ("unrelated", r"is not a megaprm checkpoint: expected .* it holds notes.txt"),
    ("missing", r"does not exist"),
    ("bad_model", r"--model='critic'"),
])
def test_errors_name_what_was_found(run, tmp_path, case, match):
    root, _ = run
    ck = root / "checkpoints"
    path, model = str(root), "actor"
    if case == "prm_missing":
        model = "prm"
    elif case == "no_latest":
        (ck / "latest").unlink()
    elif case == "latest_dangling":
        (ck / "latest").write_text("step_000009")
    elif case == "half_written":
        os.remove(ck / "step_000004" / "actor" / layout.META_FILE)
    elif case == "unrelated":
        path = str(tmp_path / "other")
        os.makedirs(path)
        (tmp_path / "other" / "notes.txt").write_text("x")
    elif case == "missing":
        path = str(tmp_path / "nope")
    else:
        model = "critic"
    with pytest.raises(ConversionError, match=match):
        resolve_checkpoint(path, model)
