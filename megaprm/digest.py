"""The short digest that names a JSON-able thing: a config a checkpoint must match, a cached
stage's recipe, a set of tensor hashes."""
from __future__ import annotations

import hashlib
import json


def json_digest(obj, *, compact: bool = False) -> str:
    """sha256 (first 16 hex) of `obj` as key-sorted JSON, so key order never matters (values
    JSON cannot hold are written as str). `compact` drops the spaces after separators: the
    trainer checkpoint's config digest is stored that way, and older checkpoints must still
    match."""
    seps = (",", ":") if compact else None
    text = json.dumps(obj, sort_keys=True, default=str, separators=seps)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
