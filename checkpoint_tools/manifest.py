"""MANIFEST.json: size + checksum of every file of a directory, written last; every reader checks it.

An `import-hf` checkpoint holds its own `DIR/MANIFEST.json`. A trainer step holds one for the
whole step (`step_N/MANIFEST.json`, written by megaprm.trainer.checkpoint.save), so its model `step_N/actor/`
is checked against the entries under `actor/`. A comparison's state directory (`megaprm compare
--state-dir`, megaprm.experiments.arithmetic.run_state) holds one too, with sha256 checksums.
The format, version 2 (`MANIFEST_VERSION`):
`{"manifest_version": 2, <the writer's header>, "checksum": "crc32" | "sha256",
"total_bytes": N, "files": {relative path: [size, "checksum hex"]}}`.
Version 1 is the same without `manifest_version` and always crc32 (what megaprm wrote before the
field); `load` reads both and refuses a newer version. A checkpoint written before manifests
existed has none; it is read with a warning.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import zlib

MANIFEST = "MANIFEST.json"
MANIFEST_VERSION = 2  # the record's own version; a writer's header may hold its own "version"
CHECKSUMS = ("crc32", "sha256")
_CHUNK = 8 << 20
CHECK_THREADS = min(4, os.cpu_count() or 1)


def crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str, checksum: str = "crc32") -> str:
    """The `checksum` ("crc32" or "sha256") of the file at `path`, as a manifest lists it."""
    return {"crc32": crc32, "sha256": sha256}[checksum](path)


def _digest_bytes(data: bytes, checksum: str) -> str:
    return f"{zlib.crc32(data):08x}" if checksum == "crc32" else hashlib.sha256(data).hexdigest()


def listing(root: str) -> list:
    """Every file below `root` but the manifest itself, relative to `root`, sorted."""
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel not in (MANIFEST, MANIFEST + ".tmp"):
                out.append(rel)
    return sorted(out)


def entries(root: str, files: list, checksum: str = "crc32") -> dict:
    """rel -> [size, checksum] of `files` (relative to `root`): what the manifest lists for
    them. A multi-rank writer checksums a share of the files per rank and merges the dicts."""
    out = {}
    for rel in files:
        full = os.path.join(root, rel)
        out[rel] = [os.path.getsize(full), file_digest(full, checksum)]
    return out


def write(root: str, files: dict | None = None, checksum: str = "crc32", **header) -> None:
    """Write `root/MANIFEST.json`, `header` first, over `files` (rel -> [size, checksum];
    default: every other file below `root`). Call it after the last write; it is fsynced and
    renamed into place, so a write cut short leaves the previous manifest as it was."""
    if checksum not in CHECKSUMS:
        raise ValueError(f"checksum {checksum!r}: valid are {', '.join(CHECKSUMS)}")
    if files is None:
        files = entries(root, listing(root), checksum)
    path = os.path.join(root, MANIFEST)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"manifest_version": MANIFEST_VERSION, **header, "checksum": checksum,
                   "total_bytes": sum(n for n, _ in files.values()), "files": files}, f,
                  indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def load(path: str) -> dict:
    """The manifest at `path`, checked for its shape and version (ValueError saying what is
    wrong otherwise): version 2, or version 1 (no `manifest_version`, crc32). Its `files` may
    be empty; a checkpoint's reader refuses that itself."""
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict):
        raise ValueError("not a JSON object")
    version = manifest.get("manifest_version", 1)
    if version not in (1, MANIFEST_VERSION):
        raise ValueError(f"manifest_version {version!r}: this megaprm reads versions 1 and "
                         f"{MANIFEST_VERSION} (written by a newer megaprm?)")
    checksum = manifest.get("checksum", "crc32")
    if checksum not in (("crc32",) if version == 1 else CHECKSUMS):
        raise ValueError(f"checksum {checksum!r} is not one of version {version}'s")
    files = manifest["files"]
    if not isinstance(files, dict) or any(
            not isinstance(e, list) or len(e) != 2 for e in files.values()):
        raise ValueError("files: expected {path: [size, checksum]}")
    return {**manifest, "manifest_version": version, "checksum": checksum}


def _one_line(e: BaseException, limit: int) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:limit]}"


def _load(path: str) -> dict:
    """A checkpoint's manifest (`load`), which lists at least one file."""
    manifest = load(path)
    if not manifest["files"]:
        raise ValueError("no files listed")
    return manifest


def read(ckpt_dir: str) -> tuple:
    """(`ckpt_dir/MANIFEST.json` as a dict, None), or (None, what is wrong) when it is missing
    (an interrupted save, or an older writer) or unreadable. Single process."""
    mpath = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(mpath):
        return None, f"no {MANIFEST} (an incomplete save, or written by an older megaprm)"
    try:
        return _load(mpath), None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        return None, f"{MANIFEST} is unreadable ({_one_line(e, 400)})"


