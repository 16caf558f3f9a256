"""Tokenizers: a SentencePiece .model (trained here with MLPerf gpt3's settings) or any Hugging Face tokenizer.json.

`Tokenizer(path)` opens either kind (a tokenizer.json is told by its leading "{"; scaletrain.data.bpe reads it and
trains the byte-level BPE the Llama 3.1 proxies use); both are pinned by the sha256 of the file's bytes.

MLPerf gpt3's C4 tokenizer: BPE, pad 0, eos 1, unk 2, no bos, split digits, byte fallback,
character coverage 0.9995. One addition: "\\n" is a user-defined piece. SentencePiece's default
normalizer would otherwise turn line breaks into spaces, and for verse (the default corpus) the line
structure is most of what there is to learn. Training is deterministic: same files and vocab size,
byte-identical .model file (so its sha256 can pin datasets to it).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .bpe import TokenizerJSON, looks_like_json, train_bpe
from .documents import document_lines, input_files, lines_of
from .indexed import DataError, VocabTooLarge

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
# SentencePiece trains on about 1 MB/s of BPE input here; beyond this much text the vocabulary
# barely changes, so a larger corpus is subsampled (deterministically, by a fixed line stride).
MAX_TRAIN_BYTES = 64 * 1024 * 1024
# Lines longer than this are dropped by SentencePiece's trainer (its default is 4192 bytes).
MAX_SENTENCE_BYTES = 16384
# MLPerf gpt3's: the rarest 0.05% of characters get no piece of their own (byte fallback spells them).
CHARACTER_COVERAGE = 0.9995
# 256 byte pieces + 3 specials + newline leave nothing for merges below this.
MIN_VOCAB = 300


def _training_lines(
    text_files: Sequence[Path], max_bytes: int, documents: Callable[[], Iterable[str]] | None = None
) -> Iterator[str]:
    total = sum(p.stat().st_size for p in text_files)
    stride = max(1, -(-total // max_bytes))  # ceil: keep every stride-th line
    for k, line in enumerate(lines_of(documents()) if documents else document_lines(text_files)):
        if k % stride == 0:
            yield line


def train_tokenizer(
    text_files: Iterable[str | Path],
    model_prefix: str | Path,
    vocab_size: int,
    max_train_bytes: int = MAX_TRAIN_BYTES,
    num_threads: int | None = None,
    bpe: bool = False,
    character_coverage: float = CHARACTER_COVERAGE,
    fit_vocab: bool = False,
    documents: Callable[[], Iterable[str]] | None = None,
) -> Path:
    """Train a SentencePiece BPE model on text files; write MODEL_PREFIX.model and return its path.

    Each non-empty line is one training sentence (of a JSONL file: of its documents' "text"; directories are
    expanded as `data prepare` does). Deterministic for the same inputs. `bpe`: train a byte-level BPE
    tokenizer.json instead (scaletrain.data.bpe.train_bpe) and write MODEL_PREFIX.json.

    A text too small for `vocab_size` runs out of merges first: with `fit_vocab` the tokenizer gets the largest
    vocabulary the text gives (byte-identical to asking for that size), else VocabTooLarge names that size and
    nothing is written. `documents`: a function giving the texts to train on instead of the files' documents
    (SFT pairs' inputs and outputs); called once per training, the files still set the subsampling by their size.
    """
    if bpe:
        return train_bpe(text_files, f"{model_prefix}.json", vocab_size, fit_vocab=fit_vocab, documents=documents)
    files = input_files(text_files)
    if not files:
        raise DataError(f"{model_prefix}.model: no training text files given")
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"{model_prefix}.model: vocab_size {vocab_size} too small for byte fallback (need >= {MIN_VOCAB})"
        )
    out = Path(f"{model_prefix}.model")
    import sentencepiece as spm

    def train(size: int, hard: bool = True) -> bytes:
        buf = io.BytesIO()
        # Only the soft limit is passed: a field set explicitly is serialized even at its default value, and the
        # .model bytes (the sha256 the datasets pin) would change for every tokenizer.
        soft: dict[str, Any] = {} if hard else {"hard_vocab_limit": False}
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(files, max_train_bytes, documents),
            # Writing to memory keeps the output path out of the serialized trainer spec, so the
            # .model bytes (and sha256) do not depend on where it is saved.
            model_writer=buf,
            model_type="bpe",
            vocab_size=size,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=-1,
            split_digits=True,
            byte_fallback=True,
            character_coverage=character_coverage,
            user_defined_symbols=["\n"],
            input_sentence_size=0,  # we subsample ourselves; SentencePiece's sampler is random
            max_sentence_length=MAX_SENTENCE_BYTES,
            num_threads=num_threads or min(8, os.cpu_count() or 1),
            minloglevel=2,
            **soft,
        )
        return buf.getvalue()

    try:
        try:
            model = train(vocab_size)
        except RuntimeError as exc:
            # The largest vocabulary a text gives is where BPE runs out of pairs to merge. Counting it beforehand
            # (distinct words, their lengths) gives only a bound: pieces reached by two merge paths count once, and
            # SentencePiece's piece rules and the characters character_coverage drops take part, so only training
            # knows it. Its error states it in prose; the same training without hard_vocab_limit returns the model
            # it reached, whose size is the number, with nothing to parse. A failure of another kind fails again
            # there, or reaches the size asked for and is raised as it was.
            largest = _piece_count(train(vocab_size, hard=False))
            if largest >= vocab_size:
                raise exc from None
            if largest < MIN_VOCAB:
                raise DataError(
                    f"{out}: too little text for a tokenizer: it gives {largest} pieces, fewer than the {MIN_VOCAB} "
                    "(256 bytes, specials and merges) a vocabulary needs here; add text or pass --tokenizer"
                ) from None
            if not fit_vocab:
                raise VocabTooLarge(out, vocab_size, largest) from None
            # Trained again at that size with the hard limit, so it equals what `--vocab-size N` gives.
            model = train(largest)
    except RuntimeError as exc:
        raise DataError(f"{out}: SentencePiece training failed: {exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_bytes(model)
    os.replace(tmp, out)
    return out


def _piece_count(model: bytes) -> int:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(model)
    return int(sp.get_piece_size())


class Tokenizer:
    """A tokenizer file, loaded once: a SentencePiece .model or a Hugging Face tokenizer.json (`kind` says which);
    ids are what the datasets store."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such tokenizer model file")
        data = self.path.read_bytes()
        self.sha256 = hashlib.sha256(data).hexdigest()
        self._json: TokenizerJSON | None = None
        if looks_like_json(data):
            self.kind = "json"
            self._json = TokenizerJSON(self.path, data)
            return
        import sentencepiece as spm

        self.kind = "sentencepiece"
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError, TypeError) as exc:
            raise DataError(f"{self.path}: not a SentencePiece model or tokenizer.json ({exc})") from None
        if self._sp.get_piece_size() <= 0:
            raise DataError(f"{self.path}: SentencePiece model has an empty vocabulary")

    @property
    def vocab_size(self) -> int:
        """Number of ids (0 .. vocab_size-1; a tokenizer.json's added tokens included)."""
        return self._json.vocab_size if self._json else int(self._sp.get_piece_size())

    @property
    def eos_id(self) -> int:
        """End-of-sequence id (1 for models from train_tokenizer and train_bpe), -1 when there is none."""
        return self._json.ids["eos"] if self._json else int(self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        """Padding id (0 for models from train_tokenizer and train_bpe), -1 when there is none."""
        return self._json.ids["pad"] if self._json else int(self._sp.pad_id())

    @property
    def unk_id(self) -> int:
        """Unknown-piece id (2 for models from train_tokenizer; -1 for a byte-level BPE, which needs none)."""
        return self._json.ids["unk"] if self._json else int(self._sp.unk_id())

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id, -1 when the model has none (MLPerf gpt3 has none; train_bpe's is 2)."""
        return self._json.ids["bos"] if self._json else int(self._sp.bos_id())

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no bos/eos added."""
        return self._json.encode(text) if self._json else self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """encode() over many texts, in parallel inside the library."""
        if not texts:
            return []
        if self._json:
            return self._json.encode_batch(texts)
        return self._sp.encode(list(texts), out_type=int, num_threads=num_threads or (os.cpu_count() or 1))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids (pad/eos dropped)."""
        return self._json.decode(ids) if self._json else self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        """The piece string of one id (for debugging and tests)."""
        return self._json.id_to_piece(i) if self._json else self._sp.id_to_piece(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"
