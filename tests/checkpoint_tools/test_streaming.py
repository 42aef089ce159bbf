"""export-hf file to file (`checkpoint_tools.streaming`): the same bytes as an export that loads
the stage through megatron-core, or that export itself where the checkpoint needs it.

Reference: export-hf with verification on (it loads the stage with `dist_checkpointing.load`,
gathers it and writes it from memory) and the original HF tensors.
"""
import io
import os

import pytest
import torch

from checkpoint_tools import ConversionError, export_hf, import_hf
from checkpoint_tools.streaming import _rebuilt
from megaprm.models.mapping import HFWeights
from megaprm.models.tiny import save_tiny_model


def _files(d: str) -> dict:
    out = {}
    for f in sorted(os.listdir(d)):
        with open(os.path.join(d, f), "rb") as fh:
            out[f] = fh.read()
    return out


def _tensors(d: str) -> dict:
    w = HFWeights(d)
    return {k: w(k) for k in w.keys()}  # noqa: SIM118 (not a dict)


def _same_weights(hf: str, exported: str) -> None:
    original, back = _tensors(hf), _tensors(exported)
    assert set(back) == set(original)
    for k, t in original.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


@pytest.mark.parametrize("family,kw,shard,direct", [
    ("qwen2", {"tie": True}, "20KB", False),           # tied embeddings, many shards + index
    ("llama", {"head": "token_cls"}, "5GB", False),    # a classification head, one file
    ("qwen3", {}, "60KB", True),                       # qk-norm; O_DIRECT writes
])
def test_streamed_export_equals_the_loading_export(tmp_path, monkeypatch, family, kw, shard,
                                                   direct):
    from checkpoint_tools import streaming

    if direct:  # the switch to O_DIRECT that a > 1 GiB export takes
        monkeypatch.setattr(streaming, "DIRECT_ABOVE_BYTES", 0)
    hf = save_tiny_model(family, str(tmp_path / "hf"), seed=7, **kw)
    import_hf(hf, str(tmp_path / "ck"), verify=False)
    loaded = export_hf(str(tmp_path / "ck"), str(tmp_path / "loaded"), max_shard_size=shard)
    streamed = export_hf(str(tmp_path / "ck"), str(tmp_path / "streamed"), verify=False,
                         max_shard_size=shard)
    assert streamed["streamed"] and not loaded["streamed"]
    assert streamed["files"] == loaded["files"] and streamed["bytes"] == loaded["bytes"]
    assert _files(str(tmp_path / "streamed")) == _files(str(tmp_path / "loaded"))
    _same_weights(hf, str(tmp_path / "streamed"))


# ------------------------------------------- the plan without megatron-core vs the plan of a stage

def _stage(spec, dtype=torch.float32):
    """The whole model as one stage (tp = pp = 1), built by megatron-core as export-hf used to."""
    from checkpoint_tools import ranks, stages

    g = ranks.init_ranks(1, 1)
    return g, stages.build(spec, g, dtype, init=False)