def read_verified(ckpt_dir: str, rel: str) -> tuple:
    """(the bytes of `ckpt_dir/rel`, None) when they match that file's manifest entry, else
    (None, what is wrong). One read: the bytes returned are the bytes checked, so a caller
    never trusts unverified data (a launcher reading a checkpoint's small JSON). Single
    process."""
    manifest, problem = read(ckpt_dir)
    if problem:
        return None, problem
    try:
        size, digest = manifest["files"][rel]
        with open(os.path.join(ckpt_dir, rel), "rb") as f:
            data = f.read()
    except (OSError, KeyError, ValueError, TypeError) as e:
        return None, f"{rel} cannot be checked ({_one_line(e, 400)})"
    if len(data) != size or _digest_bytes(data, manifest["checksum"]) != digest:
        return None, f"{rel} does not match {MANIFEST} (torn or edited)"
    return data, None


def problems(ckpt_dir: str) -> list | None:
    """What is wrong with checkpoint `ckpt_dir` against its manifest ([] when intact), or None
    when no manifest covers it (written by an older megaprm). Single process."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    own, parent = os.path.join(ckpt_dir, MANIFEST), os.path.join(os.path.dirname(ckpt_dir),
                                                                  MANIFEST)
    if os.path.isfile(own):
        mpath, base, prefix = own, ckpt_dir, ""
    elif os.path.isfile(parent):  # a model of a trainer step
        mpath, base = parent, os.path.dirname(ckpt_dir)
        prefix = os.path.basename(ckpt_dir) + "/"
    else:
        return None
    try:
        loaded = _load(mpath)
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        return [f"{mpath} is unreadable ({_one_line(e, 200)})"]
    files, checksum = loaded["files"], loaded["checksum"]
    mine = {rel: v for rel, v in files.items() if rel.startswith(prefix)}
    if not mine:
        return [f"{mpath} lists no file of {ckpt_dir}"]
    from concurrent.futures import ThreadPoolExecutor

    # zlib.crc32 releases the GIL: files are checked side by side (424 MB on 2 cores took 0.29 s
    # one after another when measured)
    with ThreadPoolExecutor(min(CHECK_THREADS, len(mine))) as pool:
        out = list(pool.map(lambda item: file_problem(os.path.join(base, item[0]), item[1],
                                                      checksum=checksum),
                            sorted(mine.items())))
    return [p for p in out if p]


def unsealed_problems(ckpt_dir: str) -> list:
    """A checkpoint without a manifest: the tensor items its `model/.metadata` lists each lie
    within their `.distcp` file (a truncated file was a 70-line EOFError in the ranks). A
    `.metadata` that cannot be read is one problem. Single process."""
    # deferred: torch (manifest.py itself is read by the launcher's preflight)
    from checkpoint_tools.layout import MODEL_SUBDIR, ConversionError
    from checkpoint_tools.streaming import read_metadata

    model_dir = os.path.join(ckpt_dir, MODEL_SUBDIR)
    try:
        _, storage = read_metadata(model_dir)
    except ConversionError as e:
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - any unreadable pickle: named, not a traceback
        return [f"{model_dir}/.metadata is unreadable ({_one_line(e, 200)})"]
    found, sizes = [], {}
    for key, (rel, offset, length, *_) in sorted(storage.items(), key=lambda kv: kv[1][:2]):
        path = os.path.join(model_dir, rel)
        if rel not in sizes:
            sizes[rel] = os.path.getsize(path) if os.path.isfile(path) else -1
        if sizes[rel] < 0:
            found.append(f"{path} is missing ({key[0]} is stored there)")
        elif offset + length > sizes[rel]:
            found.append(f"{path} has {sizes[rel]} bytes but {key[0]} is stored up to byte "
                         f"{offset + length} (truncated)")
        else:
            continue
        sizes[rel] = float("inf")  # one line per file
    return found


def file_problem(full: str, entry, name: str | None = None,
                 checksum: str = "crc32") -> str | None:
    """What is wrong with file `full` against its manifest entry [size, checksum] (None when it
    matches); the line names it as `name` (default: its path)."""
    name = name or full
    try:
        size, digest = entry
        if not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) != size:
            return f"{name} has {os.path.getsize(full)} bytes, {MANIFEST} says {size}"
        if file_digest(full, checksum) != digest:
            return f"{name} fails its checksum (its bytes changed)"
    except (OSError, ValueError, TypeError) as e:
        return f"{name} cannot be checked ({_one_line(e, 400)})"
    return None


def check(ckpt_dir: str, error=ValueError) -> None:
    """Raise `error` (one line) when checkpoint `ckpt_dir` does not match its manifest; warn on
    stderr when it has none."""
    found = problems(ckpt_dir)
    if found is None:
        found = unsealed_problems(ckpt_dir)  # what can be checked without one
        if not found:
            print(f"warning: checkpoint {ckpt_dir} has no {MANIFEST} (written by an older "
                  "megaprm); its files' checksums cannot be verified", file=sys.stderr)
            return
    if found:
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        raise error(f"checkpoint {ckpt_dir} is damaged: {found[0]}{more}; re-create it (import-hf) "
                    "or use an earlier trainer checkpoint")
