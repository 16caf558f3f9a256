"""Megatron-LM's MMIDIDX indexed dataset: a `.bin` of token ids and an `.idx` describing it.

Layout of PREFIX.idx (all little-endian), byte-compatible with Megatron-LM's
`megatron/core/datasets/indexed_dataset.py` so datasets move freely between the two:

    9 bytes   b"MMIDIDX\\x00\\x00"
    <Q        version, always 1
    <B        dtype code of the .bin (see DTYPE_CODES)
    <Q        sequence count S
    <Q        document-index count D (= documents + 1; Megatron stores len(document_indices) here)
    S x int32 sequence lengths in tokens
    S x int64 sequence byte offsets into the .bin
    D x int64 document indices: document i is sequences [doc_idx[i], doc_idx[i+1])

We write one sequence per document; on read, documents spanning several sequences are accepted too,
as long as the sequences are stored back to back (every Megatron writer does that).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# 9 header + 8 version + 1 dtype + 8 sequence count + 8 document-index count
HEADER_SIZE = 34

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class DataError(ValueError):
    """Bad input data: the message is one line, "PATH: what is wrong" (the CLI prints it and exits 2)."""

    def __init__(self, message: str) -> None:
        # The CLI prints str(exc) as one line; stray newlines from wrapped library errors would break that.
        super().__init__(" ".join(str(message).split()))


class VocabTooLarge(DataError):
    """A tokenizer cannot have the vocabulary asked for: its training text runs out of merges first. `largest` is the
    biggest vocabulary that text gives (the tokenizer trained with it has exactly that many ids)."""

    def __init__(self, where: str | Path, asked: int, largest: int) -> None:
        super().__init__(
            f"{where}: a vocabulary of {asked} is more than this text supports (the tokenizer runs out of merges); "
            f"the largest it gives is {largest}: set --vocab-size {largest} or less, or add text"
        )
        self.asked, self.largest = asked, largest


def best_dtype(vocab_size: int | None) -> np.dtype:
    """Token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def bin_path(prefix: str | Path) -> Path:
    """PREFIX.bin"""
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    """PREFIX.idx"""
    return Path(f"{prefix}.idx")


def _tmp_name(path: Path) -> Path:
    # pid in the name so two writers racing on one prefix never share a temp file.
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


class IndexedDatasetWriter:
    """Stream documents into PREFIX.bin/.idx; nothing appears under the final names until finalize().

    Use as a context manager, or call finalize() (commit) / abort() (discard) yourself.
    """

    def __init__(self, prefix: str | Path, dtype=np.uint16) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"{self.prefix}: dtype {self.dtype} has no MMIDIDX code")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = _tmp_name(bin_path(self.prefix))
        self._idx_tmp = _tmp_name(idx_path(self.prefix))
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._done = False
        self._lo: int | None
        self._hi: int | None
        if self.dtype.kind in "ui":
            info = np.iinfo(self.dtype)
            self._lo, self._hi = int(info.min), int(info.max)
        else:
            self._lo = self._hi = None

    def add_document(self, tokens: np.ndarray | Iterable[int]) -> None:
        """Append one document (a 1-D array of token ids) as one sequence."""
        self.add_document_parts([tokens])

    def add_document_parts(self, parts: Iterable[np.ndarray | Iterable[int]]) -> None:
        """Append one document given as consecutive 1-D pieces (e.g. a long text tokenized chunk by chunk).

        Each piece is written as it arrives, so a document never has to exist whole in memory.
        """
        if self._done:
            raise ValueError(f"{self.prefix}: writer already finalized")
        n = 0
        for tokens in parts:
            arr = np.asarray(tokens)
            if arr.ndim != 1:
                raise ValueError(f"{self.prefix}: a document must be 1-D, got shape {arr.shape}")
            if arr.size and self._lo is not None and self._hi is not None and arr.dtype != self.dtype:
                lo, hi = int(arr.min()), int(arr.max())
                if lo < self._lo or hi > self._hi:
                    raise DataError(
                        f"{bin_path(self.prefix)}: token id {hi if hi > self._hi else lo} "
                        f"does not fit dtype {self.dtype}"
                    )
            arr = np.ascontiguousarray(arr, dtype=self.dtype)
            self._bin.write(arr.data)
            n += int(arr.size)
        self._lengths.append(n)

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._lengths)

    @property
    def num_tokens(self) -> int:
        """Tokens added so far."""
        return sum(self._lengths)

    def move_tail(self, other: IndexedDatasetWriter, n_tokens: int, chunk: int = 1 << 24) -> None:
        """Move the last `n_tokens` tokens written here to `other`, as documents: the document the cut falls in is
        split there (its head stays, its tail becomes `other`'s first document), the ones after it move whole.

        Done before finalize(), on the temporary file: nothing is copied but the moved tokens (read back through a
        memory map, `chunk` tokens at a time) and the file is then truncated at the cut.
        """
        if self._done or other._done:
            raise ValueError(f"{self.prefix}: writer already finalized")
        total = self.num_tokens
        cut = total - max(0, min(n_tokens, total))
        if cut == total:
            return
        self._bin.flush()
        starts = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=starts[1:])
        first = int(np.searchsorted(starts, cut, side="right")) - 1  # the document holding token `cut`
        tokens = np.memmap(self._bin_tmp, dtype=self.dtype, mode="r", shape=(total,))
        try:
            for doc in range(first, len(self._lengths)):
                lo, hi = (cut if doc == first else int(starts[doc])), int(starts[doc + 1])
                other.add_document_parts(tokens[a : min(a + chunk, hi)] for a in range(lo, hi, chunk))
        finally:
            del tokens
        self._lengths = self._lengths[:first] + ([cut - int(starts[first])] if cut > starts[first] else [])
        self._bin.truncate(cut * self.dtype.itemsize)
        self._bin.seek(cut * self.dtype.itemsize)

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        if self._done:
            return
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            self.abort()
            raise DataError(f"{bin_path(self.prefix)}: a document exceeds 2**31-1 tokens")
        with open(self._idx_tmp, "wb") as f:
            f.write(_pack_index(lengths, self.dtype))
            f.flush()
            os.fsync(f.fileno())
        # Drop the old index first: a crash between the two renames then leaves a .bin without an
        # .idx (reported as missing) instead of a new .bin paired with a stale .idx.
        final_idx = idx_path(self.prefix)
        if final_idx.exists():
            final_idx.unlink()
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, final_idx)
        self._done = True

    def abort(self) -> None:
        """Discard everything written so far."""
        if not self._bin.closed:
            self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if p.exists():
                p.unlink()
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _pack_index(lengths: np.ndarray, dtype: np.dtype) -> bytes:
    n = int(lengths.size)
    pointers = np.zeros(n, dtype=np.int64)
    if n:
        np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    doc_idx = np.arange(n + 1, dtype=np.int64)
    return b"".join(
        [
            HEADER,
            struct.pack("<Q", VERSION),
            struct.pack("<B", _CODE_OF[dtype]),
            struct.pack("<Q", n),
            struct.pack("<Q", n + 1),
            lengths.astype("<i4").tobytes(),
            pointers.astype("<i8").tobytes(),
            doc_idx.astype("<i8").tobytes(),
        ]
    )


