"""Hugging Face `tokenizer.json` files (the `tokenizers` library): reading any of them, training a byte-level BPE.

Llama 3's vocabulary is a byte-level BPE (tiktoken's cl100k-style, 128,256 ids) that ships as a `tokenizer.json`;
it cannot be downloaded here, so the proxies train their own byte-level BPE on the default corpus with the same
library and the same model type. A `tokenizer.json` is plain JSON parsed by the library's Rust code: loading one
never runs code from the file (unlike a pickled or `trust_remote_code` tokenizer).

Special ids are not part of the file's model, so they are found by name among its added special tokens: the
names Llama 3, GPT-2 and SentencePiece-converted tokenizers use, and those `train_bpe` gives its own tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from .documents import document_lines, input_files, lines_of
from .indexed import DataError, VocabTooLarge

PAD_TOKEN, EOS_TOKEN, BOS_TOKEN = "<|pad|>", "<|end_of_text|>", "<|begin_of_text|>"
"""The special tokens `train_bpe` puts first (ids 0, 1, 2); EOS and BOS are Llama 3's names."""

SPECIAL_NAMES = {
    "eos": (EOS_TOKEN, "<|endoftext|>", "</s>", "<eos>"),
    "bos": (BOS_TOKEN, "<s>", "<bos>"),
    "pad": (PAD_TOKEN, "<pad>", "[PAD]", "<|finetune_right_pad_id|>"),
    "unk": ("<unk>", "[UNK]"),
}
"""Added special tokens that serve as end/beginning of sequence, padding and unknown, first found wins."""

MIN_VOCAB = 256 + 3 + 1
"""A byte-level BPE holds the 256 byte symbols and the three specials before its first merge."""


def looks_like_json(data: bytes) -> bool:
    """True when `data` starts like a JSON object (a tokenizer.json); a SentencePiece .model is binary protobuf."""
    return data.lstrip()[:1] == b"{"


class TokenizerJSON:
    """A loaded `tokenizer.json`: the same methods as SentencePiece's wrapper (scaletrain.data.tokenizer)."""

    def __init__(self, path: Path, data: bytes) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the library raises plain Exception on bad JSON; UnicodeDecodeError too
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        if self.vocab_size <= 0:
            raise DataError(f"{path}: tokenizer.json has an empty vocabulary")
        specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.ids = {
            role: next((specials[n] for n in names if n in specials), -1) for role, names in SPECIAL_NAMES.items()
        }

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the bos/eos a post-processor would add (as SentencePiece encodes)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """encode() over many texts, in parallel inside the library (RAYON_NUM_THREADS caps its threads)."""
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids, special tokens dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def id_to_piece(self, i: int) -> str:
        """The token string of one id (byte-level symbols, e.g. "Ġ" for a leading space)."""
        return self._tok.id_to_token(int(i)) or ""


def _training_texts(files: Sequence[Path], documents: Callable[[], Iterable[str]] | None = None) -> Iterator[str]:
    # Whole lines with their line break: verse's line structure ("," + "\n") is most of what there is to learn,
    # and the byte-level pre-tokenizer keeps "\n" as a byte symbol of its own.
    for line in lines_of(documents()) if documents else document_lines(files):
        yield line + "\n"


def train_bpe(
    text_files: Iterable[str | Path],
    out: str | Path,
    vocab_size: int,
    fit_vocab: bool = False,
    documents: Callable[[], Iterable[str]] | None = None,
) -> Path:
    """Train a byte-level BPE (GPT-2/Llama 3 style: byte alphabet, GPT-2 pre-tokenizer regex, no unknown token)
    on plain-text files and write it as a tokenizer.json at `out`; returns that path.

    Ids 0, 1, 2 are PAD_TOKEN, EOS_TOKEN, BOS_TOKEN. Deterministic: the same files and vocab_size give the same
    bytes (so the file's sha256 can pin datasets to it).

    A text too small for `vocab_size` runs out of merges first: with `fit_vocab` the tokenizer keeps the vocabulary
    it reached, else VocabTooLarge names that size and nothing is written. `documents`: a function giving the texts
    to train on instead of the files' documents.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    out = Path(out)
    files = input_files(text_files)
    if not files:
        raise DataError(f"{out}: no training text files given")
    if vocab_size < MIN_VOCAB:
        raise DataError(f"{out}: vocab_size {vocab_size} too small for a byte-level BPE (need >= {MIN_VOCAB})")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(files, documents), trainer=trainer)
    reached = int(tok.get_vocab_size(with_added_tokens=True))
    if reached < vocab_size and not fit_vocab:
        raise VocabTooLarge(out, vocab_size, reached)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(tok.to_str() + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return out
