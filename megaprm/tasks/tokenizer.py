"""Character-level tokenizer for the arithmetic task, as a real HF fast tokenizer.

One token per character, except the step separator "\\n\\n", which is ONE token, so every step
closes on a single token (what `rewards.steps.separator_token_ids` looks for). The vocabulary
is fixed (ids never depend on data), small (36 symbols) and saved in the HF format, so
`AutoTokenizer.from_pretrained(dir)` loads it offline.

    ids 0..3   <pad> <eos> <bos> <unk>
    id  4      "\\n\\n" (step separator)   id 5 "\\n"   id 6 " "
    then digits, operators and the characters of \\boxed{} (see CHARS)

Nothing is added automatically (`add_special_tokens` is a no-op): the prompt is the raw text,
the trainer appends `<eos>` to targets, the rollout stops on it. Padding is on the left.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
STEP_SEP = "\n\n"
# Order fixes the ids; append only (never reorder) so saved models keep their meaning.
CHARS = ("\n", " ", *"0123456789", *"+-*/=?().,^", *"\\{}", *"boxed")
VOCAB: tuple[str, ...] = (*SPECIAL_TOKENS, STEP_SEP, *CHARS)


def _backend() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "\n\n" first, then any single character; left to right, so "\n\n\n" -> "\n\n", "\n"
    # (the same pieces as str.split("\n\n")). Special tokens are matched before this runs.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n\n|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def build_char_tokenizer(save_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The task tokenizer; with `save_dir`, also written there (tokenizer.json + configs)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_backend(),
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    assert len(tok) == len(VOCAB), (len(tok), len(VOCAB))
    if save_dir is not None:
        tok.save_pretrained(str(save_dir))
    return tok
