"""Raw text -> tokenized MMIDIDX dataset with a sidecar that pins the tokenizer; and the checked loader.

PREFIX.meta.json (written last, so it only exists for a complete .bin/.idx):
    {"tokenizer_sha256", "vocab_size", "num_documents", "num_tokens", "max_token_id", "dtype", "sources"}
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .indexed import DataError, IndexedDataset, IndexedDatasetWriter, best_dtype
from .tokenizer import Tokenizer

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
GZIP_SUFFIXES = (".json.gz", ".jsonl.gz")
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


def _expand(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            # Sorted so the stored document order (and thus every sample) is reproducible.
            out.extend(sorted(q for q in p.rglob("*") if q.is_file() and _kind(q) is not None))
        elif not p.is_file():
            raise DataError(f"{p}: no such file")
        else:
            out.append(p)
    return out


def _kind(p: Path) -> str | None:
    name = p.name.lower()
    if name.endswith(GZIP_SUFFIXES):
        return "gz"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "txt"
    return None


def json_lines(path: Path, lines: Iterable[str]) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) of every non-blank JSONL line; a bad line is a DataError naming file:line.

    The raw line is released before the object is handed out, so a huge line is held once (as its parsed
    strings) while the caller works on it, not twice.
    """
    lineno = 0
    # No enumerate(): it keeps its last (index, line) tuple alive until the next line is read.
    for line in lines:
        lineno += 1
        if line.isspace() or not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: bad JSON: {exc.msg} at column {exc.colno}") from None
        del line
        yield lineno, obj
        del obj


def _jsonl_texts(path: Path, lines: Iterable[str]) -> Iterator[str]:
    for lineno, obj in json_lines(path, lines):
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise DataError(f"{path}:{lineno}: expected a JSON object with a string 'text' field")
        text = obj.pop("text")
        del obj
        yield text
        del text


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


def read_documents(paths: Iterable[str | Path]) -> Iterator[str]:
    """Yield document strings from files: .txt (whole file = one document), JSONL and gzip JSONL (C4's .json.gz).

    JSON lines need a string "text" field. Directories are expanded to their supported files, sorted.
    """
    for path in _expand(paths):
        kind = _kind(path)
        try:
            if kind == "txt":
                yield path.read_text(encoding="utf-8").replace("\r\n", "\n")
            elif kind == "jsonl":
                with open(path, encoding="utf-8") as f:
                    yield from _jsonl_texts(path, f)
            elif kind == "gz":
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    yield from _jsonl_texts(path, f)
            else:
                raise DataError(f"{path}: unsupported file type (expected .txt, .jsonl or .json.gz)")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: cannot read: {exc}") from None


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def prepare_dataset(
    inputs: Sequence[str | Path],
    out_prefix: str | Path,
    tokenizer: Tokenizer | str | Path,
    num_threads: int | None = None,
) -> dict:
    """Tokenize documents from `inputs` into OUT_PREFIX.bin/.idx and write OUT_PREFIX.meta.json; return the meta dict.

    Documents are stored in input order, one sequence each, without end tokens; empty ones are skipped.
    """
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    inputs = list(inputs)
    if not inputs:
        raise DataError(f"{out_prefix}: no input files given")
    meta_file = meta_path(out_prefix)
    # A sidecar left from an earlier build must not vouch for the files we are about to replace.
    if meta_file.exists():
        meta_file.unlink()
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

    with IndexedDatasetWriter(out_prefix, best_dtype(tok.vocab_size)) as w:
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
    ds = IndexedDataset(out_prefix)
    meta = {
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "num_documents": len(ds),
        "num_tokens": ds.num_tokens,
        "max_token_id": max_id,
        "dtype": ds.dtype.name,
        "sources": [str(p) for p in inputs],
    }
    _write_json_atomic(meta_file, meta)
    return meta


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
            raise DataError(f"{mfile}: dataset vocab_size {meta['vocab_size']} != model vocab_size {vocab_size}")
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
