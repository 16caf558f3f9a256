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
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from .bpe import TokenizerJSON, looks_like_json, train_bpe
from .indexed import DataError

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
# SentencePiece trains on about 1 MB/s of BPE input here; beyond this much text the vocabulary
# barely changes, so a larger corpus is subsampled (deterministically, by a fixed line stride).
MAX_TRAIN_BYTES = 64 * 1024 * 1024
# Lines longer than this are dropped by SentencePiece's trainer (its default is 4192 bytes).
MAX_SENTENCE_BYTES = 16384


def _training_lines(text_files: Sequence[Path], max_bytes: int) -> Iterator[str]:
    total = sum(p.stat().st_size for p in text_files)
    stride = max(1, -(-total // max_bytes))  # ceil: keep every stride-th line
    k = 0
    for p in text_files:
        with open(p, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                if k % stride == 0:
                    yield line
                k += 1


def train_tokenizer(
    text_files: Iterable[str | Path],
    model_prefix: str | Path,
    vocab_size: int,
    max_train_bytes: int = MAX_TRAIN_BYTES,
    num_threads: int | None = None,
    bpe: bool = False,
) -> Path:
    """Train a SentencePiece BPE model on plain-text files; write MODEL_PREFIX.model and return its path.

    Each non-empty line is one training sentence. Deterministic for the same inputs. `bpe`: train a byte-level
    BPE tokenizer.json instead (scaletrain.data.bpe.train_bpe) and write MODEL_PREFIX.json.
    """
    if bpe:
        return train_bpe(text_files, f"{model_prefix}.json", vocab_size)
    import sentencepiece as spm

    files = [Path(p) for p in text_files]
    if not files:
        raise DataError(f"{model_prefix}.model: no training text files given")
    for p in files:
        if not p.is_file():
            raise DataError(f"{p}: no such file")
    if vocab_size < 300:
        # 256 byte pieces + 3 specials + newline leave nothing for merges below this.
        raise DataError(f"{model_prefix}.model: vocab_size {vocab_size} too small for byte fallback (need >= 300)")
    out = Path(f"{model_prefix}.model")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(files, max_train_bytes),
            # Writing to memory keeps the output path out of the serialized trainer spec, so the
            # .model bytes (and sha256) do not depend on where it is saved.
            model_writer=buf,
            model_type="bpe",
            vocab_size=vocab_size,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=-1,
            split_digits=True,
            byte_fallback=True,
            character_coverage=0.9995,
            user_defined_symbols=["\n"],
            input_sentence_size=0,  # we subsample ourselves; SentencePiece's sampler is random
            max_sentence_length=MAX_SENTENCE_BYTES,
            num_threads=num_threads or min(8, os.cpu_count() or 1),
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise DataError(f"{out}: SentencePiece training failed: {exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, out)
    return out


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