def _stage_pieces(model, items) -> dict:
    """Reference for `streaming._metadata_pieces`: each parameter's chunks found through the
    stage's own sharded state dict (megatron-core's layer stacking and swiglu factory), as
    export-hf planned before it stopped importing megatron-core."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
    )

    from checkpoint_tools import stages

    sharded = stages.sharded_state_dict(model)
    if any(isinstance(v, ShardedTensorFactory) for v in nested_values(sharded)):
        apply_factories(sharded)
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    spans = sorted((p.data_ptr(), p) for p in model.parameters())
    out = {}
    for st in (v for v in nested_values(sharded) if isinstance(v, ShardedTensor)):
        assert st.flattened_range is None and st.data.is_contiguous()
        data = st.data
        owner = next(p for ptr, p in reversed(spans) if ptr <= data.data_ptr())
        base = data.data_ptr() - owner.data_ptr()
        row = data[0].numel() * data.itemsize if data.dim() else 0
        sizes = (1,) * st.prepend_axis_num + tuple(st.local_shape)
        for lo, path, off, size, cols in items.rows(st.key, tuple(st.global_offset), sizes,
                                                    data.dtype):
            if cols is not None:
                cols = (base // row + cols[0], *cols[1:])
            out.setdefault(names[owner.data_ptr()], []).append((base + lo, path, off, size,
                                                                cols))
    return {n: sorted(r, key=lambda x: x[:4]) for n, r in out.items()}


def _plan_key(plan: list) -> list:
    return [(n, t.dtype, tuple(t.shape), type(t).__name__, getattr(t, "pieces", None),
             getattr(t, "parts", None), getattr(t, "row_bytes", None)) for n, t in plan]


def _check_plan_against_stage(ckpt: str) -> None:
    """The plan from `.metadata` and the config alone equals the plan through a built stage's
    sharded state dict, and `.metadata` read without DCP equals DCP's own reading."""
    from checkpoint_tools import ranks, streaming
    from megaprm.models.hf_spec import spec_from_hf

    model_dir = os.path.join(ckpt, "model")
    spec = spec_from_hf(os.path.join(ckpt, "hf"))
    assert streaming.read_metadata(model_dir) == streaming._dcp_metadata(model_dir)
    try:
        _, model = _stage(spec)
        ref = streaming.plan_export(model_dir, spec, torch.float32,
                                    pieces_of=lambda items: _stage_pieces(model, items))
    finally:
        ranks.in_process(lambda: None)  # tear the world of one down
    assert _plan_key(streaming.plan_export(model_dir, spec, torch.float32)) == _plan_key(ref)


@pytest.mark.parametrize("family,kw", [
    ("qwen2", {"tie": True}), ("qwen2", {"tie": False}), ("qwen3", {}),
    ("llama", {"head": "token_cls"}), ("prm_mlp", {}), ("qwen3_moe", {}), ("qwen2_moe", {})])
def test_stage_params_are_a_built_stages(tmp_path, family, kw):
    """`stage_params` (from the config) and `checkpoint_keys` against megatron-core: the
    stage's named_parameters (names, shapes, order) and its sharded state dict's keys,
    global offsets and sizes (fc1's two swiglu halves together make the whole parameter)."""
    from checkpoint_tools import ranks, stages, streaming
    from megaprm.models.hf_spec import spec_from_hf

    if family == "prm_mlp":
        from checkpoint_tools import hf_reference
        from megaprm.models.tiny import tiny_config

        hf = str(tmp_path / "hf")
        hf_reference.save_process_reward_model(tiny_config("qwen2", tie=False), hf, seed=5)
    else:
        hf = save_tiny_model(family, str(tmp_path / "hf"), seed=3, **kw)
    spec = spec_from_hf(hf)
    try:
        _, model = _stage(spec)
        assert streaming.stage_params(spec) == [(n, tuple(p.shape))
                                                for n, p in model.named_parameters()]
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        sharded = stages.sharded_state_dict(model)
        apply_factories(sharded)
        names = {p.data_ptr(): (n, tuple(p.shape)) for n, p in model.named_parameters()}
        seen = {}
        for st in (v for v in nested_values(sharded) if isinstance(v, ShardedTensor)):
            owner = max(ptr for ptr in names if ptr <= st.data.data_ptr())
            seen.setdefault(names[owner], []).append(
                (st.key, tuple(st.global_offset), (1,) * st.prepend_axis_num
                 + tuple(st.local_shape)))
    finally:
        ranks.in_process(lambda: None)
    assert sorted(seen) == sorted(streaming.stage_params(spec))
    for (name, shape), shards in seen.items():
        key, offsets, sizes = streaming.checkpoint_keys(name, shape)
        d = len(sizes) - len(shape)  # the layer axis, if any
        assert {k for k, _, _ in shards} == {key}, name
        assert min(o for _, o, _ in shards) == offsets, name
        assert sum(s[d] for _, _, s in shards) == sizes[d], name  # halves stack on dim 0
        assert all(s[:d] + s[d + 1:] == sizes[:d] + sizes[d + 1:] for _, _, s in shards), name


