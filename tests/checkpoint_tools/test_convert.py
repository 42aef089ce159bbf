"""checkpoint_tools: HF -> Megatron distributed checkpoint -> HF is lossless for every family.

Reference: the original HF directory itself (tensors compared bit for bit, transformers logits
compared exactly). One spawned 4-rank world runs every round trip and the in-rank error cases
(the torchrun path: each rank calls the library); the CLI is exercised once as a user runs it
(one process that forks its own ranks), including the (2,2) -> (1,2) reshard through `verify`.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_tools import ConversionError, export_hf, hf_reference, import_hf
from megaprm.models.hf_spec import spec_from_hf
from megaprm.models.mapping import HFWeights
from megaprm.models.tiny import build_hf_model, save_tiny_model, tiny_config
from megaprm.parallel import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# name -> how the tiny HF model is made; together they cover every family and head.
CASES = ["qwen2_tied", "llama_rope_scaling", "qwen3_qk_norm", "llama_token_cls", "qwen2_math_prm"]
NO_VERIFY_CASES = ["llama_rope_scaling", "qwen2_math_prm"]  # sharded input; value head


def _make_case(name: str, d: str) -> str:
    from megaprm.tasks.tokenizer import build_char_tokenizer

    if name == "qwen2_tied":
        save_tiny_model("qwen2", d, seed=1)
    elif name == "llama_rope_scaling":  # also the sharded-input case (index.json)
        build_hf_model(tiny_config("llama"), seed=2).save_pretrained(d, max_shard_size="200KB")
    elif name == "qwen3_qk_norm":
        save_tiny_model("qwen3", d, seed=3)
    elif name == "llama_token_cls":
        save_tiny_model("llama", d, seed=4, head="token_cls")
    elif name == "qwen2_math_prm":
        hf_reference.save_process_reward_model(tiny_config("qwen2", tie=False), d, seed=5)
    build_char_tokenizer(d)
    return d


def _rewrite_weights(src: str, dst: str, edit) -> str:
    """Copy an HF dir, passing its (single-file) state dict through `edit`."""
    import shutil

    shutil.copytree(src, dst)
    sd = edit(load_file(os.path.join(src, "model.safetensors")))
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {n: _make_case(n, str(root / n)) for n in CASES}
    base = dirs["qwen2_tied"]

    def drop_and_add(sd):
        del sd["model.layers.1.mlp.up_proj.weight"]
        sd["model.extra_proj.weight"] = torch.zeros(2, 2)
        return sd

    def bad_shape(sd):
        sd["model.norm.weight"] = torch.ones(65)
        return sd

    def nan_in_k(sd):  # k_proj: a tensor that a --no-verify import copies file to file
        sd["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")
        return sd

    def nan_in_o(sd):  # o_proj: row-parallel, a column piece of each tp rank at tp > 1
        sd["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("inf")
        return sd

    dirs["bad_keys"] = _rewrite_weights(base, str(root / "bad_keys"), drop_and_add)
    dirs["nan_o"] = _rewrite_weights(base, str(root / "nan_o"), nan_in_o)
    dirs["nan_k"] = _rewrite_weights(base, str(root / "nan_k"), nan_in_k)
    dirs["bad_shape"] = _rewrite_weights(base, str(root / "bad_shape"), bad_shape)
    dirs["other_seed"] = save_tiny_model("qwen2", str(root / "other_seed"), seed=99)
    return dirs


# ------------------------------------------------------------------------- one 4-rank world

def _world(dirs: dict, root: str) -> dict:
    """Every rank runs this (as under torchrun); rank 0's return value is the report."""
    out = {"roundtrip": {}, "errors": {}}
    for i, name in enumerate(CASES):
        ck, hf = os.path.join(root, name + ".ckpt"), os.path.join(root, name + ".hf")
        imp = import_hf(dirs[name], ck, tp=2, pp=2)
        # one export goes through small shards (several files + index.json)
        exp = export_hf(ck, hf, max_shard_size="150KB" if i == 0 else "5GB")
        out["roundtrip"][name] = {"ckpt": ck, "hf": hf, "import": imp, "export": exp}
    for name in NO_VERIFY_CASES:  # the same import without the logit check: file copies
        import_hf(dirs[name], os.path.join(root, name + ".nv.ckpt"), tp=2, pp=2, verify=False)
    for case in ("bad_keys", "bad_shape", "nan_k", "nan_o"):
        try:
            import_hf(dirs[case], os.path.join(root, case + ".ckpt"), tp=2, pp=2,
                      verify=not case.startswith("nan"))
            out["errors"][case] = None
        except ConversionError as e:
            out["errors"][case] = str(e)
    from checkpoint_tools import verify

    out["wrong_model"] = verify(dirs["other_seed"], out["roundtrip"]["qwen2_tied"]["ckpt"],
                                tp=2, pp=2)
    return out


