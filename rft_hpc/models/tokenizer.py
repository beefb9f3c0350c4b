"""Tokenizers built on the spot, saved as Hugging Face tokenizer folders: a character-level
one (the tiny Llama's) and a byte-level one with added special tokens and a chat template
(the tiny chat models').

Tests and the demo use them in place of a downloaded tokenizer; real users point rft-hpc at
their model's own tokenizer folder.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
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


def byte_alphabet() -> list[str]:
    """The 256 characters a byte-level tokenizer writes for bytes 0..255, in byte order (the
    GPT-2 mapping that Qwen's and Llama 3's tokenizers use: printable bytes stand for
    themselves, the others are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_byte_tokenizer(out_dir: str | Path, *, special: Sequence[str],
                         plain: Sequence[str] = (), bos: str | None, eos: str,
                         pad: str | None, chat_template: str, filler: int = 0,
                         merges: Sequence[tuple[str, str]] = ()) -> Path:
    """Write a byte-level tokenizer (one token per byte: ids 0-255, so any text encodes) with
    `special` and then `plain` added tokens after the bytes, and `chat_template`, to `out_dir`.

    With `merges` (from `learn_merges`) it is a BPE tokenizer as real models' are: their
    tokens follow the bytes (and filler), and text is first split as `learn_merges` splits
    it (words, runs of punctuation, each digit alone), so a common word is one token.

    `filler` multi-byte tokens (ids 256 .. 255 + filler, before the added tokens) give it a
    real model's size, so that a model of a real vocabulary's shape samples ids it can
    decode: with no merges no text encodes to them, and each decodes to its bytes.

    Added tokens are matched whole before the text is split into bytes (`special` ones are
    dropped by `decode(..., skip_special_tokens=True)`, `plain` ones such as `<think>` are
    not). The template goes into tokenizer_config.json (`chat_template`). With `bos` the
    tokenizer puts it before every encoded text, as Llama's and Mistral's do. Loadable with
    `AutoTokenizer.from_pretrained(out_dir)`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = byte_alphabet()
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(filler):  # two bytes each while they last (65536), then three
        n, width = (i, 2) if i < 256 ** 2 else (i - 256 ** 2, 3)
        vocab["".join(alphabet[(n >> (8 * k)) & 255] for k in reversed(range(width)))] = \
            len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    core = Tokenizer(models.BPE(vocab, merges=list(merges)))
    core.pre_tokenizer = _pre_tokenizer(bool(merges))
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    if bos is not None:
        bos_id = core.token_to_id(bos)
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos,
                                  pad_token=pad, add_bos_token=bos is not None)
    tok.chat_template = chat_template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # in tokenizer_config.json, where every version of transformers and vLLM looks for it
    tok.save_pretrained(out, save_jinja_files=False)
    return out


def learn_merges(texts: Iterable[str], count: int) -> list[tuple[str, str]]:
    """The first `count` (or fewer, when `texts` run out of pairs) byte-level BPE merges
    learned from `texts`, for `build_byte_tokenizer(merges=...)`. Texts are split as GPT-2's
    tokenizer splits them, each digit alone (as Qwen's and Llama's do), so no token spans
    words or digits: a number is always written digit by digit."""
    import json

    from tokenizers import Tokenizer, models, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = _pre_tokenizer(True)
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=256 + count, initial_alphabet=byte_alphabet(), show_progress=False))
    learned = json.loads(core.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned]


def _pre_tokenizer(words: bool):
    from tokenizers import pre_tokenizers

    if not words:  # one token per byte: the whole text is one piece
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=True)])
