"""Raw text -> tokenized MMIDIDX dataset with a sidecar that pins the tokenizer; and the checked loader.

PREFIX.meta.json (written last, so it only exists for a complete .bin/.idx):
    {"tokenizer_sha256", "vocab_size", "num_documents", "num_tokens", "max_token_id", "dtype", "sources"}
    and, for the two parts of a corpus split into training and validation text, "split": {"part", "valid_fraction"}
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .documents import read_documents
from .indexed import DataError, IndexedDataset, IndexedDatasetWriter, best_dtype
from .tokenizer import Tokenizer

# Documents per encode_batch call: big enough to keep SentencePiece's threads busy, small enough
# that the Python int lists it returns (~30 bytes per token) stay a few hundred MB at most.
ENCODE_CHUNK_DOCS = 2048
ENCODE_CHUNK_CHARS = 8 * 1024 * 1024
# A document longer than this is tokenized piece by piece (see text_pieces) and its tokens written as they come.
# One SentencePiece encode call takes ~50 bytes per character (measured), so a 30 MB JSONL line encoded whole
# peaked at 1.6 GB RSS; in 256 Ki-character pieces the tokenizer adds ~15 MB and the peak (94 MB) is the
# interpreter plus the line while json parses it into the document string.
ENCODE_PIECE_CHARS = 256 * 1024


def meta_path(prefix: str | Path) -> Path:
    """PREFIX.meta.json"""
    return Path(f"{prefix}.meta.json")


def text_pieces(text: str, size: int = ENCODE_PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most `size` characters whose token ids, concatenated, equal the ids of
    `text` encoded whole (for SentencePiece with its default normalizer, as train_tokenizer makes).

    A seam is placed just before a run of plain spaces that sits between two non-whitespace characters
    ("...word|   word..."): the normalizer strips the next piece's leading spaces and adds its dummy-prefix "▁",
    which is exactly the one "▁" the run collapses to in context, and no SentencePiece token spans a space. The
    seam is the last such run start in the second half of the window; a window without one (e.g. one 1 MB
    "word", or text without spaces such as Chinese) is cut at `size` characters, and only there may the tokens
    differ from whole-text encoding. The same seams hold for a byte-level BPE tokenizer.json (GPT-2's and Llama 3's
    pre-tokenizer regexes start a pre-token at such a space and merge only within pre-tokens).
    """
    n, start = len(text), 0
    while n - start > size:
        end = start + size
        cut = text.rfind(" ", start + size // 2, end)
        while cut > start and not _seam_ok(text, cut):
            cut = text.rfind(" ", start + size // 2, cut)
        if cut <= start:
            cut = end
        yield text[start:cut]
        start = cut
    yield text[start:]


def _seam_ok(text: str, i: int) -> bool:
    # text[i] is a space: a seam when it starts a run of plain spaces between two non-whitespace characters.
    if text[i - 1].isspace():
        return False
    j = i
    while j < len(text) and text[j] == " ":
        j += 1
    return j < len(text) and not text[j].isspace()


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def prepare_dataset(
    inputs: Sequence[str | Path],
    out_prefix: str | Path,
    tokenizer: Tokenizer | str | Path,
    num_threads: int | None = None,
    valid_prefix: str | Path | None = None,
    valid_fraction: float = 0.0,
) -> dict:
    """Tokenize documents from `inputs` into OUT_PREFIX.bin/.idx and write OUT_PREFIX.meta.json; return the meta dict.

    Documents are stored in input order, one sequence each, without end tokens; empty ones are skipped.
    `valid_prefix` and `valid_fraction` > 0: the last `valid_fraction` of the tokens (at least 2) go to
    VALID_PREFIX.bin/.idx/.meta.json instead, cut inside the document where that share starts; the rest stays at
    OUT_PREFIX. A contiguous tail, as a held-out split usually is (Hugging Face's "train[95%:]"): a one-document
    corpus (a .txt book) splits too, and no sample of the validation text sits in the middle of training text.
    """
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    inputs = list(inputs)
    if not inputs:
        raise DataError(f"{out_prefix}: no input files given")
    parts: list[tuple[str | Path, str]] = [(out_prefix, "")]
    if valid_prefix is not None and valid_fraction > 0:
        parts = [(out_prefix, "train"), (valid_prefix, "valid")]
    # A sidecar left from an earlier build must not vouch for the files we are about to replace.
    for prefix, _ in parts:
        meta_path(prefix).unlink(missing_ok=True)
    max_id = -1
    chunk: list[str] = []
    chunk_chars = 0

    def as_array(ids: list[int]) -> np.ndarray:
        nonlocal max_id
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size:
            max_id = max(max_id, int(arr.max()))
        return arr

    def flush(writer: IndexedDatasetWriter) -> None:
        nonlocal chunk, chunk_chars
        for ids in tok.encode_batch(chunk, num_threads=num_threads):
            if ids:
                writer.add_document(as_array(ids))
        chunk, chunk_chars = [], 0

    def stream(writer: IndexedDatasetWriter, doc: str) -> None:
        # One piece per encode call: each list of ids becomes a small array and goes to the .bin at once.
        pieces = (as_array(tok.encode(piece)) for piece in text_pieces(doc, ENCODE_PIECE_CHARS))
        writer.add_document_parts(pieces)

    dtype = best_dtype(tok.vocab_size)
    with IndexedDatasetWriter(out_prefix, dtype) as w:
        for doc in read_documents(inputs):
            if not doc or doc.isspace():  # not doc.strip(): that copies a huge document once more
                continue
            if len(doc) > ENCODE_PIECE_CHARS:
                flush(w)  # keep the stored document order
                stream(w, doc)
                del doc
                continue
            chunk.append(doc)
            chunk_chars += len(doc)
            if len(chunk) >= ENCODE_CHUNK_DOCS or chunk_chars >= ENCODE_CHUNK_CHARS:
                flush(w)
        flush(w)
        if w.num_documents == 0:
            raise DataError(f"{inputs[0]}: no non-empty documents in the {len(inputs)} input path(s)")
        if len(parts) == 2:
            total = w.num_tokens
            held = max(2, math.ceil(valid_fraction * total))  # 2: one input token and its target
            if total - held < 2:
                raise DataError(
                    f"{inputs[0]}: {total} tokens are too few to hold out {valid_fraction:g} of them for validation; "
                    "--valid-fraction 0 keeps them all for training"
                )
            with IndexedDatasetWriter(parts[1][0], dtype) as v:
                w.move_tail(v, held)
    metas = {}
    for prefix, part in parts:
        ds = IndexedDataset(prefix)
        meta = {
            "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size,
            "num_documents": len(ds),
            "num_tokens": ds.num_tokens,
            # A split part's own maximum: one more read of the memmap, a millisecond per million tokens.
            "max_token_id": (int(ds.tokens.max()) if ds.num_tokens else -1) if part else max_id,
            "dtype": ds.dtype.name,
            "sources": [str(p) for p in inputs],
        }
        if part:
            meta["split"] = {"part": part, "valid_fraction": valid_fraction}
        _write_json_atomic(meta_path(prefix), meta)
        metas[part] = meta
    return metas[parts[0][1]]


def read_meta(prefix: str | Path) -> dict | None:
    """The parsed PREFIX.meta.json, or None when there is none (e.g. a dataset made by Megatron's tools)."""
    path = meta_path(prefix)
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object")
    for key, kind in (("tokenizer_sha256", str), ("vocab_size", int), ("num_documents", int), ("num_tokens", int)):
        if key not in meta:
            raise DataError(f"{path}: missing field {key!r}")
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            raise DataError(
                f"{path}: field {key!r} must be {'a string' if kind is str else 'an integer'}, "
                f"got {json.dumps(meta[key])[:40]}"
            )
    return meta


def dataset_vocab(cfg) -> tuple[int, str] | None:
    """(vocab_size, its sidecar's path) of the training dataset a config.Config names in data.train_prefix; None for
    the default corpus (empty prefix) or a dataset without a sidecar. For config.resolve's `dataset_vocab`."""
    prefix = cfg.data.train_prefix
    if not prefix:
        return None
    meta = read_meta(prefix)
    return None if meta is None else (meta["vocab_size"], str(meta_path(prefix)))


def load_dataset(
    prefix: str | Path, tokenizer: Tokenizer | None = None, vocab_size: int | None = None
) -> IndexedDataset:
    """Open PREFIX.bin/.idx and check it against its sidecar, the tokenizer and the model's vocab_size.

    Checks: the sidecar describes these files; it was tokenized by this tokenizer (sha256) with this
    vocabulary; tokenizer.vocab_size == vocab_size; every token id < vocab_size. Without a sidecar
    only the id range can be checked. Any mismatch raises DataError naming both sides.
    """
    ds = IndexedDataset(prefix)
    meta = read_meta(prefix)
    mfile = meta_path(prefix)
    if meta is not None:
        if (meta["num_tokens"], meta["num_documents"]) != (ds.num_tokens, len(ds)):
            raise DataError(
                f"{mfile}: describes {meta['num_documents']} documents / {meta['num_tokens']} tokens "
                f"but {ds.bin_file.name} holds {len(ds)} / {ds.num_tokens}; stale sidecar, re-run prepare"
            )
        if tokenizer is not None and meta["tokenizer_sha256"] != tokenizer.sha256:
            raise DataError(
                f"{mfile}: dataset was tokenized with a tokenizer of sha256 "
                f"{meta['tokenizer_sha256'][:16]}… "
                f"(vocab {meta['vocab_size']}) but {tokenizer.path} has sha256 {tokenizer.sha256[:16]}… "
                f"(vocab {tokenizer.vocab_size})"
            )
        if vocab_size is not None and meta["vocab_size"] != vocab_size:
            raise DataError(
                f"{mfile}: dataset vocab_size {meta['vocab_size']} != model vocab_size {vocab_size}; "
                f"set model.vocab_size={meta['vocab_size']}, or leave it unset to take the dataset's"
            )
    if tokenizer is not None and vocab_size is not None and tokenizer.vocab_size != vocab_size:
        raise DataError(
            f"{tokenizer.path}: tokenizer vocab_size {tokenizer.vocab_size} != model vocab_size {vocab_size}"
        )
    limit = vocab_size if vocab_size is not None else (tokenizer.vocab_size if tokenizer is not None else None)
    if limit is not None and ds.num_tokens:
        # Always the full pass over the .bin, even with a sidecar: its max_token_id describes the file as
        # written, and a later bit flip would otherwise reach the embedding as an out-of-range index.
        # One sequential read of the memmap: about a millisecond per million tokens once cached.
        hit = ds.find_token_outside(limit)
        if hit is not None:
            pos, bad = hit
            doc, off = ds.locate(pos)
            recorded = meta.get("max_token_id") if meta is not None else None
            why = (
                f"; its sidecar records max id {recorded}, so the .bin changed after it was written"
                if isinstance(recorded, int) and 0 <= recorded < limit
                else ""
            )
            raise DataError(
                f"{ds.bin_file}: token id {bad} outside the vocabulary [0, {limit}) "
                f"at token {pos} (document {doc}, offset {off}){why}"
            )
    return ds