def test_layers_saved_over_two_stages_stream(tmp_path):
    """pp = 2 at save: layer chunks carry global layer offsets; exported in this process at
    the checkpoint's own layout (no stage ranks spawned), same files as from a tp = 1 save."""
    hf = save_tiny_model("qwen2", str(tmp_path / "hf"), seed=8)
    import_hf(hf, str(tmp_path / "ck"), tp=1, pp=2, verify=False)
    import_hf(hf, str(tmp_path / "ck1"), verify=False)
    rep = export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), verify=False)
    export_hf(str(tmp_path / "ck1"), str(tmp_path / "ref"), verify=False)
    assert rep["streamed"] and rep["pp"] == 2
    _same_weights(hf, str(tmp_path / "out"))
    assert _files(str(tmp_path / "out")) == _files(str(tmp_path / "ref"))
    _check_plan_against_stage(str(tmp_path / "ck"))
    _check_plan_against_stage(str(tmp_path / "ck1"))


def test_row_parallel_chunks_saved_at_tp2_stream(tmp_path, monkeypatch):
    """Saved at tp = 2: o_proj/down_proj chunks split columns. They are assembled per tensor
    (buffered and O_DIRECT writers, shards small enough that tensors straddle them), and the
    files equal the export of a tp = 1 save and the source HF tensors bit for bit. Where the
    plan is refused the export loads the stage at the checkpoint's layout instead."""
    from checkpoint_tools import shards, streaming

    hf = save_tiny_model("llama", str(tmp_path / "hf"), seed=9)
    import_hf(hf, str(tmp_path / "ck"), tp=2, pp=1, verify=False)
    # writes from memory go in pieces (shards.write_all): an odd size splits every tensor
    monkeypatch.setattr(shards, "WRITE_PIECE", 1000)
    import_hf(hf, str(tmp_path / "ck1"), verify=False)
    ref = export_hf(str(tmp_path / "ck1"), str(tmp_path / "ref"), verify=False,
                    max_shard_size="30KB")
    rep = export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), verify=False,
                    max_shard_size="30KB")
    assert rep["streamed"] and rep["tp"] == 2 and rep["files"] == ref["files"]
    assert len(rep["files"]) > 1
    assert _files(str(tmp_path / "out")) == _files(str(tmp_path / "ref"))
    _same_weights(hf, str(tmp_path / "out"))
    _check_plan_against_stage(str(tmp_path / "ck"))
    _check_plan_against_stage(str(tmp_path / "ck1"))
    monkeypatch.setattr(streaming, "DIRECT_ABOVE_BYTES", 0)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "direct"), verify=False,
              max_shard_size="30KB")
    assert _files(str(tmp_path / "direct")) == _files(str(tmp_path / "ref"))

    refused = []

    def refuse(*a, **k):
        refused.append(a[0])
        raise streaming.NotStreamable("refused by the test")

    monkeypatch.setattr(streaming, "plan_export", refuse)  # this process only: the spawned
    rep = export_hf(str(tmp_path / "ck"), str(tmp_path / "loaded"), verify=False)  # ranks load
    assert not rep["streamed"] and rep["not_streamed_because"] == "refused by the test"
    _same_weights(hf, str(tmp_path / "loaded"))
    # a tp1 checkpoint loads in this process: the refused plan is not made a second time there
    refused.clear()
    rep = export_hf(str(tmp_path / "ck1"), str(tmp_path / "loaded1"), verify=False)
    assert not rep["streamed"] and rep["not_streamed_because"] == "refused by the test"
    assert len(refused) == 1
    _same_weights(hf, str(tmp_path / "loaded1"))


