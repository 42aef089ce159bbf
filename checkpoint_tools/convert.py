"""HF safetensors <-> Megatron distributed checkpoint, and the logit check between them.

Every command has two halves:

* the *rank* half (`_import_rank`, `_export_rank`, `_verify_rank`) runs on each of the tp*pp
  ranks: build this rank's stage, move weights, forward the check batch;
* the *leader* half (`import_hf`, `export_hf`, `verify`) validates what it can before any rank
  starts, runs the ranks (under torchrun: this process is one of them; otherwise it spawns
  tp*pp local ranks), compares the Megatron outputs with transformers' and renames the
  finished directory into place.

Weights stream: import copies HF rows into the torch_dist files without holding them
(`FileCopies`; with verification it reads them into this rank's shard, since the forward needs
them); export gathers one parameter at a time (`weight_sync.iter_hf_weights`) and rank 0 holds
at most one safetensors shard before writing it.

The pieces they are built from: `ranks` (starting and agreeing ranks), `weight_io` (HF files
in and out of a stage), `megatron_io` (torch_dist save and load).
"""
from __future__ import annotations

import functools
import json
import os
import time

import torch

from checkpoint_tools import hf_reference, layout, manifest, stages, streaming
from checkpoint_tools.layout import DTYPES, ConversionError
from checkpoint_tools.megatron_io import (
    import_loader_modules,
    import_writer_modules,
    load_checkpoint,
    model_dir,
    save_checkpoint,
)
from checkpoint_tools.ranks import (
    agree,
    discard,
    finish_on_leader,
    init_ranks,
    leader_owned,
    peak_rss_mb,
    rank_report,
    rss_report,
    run_ranks,
    shared_tmp,
    world_of,
)
from checkpoint_tools.shards import ShardWriter
from checkpoint_tools.weight_io import (
    FileCopies,
    FileReads,
    check_finite,
    check_hf_weights,
    plan_stage,
    read_stage,
)
from megaprm.models import mapping
from megaprm.models.hf_spec import ModelSpec, UnsupportedModelError, spec_from_hf
from megaprm.parallel import launch
from megaprm.rollout.weight_sync import iter_hf_weights

VERIFY_BATCH, VERIFY_SEQ = 2, 16


SKIPPED = {"skipped": True, "reason": "--no-verify: transformers-vs-Megatron logits not compared"}


