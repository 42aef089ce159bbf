"""HF <-> Megatron checkpoint conversion and tp/pp resharding (`python -m checkpoint_tools`).

    import_hf(hf_dir, out_dir, tp=, pp=)    HF safetensors -> Megatron distributed checkpoint
    export_hf(ckpt_dir, out_dir)            Megatron distributed checkpoint -> HF safetensors
    verify(hf_dir, ckpt_dir, tp=, pp=)      transformers vs Megatron logits on a fixed batch
"""
from checkpoint_tools.convert import export_hf, import_hf, verify
from checkpoint_tools.layout import ConversionError

__all__ = ["ConversionError", "export_hf", "import_hf", "verify"]
