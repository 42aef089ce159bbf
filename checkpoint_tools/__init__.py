"""HF <-> Megatron checkpoint conversion and tp/pp resharding (`python -m checkpoint_tools`).

    import_hf(hf_dir, out_dir, tp=, pp=)    HF safetensors -> Megatron distributed checkpoint
    export_hf(ckpt_dir, out_dir)            Megatron distributed checkpoint -> HF safetensors
    verify(hf_dir, ckpt_dir, tp=, pp=)      transformers vs Megatron logits on a fixed batch

The names resolve on first use (PEP 562), so `python -m checkpoint_tools --help` and argument
errors do not pay for importing torch and megatron.
"""
from checkpoint_tools.layout import ConversionError

__all__ = ["ConversionError", "export_hf", "import_hf", "verify"]


def __getattr__(name: str):
    if name in ("export_hf", "import_hf", "verify"):
        # deferred: `--help` and argument errors must not import torch
        from checkpoint_tools import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'checkpoint_tools' has no attribute {name!r}")