def verify_batch(spec: ModelSpec, seed: int = 1234) -> torch.Tensor:
    """The fixed [b, s] token batch every check runs on."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, spec.vocab_size, (VERIFY_BATCH, VERIFY_SEQ), generator=g)


def load_spec(hf_dir: str) -> ModelSpec:
    try:
        return spec_from_hf(hf_dir)
    except (UnsupportedModelError, FileNotFoundError) as e:
        raise ConversionError(str(e)) from None


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> None:
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ConversionError(f"--{name}={v!r}: must be a positive integer")
    try:
        spec.check_parallel(tp, pp, ep)
    except UnsupportedModelError as e:
        raise ConversionError(str(e)) from None


def _import_rank(hf_dir: str, out_dir: str, tmp_dir: str | None, tp: int, pp: int,
                 dtype: str, verify: bool, ep: int = 1) -> dict:
    g = init_ranks(tp, pp, ep)
    with shared_tmp(tmp_dir, out_dir) as tmp:
        spec = spec_from_hf(hf_dir)
        model = stages.build(spec, g, DTYPES[dtype], init=False)  # every weight is loaded
        check_hf_weights(hf_dir, model, spec, g)
        weights = FileReads(hf_dir)
        import_writer_modules()  # ~0.15 s of module loading: process start, not conversion
        t0 = time.perf_counter()
        copies = None  # None: the save writes the weights from memory
        try:
            if verify:  # the forward needs the weights in memory
                agree("HF weights", functools.partial(read_stage, model, weights, spec, g))
            else:
                _, jobs, columns = agree("HF weights", functools.partial(
                    plan_stage, model, weights, spec, g))
                copies = FileCopies.for_jobs(weights, jobs, model, columns)
                agree("HF weights", functools.partial(check_finite, weights, jobs, columns))
            t_read = time.perf_counter() - t0
            save_checkpoint(model, model_dir(tmp), copies=copies)
        finally:
            weights.close()  # the HF files the copies read too
        t_save = time.perf_counter() - t0 - t_read
        outputs, t_verify = None, 0.0
        if verify:  # the weights as loaded and saved, still in memory; re-reading the
            # written checkpoint is the `verify` command's job
            t1 = time.perf_counter()
            outputs = stages.full_outputs(model, spec, g, verify_batch(spec))
            t_verify = time.perf_counter() - t1
        return rank_report(g, outputs, tmp_dir=tmp, read_s=t_read, save_s=t_save,
                            verify_s=t_verify)


def _export_rank(ckpt_dir: str, out_dir: str, tmp_dir: str | None, tp: int, pp: int,
                 max_shard_bytes: int, verify: bool, ep: int = 1) -> dict:
    """One rank of export-hf. A torchrun world of one without verification streams file to
    file (`_export_streaming`) where the checkpoint allows it, else loads the stage (outside
    torchrun `export_hf` has tried the stream in its own process before starting ranks)."""
    g = init_ranks(tp, pp, ep)
    with shared_tmp(tmp_dir, out_dir) as tmp:
        meta = layout.CheckpointMeta.read(ckpt_dir)
        spec = spec_from_hf(os.path.join(ckpt_dir, layout.HF_SUBDIR))
        why = {}
        if g.world_size == 1 and not verify and launch.under_torchrun():
            # nothing needs the weights in memory
            streamed = _export_streaming(ckpt_dir, spec, DTYPES[meta.dtype], tmp,
                                         max_shard_bytes)
            if streamed["streamed"]:
                return rank_report(g, None, tmp_dir=tmp, verify_s=0.0, **streamed)
            why = {"why": streamed["why"]}
        model = stages.build(spec, g, DTYPES[meta.dtype], init=False)
        import_loader_modules()  # module loading: process start, not conversion
        t0 = time.perf_counter()
        load_checkpoint(model, model_dir(ckpt_dir))
        t_load = time.perf_counter() - t0
        writer = ShardWriter(tmp, max_shard_bytes) if g.rank == 0 else None
        for name, tensor in iter_hf_weights(model, g, spec):
            if writer is not None:  # other ranks take part in the gathers, drop the tensors
                writer.add(name, tensor)
        files = writer.finish() if writer is not None else None
        t_write = time.perf_counter() - t0 - t_load
        t1 = time.perf_counter()
        outputs = stages.full_outputs(model, spec, g, verify_batch(spec)) if verify else None
        return rank_report(g, outputs, tmp_dir=tmp, load_s=t_load, write_s=t_write,
                            verify_s=time.perf_counter() - t1,
                            files=files, bytes=writer.total_bytes if writer else None,
                            peak_shard_bytes=writer.peak_pending_bytes if writer else None,
                            **why)


def _export_streaming(ckpt_dir: str, spec: ModelSpec, dtype: torch.dtype, tmp: str,
                      max_shard_bytes: int) -> dict:
    """export-hf file to file (`streaming.plan_export`, `streaming.write_shards`), or
    {"streamed": False, "why": ...} where the checkpoint needs a real load (then nothing was
    written). Whatever tp and pp the checkpoint was saved at (its chunks are in global
    coordinates); needs neither megatron-core nor a process group."""
    t0 = time.perf_counter()
    try:
        plan = streaming.plan_export(model_dir(ckpt_dir), spec, dtype)
    except streaming.NotStreamable as e:
        return {"streamed": False, "why": str(e)}
    t_plan = time.perf_counter() - t0
    writer, files = streaming.write_shards(plan, tmp, max_shard_bytes)
    return {"load_s": t_plan, "write_s": time.perf_counter() - t0 - t_plan, "files": files,
            "bytes": writer.total_bytes, "peak_shard_bytes": writer.peak_pending_bytes,
            "streamed": True}


def export_hf_in_process(ckpt_dir: str, out_dir: str, *, model: str = "actor",
                         max_shard_size: str = "5GB", force: bool = False) -> dict:
    """export-hf file to file in this process, unverified, for a caller that is itself one rank
    of its own job (a comparison re-evaluating a finished run's final policy): no ranks
    started, no process group used, no megatron-core import (`streaming`). The output is
    sealed and renamed into place as `export_hf`'s is. Raises ConversionError where the
    checkpoint cannot be streamed (it needs `export_hf`'s real load)."""
    given = ckpt_dir
    ckpt_dir = layout.resolve_checkpoint(ckpt_dir, model)
    out_dir = os.path.abspath(out_dir)
    meta = layout.CheckpointMeta.read(ckpt_dir)
    manifest.check(ckpt_dir, ConversionError)
    spec = load_spec(os.path.join(ckpt_dir, layout.HF_SUBDIR))
    layout.check_target(out_dir, force, inputs=(given, ckpt_dir))
    tmp = layout.make_tmp(out_dir)
    try:
        r = _export_streaming(ckpt_dir, spec, DTYPES[meta.dtype], tmp,
                              layout.parse_size(max_shard_size))
        if not r["streamed"]:
            raise ConversionError(f"{ckpt_dir}: cannot be exported file to file ({r['why']}); "
                                  "use `megaprm convert export-hf`")
        _write_hf_config(ckpt_dir, tmp, meta.dtype)
        manifest.write(tmp, format=layout.HF_EXPORT_FORMAT, version=1)
        layout.commit(tmp, out_dir, force)
    finally:
        discard(tmp)  # after the rename the path no longer exists
    return {"ckpt": ckpt_dir, "out": out_dir, "dtype": meta.dtype, "files": r["files"],
            "bytes": r["bytes"]}


def _verify_rank(ckpt_dir: str, tp: int, pp: int, ep: int = 1) -> dict:
    g = init_ranks(tp, pp, ep)
    meta = layout.CheckpointMeta.read(ckpt_dir)
    spec = spec_from_hf(os.path.join(ckpt_dir, layout.HF_SUBDIR))
    model = stages.build(spec, g, DTYPES[meta.dtype], init=False)
    load_checkpoint(model, model_dir(ckpt_dir))
    return rank_report(g, stages.full_outputs(model, spec, g, verify_batch(spec)))


def compare_logits(megatron: torch.Tensor, reference: torch.Tensor, dtype: str,
            atol: float | None = None, min_top1: float | None = None) -> dict:
    """Logit agreement report. Default tolerance: relative to the largest |reference logit|
    (1e-4 in fp32; 3e-2 in bf16/fp16, where both sides compute in that dtype)."""
    diff = (megatron - reference).abs()
    scale = max(1.0, float(reference.abs().max()))
    tol = atol if atol is not None else (1e-4 if dtype == "fp32" else 3e-2) * scale
    need_top1 = min_top1 if min_top1 is not None else (1.0 if dtype == "fp32" else 0.9)
    top1 = float((megatron.argmax(-1) == reference.argmax(-1)).float().mean())
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "top1_agreement": top1, "tolerance": tol, "min_top1": need_top1,
            "shape": list(reference.shape), "dtype": dtype,
            "passed": bool(float(diff.max()) <= tol and top1 >= need_top1)}


def reference_outputs(hf_dir: str, spec: ModelSpec, dtype: str) -> torch.Tensor:
    model = hf_reference.load_reference(hf_dir, spec, DTYPES[dtype])
    return hf_reference.reference_outputs(model, spec, verify_batch(spec))


def _verified(what: str, megatron: torch.Tensor, hf_dir: str, spec: ModelSpec, dtype: str,
              rank_s: float) -> dict:
    """Compare with transformers; `seconds` = the ranks' forward + the reference (timed apart
    from the conversion)."""
    t0 = time.perf_counter()
    report = compare_logits(megatron, reference_outputs(hf_dir, spec, dtype), dtype)
    report["seconds"] = rank_s + time.perf_counter() - t0
    if not report["passed"]:
        raise ConversionError(
            f"{what}: Megatron outputs differ from transformers beyond tolerance (max abs diff "
            f"{report['max_abs_diff']:.3g} > {report['tolerance']:.3g} or top-1 agreement "
            f"{report['top1_agreement']:.3f} < {report['min_top1']}); nothing was written "
            "(--no-verify keeps the result for debugging)")
    return report


def import_hf(hf_dir: str, out_dir: str, *, tp: int = 1, pp: int = 1,
              dtype: str | None = None, force: bool = False, verify: bool = True,
              ep: int = 1) -> dict:
    """HF directory -> megaprm checkpoint directory (see `layout`). Returns a report dict.
    `ep` > 1 (MoE models): tp*pp*ep ranks, each reading only its stage's and its experts'
    tensors; the checkpoint itself holds every expert by its global index (any ep loads it)."""
    hf_dir, out_dir = os.path.abspath(hf_dir), os.path.abspath(out_dir)
    layout.check_target(out_dir, force, inputs=(hf_dir,))
    spec = load_spec(hf_dir)
    check_layout(spec, tp, pp, ep)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    dtype = dtype or layout.hf_dtype_name(spec.hf_config)
    try:  # opens every file's header: truncated or corrupt files fail here, before any rank
        mapping.HFWeights(hf_dir)
    except (ValueError, FileNotFoundError) as e:
        raise ConversionError(str(e)) from None
    tmp_dir = None if launch.under_torchrun() else layout.make_tmp(out_dir)
    t0 = time.perf_counter()
    try:
        results = run_ranks(_import_rank, world_of(tp, pp, ep), hf_dir, out_dir, tmp_dir, tp,
                             pp, dtype, verify, ep)
    except BaseException:
        discard(tmp_dir)
        raise
    r0 = results[0]

    def finish() -> dict:
        report = {"command": "import-hf", "hf": hf_dir, "out": out_dir, "tp": tp, "pp": pp,
                  "ep": ep, "dtype": dtype, "architecture": spec.architecture,
                  "seconds": time.perf_counter() - t0, "core_s": r0["read_s"] + r0["save_s"],
                  "read_s": r0["read_s"], "save_s": r0["save_s"], **rss_report(results)}
        report["verify"] = _verified("import-hf", r0["outputs"], hf_dir, spec, dtype,
                                     r0["verify_s"]) if verify else SKIPPED
        layout.copy_side_files(hf_dir, os.path.join(r0["tmp_dir"], layout.HF_SUBDIR))
        layout.CheckpointMeta(format=layout.FORMAT, version=1, architecture=spec.architecture,
                              dtype=dtype, tp=tp, pp=pp, source=hf_dir).write(r0["tmp_dir"])
        manifest.write(r0["tmp_dir"], format=layout.FORMAT, version=1)  # last: seals the files
        layout.commit(r0["tmp_dir"], out_dir, force)
        return report

    return finish_on_leader(lambda: leader_owned(r0["tmp_dir"], finish))


def _write_hf_config(ckpt_dir: str, tmp_dir: str, dtype: str) -> None:
    """Side files verbatim; config.json's dtype follows the exported weights if they differ."""
    layout.copy_side_files(os.path.join(ckpt_dir, layout.HF_SUBDIR), tmp_dir)
    path = os.path.join(tmp_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if layout.hf_dtype_name(cfg) != dtype:
        for key in ("dtype", "torch_dtype"):
            if key in cfg:
                cfg[key] = layout.HF_DTYPE_NAME[dtype]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)


def export_hf(ckpt_dir: str, out_dir: str, *, tp: int | None = None,
              pp: int | None = None, max_shard_size: str = "5GB", force: bool = False,
              verify: bool = True, model: str = "actor", ep: int = 1) -> dict:
    """megaprm checkpoint -> HF directory loadable by transformers / vLLM. Returns a report.

    `ckpt_dir` is anything `layout.resolve_checkpoint` accepts (a checkpoint, a trainer step,
    run or checkpoints dir); `model` picks the trainer's `actor` or `prm`."""
    given = ckpt_dir  # a run, checkpoints or step dir: writing into any of it is refused
    ckpt_dir = layout.resolve_checkpoint(ckpt_dir, model)
    out_dir = os.path.abspath(out_dir)
    meta = layout.CheckpointMeta.read(ckpt_dir)
    manifest.check(ckpt_dir, ConversionError)
    spec = load_spec(os.path.join(ckpt_dir, layout.HF_SUBDIR))
    # None is "as saved"; 0 is no layout (refused by check_layout, as import-hf refuses it)
    tp, pp = meta.tp if tp is None else tp, meta.pp if pp is None else pp
    check_layout(spec, tp, pp, ep)
    layout.check_target(out_dir, force, inputs=(given, ckpt_dir))
    max_bytes = layout.parse_size(max_shard_size)
    tmp_dir = None if launch.under_torchrun() else layout.make_tmp(out_dir)
    t0 = time.perf_counter()
    try:
        results, why = None, None
        if not verify and not launch.under_torchrun():
            # file to file in this process, whatever tp and pp the checkpoint was saved at:
            # no ranks, no process group, no megatron-core import (`streaming`)
            streamed = _export_streaming(ckpt_dir, spec, DTYPES[meta.dtype], tmp_dir,
                                         max_bytes)
            if streamed["streamed"]:
                results = [{"rank": 0, "outputs": None, "tmp_dir": tmp_dir, "verify_s": 0.0,
                            "peak_rss_mb_ranks": [peak_rss_mb()], **streamed}]
            else:
                why = streamed["why"]
        if results is None:
            results = run_ranks(_export_rank, world_of(tp, pp, ep), ckpt_dir, out_dir, tmp_dir,
                                 tp, pp, max_bytes, verify, ep)
    except BaseException:
        discard(tmp_dir)
        raise
    r0 = results[0]

    def finish() -> dict:
        _write_hf_config(ckpt_dir, r0["tmp_dir"], meta.dtype)
        report = {"command": "export-hf", "ckpt": ckpt_dir, "out": out_dir, "tp": tp, "pp": pp,
                  "ep": ep, "dtype": meta.dtype, "architecture": meta.architecture,
                  "seconds": time.perf_counter() - t0, "core_s": r0["load_s"] + r0["write_s"],
                  "load_s": r0["load_s"], "write_s": r0["write_s"], "files": r0["files"],
                  "bytes": r0["bytes"],
                  "peak_shard_bytes": r0["peak_shard_bytes"],
                  "streamed": r0.get("streamed", False), **rss_report(results)}
        if not report["streamed"] and not verify:
            report["not_streamed_because"] = why or r0.get("why")
        report["verify"] = _verified("export-hf", r0["outputs"], r0["tmp_dir"], spec,
                                     meta.dtype, r0["verify_s"]) if verify else SKIPPED
        # sealed as an export's output: what a later --force may replace (layout.check_target)
        manifest.write(r0["tmp_dir"], format=layout.HF_EXPORT_FORMAT, version=1)
        layout.commit(r0["tmp_dir"], out_dir, force)
        return report

    return finish_on_leader(lambda: leader_owned(r0["tmp_dir"], finish))


def verify(hf_dir: str, ckpt_dir: str, *, tp: int = 1, pp: int = 1,
           atol: float | None = None, min_top1: float | None = None,
           model: str = "actor", ep: int = 1) -> dict:
    """Forward the fixed batch through transformers (hf_dir) and Megatron (ckpt_dir at tp/pp,
    resolved like export-hf's); the report's `passed` says whether they agree within tolerance."""
    hf_dir, ckpt_dir = os.path.abspath(hf_dir), layout.resolve_checkpoint(ckpt_dir, model)
    meta = layout.CheckpointMeta.read(ckpt_dir)
    manifest.check(ckpt_dir, ConversionError)
    spec = load_spec(hf_dir)
    try:  # the reference model reads these: a truncated file is named here, not in a traceback
        mapping.HFWeights(hf_dir)
    except (ValueError, FileNotFoundError) as e:
        raise ConversionError(str(e)) from None
    ckpt_spec = load_spec(os.path.join(ckpt_dir, layout.HF_SUBDIR))
    if ckpt_spec != spec:
        raise ConversionError(f"{hf_dir!r} ({spec.architecture}) and checkpoint {ckpt_dir!r} "
                              f"({ckpt_spec.architecture}) describe different models")
    check_layout(spec, tp, pp, ep)
    results = run_ranks(_verify_rank, world_of(tp, pp, ep), ckpt_dir, tp, pp, ep)

    def finish() -> dict:
        report = compare_logits(results[0]["outputs"], reference_outputs(hf_dir, spec, meta.dtype),
                         meta.dtype, atol, min_top1)
        return {"command": "verify", "hf": hf_dir, "ckpt": ckpt_dir, "tp": tp, "pp": pp, "ep": ep,
                **report, **rss_report(results)}

    return finish_on_leader(finish)