def write_indexed(prefix: str | Path, documents: Iterable, dtype=None, vocab_size: int | None = None) -> None:
    """Write `documents` (iterable of 1-D token arrays) to PREFIX.bin/.idx.

    dtype defaults to Megatron's choice for `vocab_size` (uint16 below 65500, else int32).
    """
    dt = np.dtype(dtype) if dtype is not None else best_dtype(vocab_size)
    with IndexedDatasetWriter(prefix, dt) as w:
        for doc in documents:
            w.add_document(doc)


class IndexedDataset:
    """Read-only, memory-mapped view of PREFIX.bin/.idx, fully validated on open.

    `tokens` is one flat memmap over the whole .bin (the documents concatenated in stored order);
    `ds[i]` is a zero-copy view of document i.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        self.idx_file = idx_path(prefix)
        self.bin_file = bin_path(prefix)
        (self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices) = _read_index(self.idx_file)
        # Token offset of every sequence start, plus the total at the end.
        seq_starts = np.zeros(self.sequence_lengths.size + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=seq_starts[1:])
        item = self.dtype.itemsize
        _check_pointers(self.idx_file, self.sequence_pointers, seq_starts, item)
        self.num_tokens = int(seq_starts[-1])
        _check_regular_file(self.bin_file, f"no such file (its index {self.idx_file.name} exists)")
        try:
            size = self.bin_file.stat().st_size
        except OSError as exc:
            raise DataError(f"{self.bin_file}: cannot read: {exc.strerror or exc}") from None
        want = self.num_tokens * item
        if size < want:
            raise DataError(
                f"{self.bin_file}: truncated: {size} bytes, its index {self.idx_file.name} expects "
                f"{want} ({self.num_tokens} x {self.dtype})"
            )
        if size > want:
            raise DataError(
                f"{self.bin_file}: {size} bytes but its index {self.idx_file.name} expects {want} "
                f"({self.num_tokens} x {self.dtype}); wrong .idx for this .bin?"
            )
        self.doc_offsets = seq_starts[self.document_indices]
        self.doc_lengths = np.diff(self.doc_offsets)
        # One-sequence-per-document files have byte pointers that equal the documents'.
        self.doc_pointers = self.doc_offsets[:-1] * item
        self.tokens: np.ndarray
        if self.num_tokens:
            try:
                self.tokens = np.memmap(self.bin_file, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
            except (OSError, ValueError) as exc:
                raise DataError(f"{self.bin_file}: cannot map: {getattr(exc, 'strerror', None) or exc}") from None
        else:
            # mmap refuses empty files; an empty array keeps the API uniform.
            self.tokens = np.zeros(0, dtype=self.dtype)

    def find_token_outside(self, limit: int, chunk: int = 1 << 25) -> tuple[int, int] | None:
        """(position, id) of the first token outside [0, limit) in the flat token stream, or None.

        One sequential pass over the memmap in `chunk`-token pieces (a max/min reduction each), so
        memory stays bounded and the cost is one read of the .bin.
        """
        signed = self.dtype.kind == "i"
        tokens = self.tokens
        for lo in range(0, self.num_tokens, chunk):
            part = tokens[lo : lo + chunk]
            if int(part.max()) >= limit or (signed and int(part.min()) < 0):
                bad = (part >= limit) | (part < 0) if signed else part >= limit
                k = int(np.argmax(bad))
                return lo + k, int(part[k])
        return None

    def locate(self, position: int) -> tuple[int, int]:
        """(document, offset within it) of flat token position `position`."""
        doc = int(np.searchsorted(self.doc_offsets, position, side="right")) - 1
        return doc, int(position - self.doc_offsets[doc])

    def __len__(self) -> int:
        return int(self.doc_lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        i %= n
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]

    def __repr__(self) -> str:
        return f"IndexedDataset({str(self.prefix)!r}, docs={len(self)}, tokens={self.num_tokens}, dtype={self.dtype})"

    @staticmethod
    def exists(prefix: str | Path) -> bool:
        """True when both PREFIX.bin and PREFIX.idx exist (not validated)."""
        return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def _check_regular_file(path: Path, missing: str = "no such file") -> None:
    # A FIFO or device would block or never end when read; a directory fails with a confusing errno.
    if path.is_file():
        return
    if path.exists():
        raise DataError(f"{path}: not a regular file")
    raise DataError(f"{path}: {missing}")


def _check_pointers(path: Path, pointers: np.ndarray, seq_starts: np.ndarray, item: int) -> None:
    """Byte pointers must be exactly the running sum of the sizes (back-to-back storage); vectorised."""
    want = seq_starts[:-1] * item
    if np.array_equal(pointers, want):
        return
    total = int(seq_starts[-1]) * item
    bad = int(np.argmax(pointers != want))
    got = int(pointers[bad])
    drops = np.flatnonzero(np.diff(pointers) < 0)
    if drops.size:
        k = int(drops[0])
        raise DataError(
            f"{path}: sequence byte pointers decrease at sequence {k + 1} "
            f"({int(pointers[k])} then {int(pointers[k + 1])})"
        )
    if got < 0 or got > total:
        raise DataError(
            f"{path}: sequence {bad} byte pointer {got} lies outside the {total} bytes the sequence sizes add up to"
        )
    raise DataError(
        f"{path}: sequence {bad} byte pointer {got} != {int(want[bad])} implied by the sizes "
        f"of the sequences before it; sequences must be stored back to back"
    )


def _read_index(path: Path):
    _check_regular_file(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) < HEADER_SIZE:
        raise DataError(f"{path}: truncated index: {len(raw)} bytes, the header alone is {HEADER_SIZE}")
    if raw[:9] != HEADER:
        raise DataError(f"{path}: not an MMIDIDX index (header {raw[:9]!r}, expected {HEADER!r})")
    (version,) = struct.unpack_from("<Q", raw, 9)
    if version != VERSION:
        raise DataError(f"{path}: unsupported MMIDIDX version {version} (expected {VERSION})")
    (code,) = struct.unpack_from("<B", raw, 17)
    if code not in DTYPE_CODES:
        raise DataError(f"{path}: unknown dtype code {code} (valid: {sorted(DTYPE_CODES)})")
    dtype = np.dtype(DTYPE_CODES[code])
    if dtype.kind == "f":
        raise DataError(f"{path}: dtype {dtype} cannot hold token ids")
    n_seq, n_doc_idx = struct.unpack_from("<QQ", raw, 18)
    want = HEADER_SIZE + 12 * n_seq + 8 * n_doc_idx
    if len(raw) != want:
        hint = (
            "; multimodal indices are not supported"
            if len(raw) == want + n_seq
            else "; truncated?"
            if len(raw) < want
            else ""
        )
        raise DataError(
            f"{path}: {len(raw)} bytes but the header ({n_seq} sequences, {n_doc_idx} document "
            f"indices) implies {want}{hint}"
        )
    off = HEADER_SIZE
    lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=off).astype(np.int64)
    off += 4 * n_seq
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=off).astype(np.int64)
    off += 8 * n_seq
    doc_idx = np.frombuffer(raw, dtype="<i8", count=n_doc_idx, offset=off).astype(np.int64)
    if n_seq and lengths.min() < 0:
        raise DataError(f"{path}: negative sequence length at sequence {int(np.argmin(lengths))}")
    if n_doc_idx < 1 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
        detail = (
            "none stored"
            if n_doc_idx < 1
            else f"first {int(doc_idx[0])}"
            if doc_idx[0] != 0
            else f"last {int(doc_idx[-1])}"
            if doc_idx[-1] != n_seq
            else f"they decrease at index {int(np.argmax(np.diff(doc_idx) < 0)) + 1}"
        )
        raise DataError(f"{path}: document indices must rise from 0 to the sequence count {n_seq} ({detail})")
    return dtype, lengths, pointers, doc_idx