def test_writes_from_memory_go_in_pieces():
    """`write_all` hands a file's write at most WRITE_PIECE bytes at a time (large page-cache
    folios; shards.py), resumes after a short write, and the file gets every byte in order."""
    from checkpoint_tools.shards import WRITE_PIECE, write_all

    data = memoryview(bytes(range(256)) * (WRITE_PIECE // 64 + 3))  # 4 pieces and a tail
    out, sizes = io.BytesIO(), []

    def write(view):
        sizes.append(len(view))
        n = len(view) if len(sizes) % 3 else len(view) // 2  # every third write is short
        return out.write(view[:n])

    write_all(write, data)
    assert out.getvalue() == bytes(data)
    assert max(sizes) == WRITE_PIECE and len(sizes) >= 3  # a short write was resumed
    assert sum(sizes) > len(data)  # the short write's rest was handed over again


def test_assembled_blocks_must_tile_the_tensor():
    from checkpoint_tools.streaming import NotStreamable, _tiled

    _tiled([("f", 0, 0, 4, 0, 8), ("f", 32, 0, 4, 8, 8)], "w", 4, 16)  # two column halves
    with pytest.raises(NotStreamable, match="overlap"):
        _tiled([("f", 0, 0, 4, 0, 12), ("f", 32, 0, 4, 8, 8)], "w", 4, 16)
    with pytest.raises(NotStreamable, match="48 of 64 bytes"):
        _tiled([("f", 0, 0, 4, 0, 8), ("f", 32, 0, 2, 8, 8)], "w", 4, 16)
    with pytest.raises(NotStreamable, match="outside"):
        _tiled([("f", 0, 0, 4, 0, 8), ("f", 32, 0, 4, 12, 8)], "w", 4, 16)


def test_truncated_or_incomplete_checkpoint(tmp_path):
    hf = save_tiny_model("qwen2", str(tmp_path / "hf"), seed=10)
    ck = tmp_path / "ck"
    import_hf(hf, str(ck), verify=False)
    model = ck / "model"
    big = max((p for p in model.iterdir() if p.suffix == ".distcp"), key=os.path.getsize)
    data = big.read_bytes()
    big.write_bytes(data[: len(data) // 2])
    # the manifest names the short file before any reader opens it ...
    with pytest.raises(ConversionError, match=f"{big.name} has {len(data) // 2} bytes, "
                                              f"MANIFEST.json says {len(data)}"):
        export_hf(str(ck), str(tmp_path / "out"), verify=False)
    assert not (tmp_path / "out").exists()
    # ... and a checkpoint without one (older megaprm) against its own .metadata's byte ranges
    (ck / "MANIFEST.json").unlink()
    with pytest.raises(ConversionError, match=f"{big.name} has {len(data) // 2} bytes but "
                                              r"\S+ is stored up to byte \d+ \(truncated\)"):
        export_hf(str(ck), str(tmp_path / "out"), verify=False)
    assert not (tmp_path / "out").exists()
    (model / ".metadata").unlink()
    with pytest.raises(ConversionError, match="no .metadata: not a complete torch_dist"):
        export_hf(str(ck), str(tmp_path / "out"), verify=False)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12.0).reshape(3, 4),
    lambda: torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(),   # strided
    lambda: torch.arange(20, dtype=torch.int64)[5:],                    # storage offset
])
def test_item_pickle_is_read_as_torch_saved_it(make):
    """(storage offset, size, stride, dtype) from data.pkl equal the saved tensor's own."""
    import zipfile

    t = make()
    buf = io.BytesIO()
    torch.save(t, buf)
    zf = zipfile.ZipFile(buf)
    pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
    record, offset, size, stride, dtype = _rebuilt(zf.read(pkl))
    assert (offset, size, stride, dtype) == (t.storage_offset(), tuple(t.shape), t.stride(),
                                             t.dtype)
    assert any(n.endswith(f"/data/{record}") for n in zf.namelist())