@pytest.fixture(scope="module")
def world(hf_dirs, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("converted"))
    return launch.spawn(_world, 4, hf_dirs, root)[0], root


def _hf_tensors(d: str) -> dict:
    w = HFWeights(d)
    return {k: w(k) for k in w.keys()}  # noqa: SIM118 (not a dict)


def _outputs(d: str) -> torch.Tensor:
    spec = spec_from_hf(d)
    model = hf_reference.load_reference(d, spec)
    ids = torch.randint(0, spec.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    return hf_reference.reference_outputs(model, spec, ids)


@pytest.mark.parametrize("name", CASES)
def test_roundtrip_bitwise(world, hf_dirs, name):
    report, _ = world
    r = report["roundtrip"][name]
    assert r["import"]["verify"]["passed"] and r["export"]["verify"]["passed"]
    assert r["import"]["verify"]["max_abs_diff"] < 1e-4
    original, exported = _hf_tensors(hf_dirs[name]), _hf_tensors(r["hf"])
    assert set(exported) == set(original)
    for k, t in original.items():
        assert exported[k].dtype == t.dtype and torch.equal(exported[k], t), k
    assert torch.equal(_outputs(r["hf"]), _outputs(hf_dirs[name]))
    # side files travel verbatim: config, tokenizer, generation config (where the model has one)
    from checkpoint_tools.layout import side_files

    files = side_files(hf_dirs[name])
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert set(files) <= set(os.listdir(r["hf"]))
    for f in files:
        with open(os.path.join(hf_dirs[name], f), "rb") as a, open(os.path.join(r["hf"], f),
                                                                    "rb") as b:
            assert a.read() == b.read(), f

def test_export_streams_shards(world):
    report, _ = world
    exp = report["roundtrip"]["qwen2_tied"]["export"]
    assert len(exp["files"]) > 2
    assert exp["peak_shard_bytes"] <= 150_000  # no tensor of the tiny model exceeds a shard
    with open(os.path.join(report["roundtrip"]["qwen2_tied"]["hf"],
                           "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == exp["bytes"]
    assert sorted(set(index["weight_map"].values())) == sorted(exp["files"])
    assert len(exp["peak_rss_mb"]["ranks"]) == 4


def test_checkpoint_layout(world):
    report, root = world
    ck = report["roundtrip"]["llama_token_cls"]["ckpt"]
    assert sorted(os.listdir(ck)) == ["MANIFEST.json", "hf", "megaprm_checkpoint.json", "model"]
    with open(os.path.join(ck, "megaprm_checkpoint.json")) as f:
        meta = json.load(f)
    assert (meta["tp"], meta["pp"], meta["dtype"]) == (2, 2, "fp32")
    assert not [d for d in os.listdir(root) if ".tmp-" in d], "tmp dirs left behind"


def test_in_rank_errors(world):
    report, root = world
    keys = report["errors"]["bad_keys"]
    assert "missing 1 tensor(s): model.layers.1.mlp.up_proj.weight" in keys, keys
    assert "unexpected 1 tensor(s): model.extra_proj.weight" in keys, keys
    shape = report["errors"]["bad_shape"]
    assert shape.startswith("shape mismatch for model.norm.weight: config.json implies [64], "
                            "the safetensors file has [65]"), shape
    assert not os.path.exists(os.path.join(root, "bad_keys.ckpt"))
    nan = report["errors"]["nan_k"]
    assert nan == ("HF weights: HF tensor model.layers.1.self_attn.k_proj.weight holds NaN/inf: "
                   "the checkpoint is corrupt; re-download or re-save it"), nan
    assert not os.path.exists(os.path.join(root, "nan_k.ckpt"))
    assert report["errors"]["nan_o"] == (
        "HF weights: HF tensor model.layers.1.self_attn.o_proj.weight holds NaN/inf: the "
        "checkpoint is corrupt; re-download or re-save it"), report["errors"]["nan_o"]


def _same_checkpoint_files(a: str, b: str) -> None:
    """Two torch_dist dirs hold the same bytes: every .distcp file and common.pt/metadata.json
    equal, and DCP's .metadata equal but for its save ids and path (storage_meta)."""
    from torch.distributed.checkpoint import FileSystemReader

    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for f in os.listdir(a):
        if f != ".metadata":
            with open(os.path.join(a, f), "rb") as fa, open(os.path.join(b, f), "rb") as fb:
                assert fa.read() == fb.read(), f
    ma, mb = FileSystemReader(a).read_metadata(), FileSystemReader(b).read_metadata()
    assert ma.state_dict_metadata == mb.state_dict_metadata
    assert ma.storage_data == mb.storage_data and ma.planner_data == mb.planner_data


@pytest.mark.parametrize("name", NO_VERIFY_CASES)
def test_import_without_verify_copies_the_same_bytes(world, name):
    """--no-verify never reads the weights into memory (HF bytes are copied into the .distcp
    files): the files equal those of the import that loaded the stage and saved it."""
    report, root = world
    _same_checkpoint_files(os.path.join(report["roundtrip"][name]["ckpt"], "model"),
                           os.path.join(root, name + ".nv.ckpt", "model"))


def test_import_copies_in_one_process_with_and_without_copy_file_range(hf_dirs, tmp_path,
                                                                        monkeypatch):
    """tp = pp = 1 (every weight copied, the row-parallel ones too), then again where the
    kernel refuses copy_file_range (EXDEV): plain reads and writes, same bytes (the writes
    from memory in pieces of an odd size: `shards.write_all`)."""
    import errno

    from checkpoint_tools import shards

    d = hf_dirs["qwen3_qk_norm"]
    import_hf(d, str(tmp_path / "loaded"))
    import_hf(d, str(tmp_path / "copied"), verify=False)
    _same_checkpoint_files(str(tmp_path / "loaded" / "model"), str(tmp_path / "copied" / "model"))

    def refuse(*a):
        raise OSError(errno.EXDEV, "cross-device")
    monkeypatch.setattr(os, "copy_file_range", refuse)
    monkeypatch.setattr(shards, "WRITE_PIECE", 1000)
    import_hf(d, str(tmp_path / "plain"), verify=False)
    _same_checkpoint_files(str(tmp_path / "loaded" / "model"), str(tmp_path / "plain" / "model"))


def test_read_columns_equals_the_column_slice(tmp_path):
    """FileReads.read_columns (a row-parallel weight's tp shard read in place) against torch's
    slicing of the tensor: fp32 rows that fill several runs of the 4 MiB buffer, bf16, and
    rows longer than the buffer."""
    from checkpoint_tools.weight_io import FileReads

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3000, 1024, generator=g),  # 4 KiB rows: 1,024 a run
               "b": torch.randn(40, 96, generator=g).to(torch.bfloat16),
               "c": torch.randn(3, 1_200_000, generator=g)}  # 4.8 MB rows: one read each
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reads = FileReads(str(tmp_path))
    try:
        for name, t in tensors.items():
            for tp in (2, 4):
                w = t.shape[1] // tp
                for rank in range(tp):
                    dst = torch.empty(t.shape[0], w, dtype=t.dtype)
                    reads.read_columns(name, rank * w, dst)
                    assert torch.equal(dst, t[:, rank * w:(rank + 1) * w]), (name, tp, rank)
        with pytest.raises(ConversionError, match="do not fit"):
            reads.read_columns("b", 60, torch.empty(40, 48, dtype=torch.bfloat16))
    finally:
        reads.close()


def test_file_copies_split_covers_each_byte_once():
    """FileCopies.split against a byte-by-byte reference over random registered pieces."""
    import random

    from checkpoint_tools.weight_io import FileCopies

    rng = random.Random(0)
    for _ in range(200):
        pieces, pos = [], 1000
        for _ in range(rng.randint(0, 6)):
            pos += rng.randint(0, 40)
            size = rng.randint(1, 30)
            pieces.append((pos, size, "f", rng.randint(0, 10**6)))
            pos += size
        rng.shuffle(pieces)
        copies = FileCopies(pieces)
        addr, n = rng.randint(990, pos + 10), rng.randint(1, 120)
        want = []
        for b in range(addr, addr + n):
            src = next((("f", off + b - start) for start, size, _, off in pieces
                        if start <= b < start + size), None)
            want.append(src)
        got = [None] * n
        last = 0
        for lo, hi, src in copies.split(addr, n):
            assert lo == last and hi > lo
            last = hi
            for i in range(lo, hi):
                got[i] = None if src is None else (src[0], src[1] + i - lo)
        assert last == n and got == want


def test_file_copies_fill_column_pieces_from_any_byte(tmp_path):
    """A column piece (a row-parallel weight's tp shard, never in memory) written through the
    save's stream in odd-sized parts that start and end mid-row, between bytes from memory:
    the file holds those bytes and the HF tensor's column slice, against torch's slicing.
    Rows of 1.2 MB: several runs of the 4 MiB buffers per piece."""
    from checkpoint_tools.weight_io import FileCopies

    g = torch.Generator().manual_seed(1)
    hf = torch.randn(10, 300_000, generator=g)  # the HF tensor, at byte 24 of its file
    src = tmp_path / "hf.bin"
    src.write_bytes(b"x" * 24 + hf.numpy().tobytes())
    first, w = 100_000, 150_000  # this rank's columns
    param = torch.empty(10, w)  # never written: the copies fill the file, not the memory
    memory = torch.arange(1000, dtype=torch.uint8)  # bytes of the stream that stay as written
    row = hf.shape[1] * 4
    copies = FileCopies([(param.data_ptr(), param.numel() * 4, str(src), 24 + first * 4, row,
                          w * 4)], [param, memory])
    data = memoryview(param.numpy()).cast("B")
    with open(tmp_path / "out.bin", "wb") as raw:
        stream = copies.stream(raw)
        stream.write(memory[:300].numpy())
        for lo, hi in ((0, 7), (7, 2_400_001), (2_400_001, 4_123_457), (4_123_457, len(data))):
            stream.write(data[lo:hi])
        stream.write(memory[300:].numpy())
        copies.fill(raw, stream.holes)
    want = (memory[:300].numpy().tobytes() + hf[:, first:first + w].contiguous().numpy()
            .tobytes() + memory[300:].numpy().tobytes())
    assert (tmp_path / "out.bin").read_bytes() == want


def test_verify_rejects_a_different_model(world):
    report, _ = world
    r = report["wrong_model"]
    assert not r["passed"] and r["max_abs_diff"] > r["tolerance"]


# ---------------------------------------------------------------- errors before any rank starts

def test_unknown_architecture(hf_dirs, tmp_path):
    d = tmp_path / "mistral"
    import shutil

    shutil.copytree(hf_dirs["qwen2_tied"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"architectures=\['MistralForCausalLM'\] is not "
                                              r"supported; supported: \["):
        import_hf(str(d), str(tmp_path / "out"))


@pytest.mark.parametrize("tp,pp,msg", [
    (3, 1, "tp=3 does not divide num_attention_heads=4, num_key_value_heads=2"),
    (1, 3, "pp=3 does not divide num_hidden_layers=4"),
    (0, 1, "--tp=0: must be a positive integer"),
])
def test_layout_that_does_not_divide(hf_dirs, tmp_path, tp, pp, msg):
    with pytest.raises(ConversionError, match=msg):
        import_hf(hf_dirs["qwen2_tied"], str(tmp_path / "out"), tp=tp, pp=pp)
    assert not os.listdir(tmp_path)


def test_existing_target(hf_dirs, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match="already exists; .* pass --force"):
        import_hf(hf_dirs["qwen2_tied"], str(tmp_path / "out"))


def test_truncated_safetensors(hf_dirs, tmp_path):
    import shutil

    d = tmp_path / "trunc"
    shutil.copytree(hf_dirs["llama_rope_scaling"], d)  # sharded: truncate one shard
    shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[1]
    data = (d / shard).read_bytes()
    (d / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=f"{shard}.*truncated or corrupt"):
        import_hf(str(d), str(tmp_path / "out"))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ConversionError, match="is not a megaprm checkpoint"):
        export_hf(str(tmp_path), str(tmp_path / "out"))


# ------------------------------------------------------------------------------------- the CLI

def _cli(*args):
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "checkpoint_tools", *args],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_import_then_verify_resharded(world, hf_dirs, tmp_path):
    """The CLI's ranks are forks of its process (`ranks.RANK_START`): the checkpoint equals
    the one the 4-rank world wrote from fresh interpreters; then verified at another layout."""
    ck = str(tmp_path / "ck")
    r = _cli("import-hf", "--hf", hf_dirs["qwen2_tied"], "--out", ck, "--tp", "2", "--pp", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verify"]["passed"]
    _same_checkpoint_files(os.path.join(ck, "model"),
                           os.path.join(world[0]["roundtrip"]["qwen2_tied"]["ckpt"], "model"))
    r = _cli("verify", "--hf", hf_dirs["qwen2_tied"], "--ckpt", ck, "--tp", "1", "--pp", "2")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["passed"] and (report["tp"], report["pp"]) == (1, 2)
    assert report["top1_agreement"] == 1.0 and report["max_abs_diff"] < 1e-4
    # a user error: one line on stderr, no traceback, non-zero exit
    r = _cli("import-hf", "--hf", hf_dirs["qwen2_tied"], "--out", ck)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: target") and "already exists" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_exports_a_trainer_run_dir(hf_dirs, tmp_path):
    """export-hf accepts the trainer's layout (run dir -> checkpoints/latest -> step_N/actor/)
    and `--model prm` on a run without a PRM is one line, exit 2."""
    import shutil

    ck = str(tmp_path / "ck")
    r = _cli("import-hf", "--hf", hf_dirs["qwen2_tied"], "--out", ck, "--no-verify")
    assert r.returncode == 0, r.stderr
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    shutil.copytree(ck, step / "actor")
    (step / "trainer.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000002")
    out = str(tmp_path / "exported")
    r = subprocess.run([sys.executable, "-X", "importtime", "-W", "ignore", "-m",
                        "checkpoint_tools", "export-hf", "--ckpt", str(tmp_path / "run"),
                        "--out", out, "--no-verify"], check=False, cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ckpt"] == str(step / "actor")
    assert json.loads(r.stdout)["streamed"]
    # streamed in this process without megatron-core or torch.distributed.checkpoint
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:")]
    assert "checkpoint_tools.streaming" in imported
    assert not [m for m in imported if m.startswith(("megatron", "torch.distributed.checkp"))]
    want, got = _hf_tensors(hf_dirs["qwen2_tied"]), _hf_tensors(out)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    r = _cli("export-hf", "--ckpt", str(tmp_path / "run"), "--out", out + "2", "--model", "prm")
    assert r.returncode == 2 and "pass --model actor" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_file_reads_match_safetensors(tmp_path):
    """import-hf's plain-read tensor source returns exactly what safetensors' own loader
    returns (every dtype it maps, 0-d and empty tensors, a sharded dir with an index), and a
    file cut short is one clear error."""
    from checkpoint_tools.weight_io import FileReads

    g = torch.Generator().manual_seed(0)
    shard1 = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
              "c": torch.randn(2, 2, generator=g).half(), "d": torch.arange(6).view(2, 3),
              "e": torch.tensor(3.5), "f": torch.empty(0, 4)}
    shard2 = {"g": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
              "h": torch.tensor([True, False])}
    save_file(shard1, str(tmp_path / "m-1.safetensors"))
    save_file(shard2, str(tmp_path / "m-2.safetensors"))
    index = {"weight_map": {**{k: "m-1.safetensors" for k in shard1},
                            **{k: "m-2.safetensors" for k in shard2}}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    reads = FileReads(str(tmp_path))
    try:
        for fname, shard in (("m-1.safetensors", shard1), ("m-2.safetensors", shard2)):
            want = load_file(str(tmp_path / fname))
            assert set(want) == set(shard)
            for k, t in want.items():
                got = reads(k)
                assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), k
    finally:
        reads.close()
    one = tmp_path / "single"
    one.mkdir()
    save_file({"w": torch.randn(64, 64, generator=g)}, str(one / "model.safetensors"))
    data = (one / "model.safetensors").read_bytes()
    (one / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ConversionError, match="truncated"):
        FileReads(str(one))("w")


@pytest.mark.parametrize("family,tp", [("qwen2", 1), ("qwen2", 2), ("llama", 2), ("qwen3", 1)])
def test_row_blocks_build_the_same_shards(tmp_path, family, tp):
    """import-hf reads HF rows straight into parameters (`mapping.row_blocks`); the shards so
    assembled equal `mapping.to_megatron_shard`'s (the reference) on every tp rank, for every
    kind of parameter (qkv with GQA, gate/up, padded vocab, row-parallel at tp 1, norms)."""
    from megaprm.models import mapping

    d = save_tiny_model(family, str(tmp_path / family), seed=7, tie=False, vocab_size=200)
    spec, w = spec_from_hf(d), HFWeights(d)
    suffixes = [s for s, (_, hf) in mapping._LAYER_RULES.items()
                if f"model.layers.1.{hf[0]}" in w]
    names = [f"decoder.layers.1.{s}" for s in suffixes] + [
        "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    kinds = set()
    for name in names:
        rule = mapping.rule_for(name, spec)
        for rank in range(tp):
            want = mapping.to_megatron_shard(rule, w, spec, rank, tp)
            blocks = mapping.row_blocks(rule, spec, want.shape[0], rank, tp)
            if blocks is None:
                assert rule.kind == "row" and tp > 1
                continue
            kinds.add(rule.kind)
            got = torch.zeros_like(want)
            for hf_name, src, dst, n in blocks:
                got[dst:dst + n] = w(hf_name)[src:src + n]
            assert torch.equal(got, want), (name, rank)
    assert kinds >= {"qkv", "gate_up", "vocab", "replicated"}


@pytest.mark.parametrize("direct,block", [(True, 8 << 20), (True, 1 << 20), (False, 0)])
def test_write_safetensors_matches_safetensors(tmp_path, monkeypatch, direct, block):
    """Export's shard writer produces files safetensors reads back exactly (dtypes, views that
    are not contiguous or share a storage, 0-d and empty tensors, metadata, tensors copied from
    byte ranges of a file, row-parallel weights assembled from column blocks; O_DIRECT with
    tensors and rows that span bounce buffers, every buffer reused several times at 1 MiB, and
    a last partial block; plain writes)."""
    from safetensors import safe_open

    from checkpoint_tools import shards
    from checkpoint_tools.shards import Assembled, FileBytes, write_safetensors

    if block:
        monkeypatch.setattr(shards._DirectFile, "BLOCK", block)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(3_000_000, generator=g)  # a "checkpoint file": the tensor's raw bytes
    src_path = str(tmp_path / "src.bin")
    src.numpy().tofile(src_path)
    base = torch.randn(6, 4, generator=g)
    tensors = {"t": base.t(), "top": base[:3], "bottom": base[3:],
               "h": torch.randn(5, generator=g).half(), "b": torch.randn(3, generator=g).bfloat16(),
               "i": torch.arange(7), "u": torch.arange(3, dtype=torch.uint8),
               "flag": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
               "empty": torch.empty(0, 3), "big": torch.randn(2_500_001, generator=g)}
    # rows 2.9M.. then 0..1.1M of src, then 5 more: three pieces of one tensor
    pieces = [(src_path, 4 * 2_900_000, 4 * 100_000), (src_path, 0, 4 * 1_100_000),
              (src_path, 4 * 7, 4 * 5)]
    want = {**tensors, "copied": torch.cat([src[2_900_000:], src[:1_100_000], src[7:12]])}
    tensors["copied"] = FileBytes(torch.float32, (1_200_005,), pieces)
    # row-parallel weights saved in column blocks (one block also split by rows), each block's
    # rows contiguous in a file: 6,000-byte rows straddle the bounce buffers' ends, and a row of
    # the wide one is longer than a 1 MiB buffer
    blocks_path, at = str(tmp_path / "blocks.bin"), 0
    with open(blocks_path, "wb") as f:
        for name, shape, cuts in [("row_parallel", (700, 1500), [(0, 700, 0, 600),
                                                                  (0, 300, 600, 1500),
                                                                  (300, 700, 600, 1500)]),
                                  ("wide", (3, 300_000), [(0, 3, 150_000, 300_000),
                                                          (0, 3, 0, 150_000)])]:
            full, parts = torch.randn(*shape, generator=g), []
            for r0, r1, c0, c1 in cuts:
                data = full[r0:r1, c0:c1].contiguous().numpy().tobytes()
                f.write(data)
                parts.append((blocks_path, at, r0, r1 - r0, 4 * c0, 4 * (c1 - c0)))
                at += len(data)
            want[name] = full
            tensors[name] = Assembled(torch.float32, shape, 4 * shape[1], parts)
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, tensors, metadata={"format": "pt"}, direct=direct)
    got = load_file(path)
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    with open(path, "rb") as f:  # the data starts 8-byte aligned, as safetensors writes it
        assert (8 + int.from_bytes(f.read(8), "little")) % 8 == 0


def test_direct_writer_thread_error_reaches_the_caller(tmp_path, monkeypatch):
    """A write that fails in the O_DIRECT writer thread (here ENOSPC) raises in the caller."""
    import errno

    from checkpoint_tools import shards

    monkeypatch.setattr(shards._DirectFile, "BLOCK", 1 << 20)
    f = shards._DirectFile(str(tmp_path / "x"))
    if f._plain is not None:
        pytest.skip("SKIPPED LOUDLY: this file system refuses O_DIRECT; no writer thread")

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shards.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        try:
            for _ in range(8):
                f.write(memoryview(bytes(1 << 20)))
        finally:
            f.close()
    assert not f._writer.is_alive()


def test_lean_imports_leave_torch_compile_and_wandb_as_they_were():
    """The CLI's lean import defers megatron-core's import-time torch.compile and hides wandb
    only while megatron-core is imported: afterwards torch.compile is torch's own and wandb
    imports again (a caller of `megaprm convert` in its own process keeps its wandb)."""
    code = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "from checkpoint_tools.__main__ import lean_imports\n"
        "lean_imports()\n"
        "assert torch.compile is real\n"
        "assert 'wandb' not in sys.modules or sys.modules['wandb'] is not None\n"
        "import wandb\n"
        "assert 'torch._inductor' not in sys.modules\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_file_copies_refuse_a_tensor_outside_the_parameters():
    """A writer that saved a copy of a parameter would write never-written memory: refused."""
    from checkpoint_tools.weight_io import FileCopies

    params = [torch.zeros(4, 8), torch.zeros(16)]
    copies = FileCopies([], params)
    copies.check_source(params[0][1:3])  # views of a parameter (fc1's halves) are fine
    copies.check_source(params[1])
    with pytest.raises(RuntimeError, match="not a parameter of the stage"):
        copies.check_source(params[0].clone())


@pytest.mark.parametrize("cores,local_ranks,threads", [
    (2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 1, 4), (16, 8, 2), (16, 2, 4), (1, 1, 1)])
def test_writer_threads_share_the_cores_among_local_ranks(monkeypatch, cores, local_ranks,
                                                         threads):
    """Writer threads per rank = the cores this machine's ranks share, 1 to WRITER_THREADS."""
    from checkpoint_tools import megatron_io

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert megatron_io.writer_threads(local_ranks) == threads
