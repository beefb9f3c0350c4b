"""A character-level tokenizer built on the spot, saved as a Hugging Face tokenizer folder.

Tests and the demo use it in place of a downloaded tokenizer; real users point rft-hpc at
their model's own tokenizer folder.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PRINTABLE = "".join(c for c in string.printable if c not in "\x0b\x0c")


def build_char_tokenizer(out_dir: str | Path, alphabet: str = PRINTABLE) -> Path:
    """Write a tokenizer with one token per character of `alphabet` to `out_dir`.

    Ids 0-3 are `<pad> <s> </s> <unk>`; characters follow in `alphabet` order. Loadable with
    `transformers.AutoTokenizer.from_pretrained(out_dir, local_files_only=True)`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in dict.fromkeys(alphabet):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return out
