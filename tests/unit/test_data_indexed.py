"""MMIDIDX .bin/.idx: byte layout, round trip, validation errors, atomic writes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from scaletrain.data.indexed import (
    DataError,
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    write_indexed,
)

DOCS = [np.array([5, 6, 7]), np.array([], dtype=np.int64), np.array([1]), np.arange(100, 120)]


def _write_raw_idx(path, code, lengths, pointers, doc_idx, n_doc_field=None, version=1, header=b"MMIDIDX\x00\x00"):
    with open(path, "wb") as f:
        f.write(header)
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx) if n_doc_field is None else n_doc_field))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def test_roundtrip(tmp_path):
    prefix = tmp_path / "ds"
    write_indexed(prefix, DOCS, vocab_size=1000)
    ds = IndexedDataset(prefix)
    assert len(ds) == 4
    assert ds.dtype == np.uint16
    assert ds.num_tokens == 24
    assert ds.doc_lengths.tolist() == [3, 0, 1, 20]
    assert ds.doc_pointers.tolist() == [0, 6, 6, 8]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    for i, d in enumerate(DOCS):
        assert ds[i].tolist() == d.tolist()
    assert ds[-1].tolist() == DOCS[-1].tolist()
    assert ds.tokens.tolist() == np.concatenate(DOCS).tolist()
    assert isinstance(ds.tokens, np.memmap)
    assert np.shares_memory(ds[3], ds.tokens)  # zero-copy view
    with pytest.raises(IndexError):
        ds[4]


def test_dtype_choice():
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(None) == np.int32


def test_written_header_bytes(tmp_path):
    prefix = tmp_path / "ds"
    write_indexed(prefix, [np.array([1, 2, 3]), np.array([4, 5])], dtype=np.int32)
    raw = (tmp_path / "ds.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack_from("<Q", raw, 9)[0] == 1
    assert raw[17] == 4  # int32
    n_seq, n_doc_idx = struct.unpack_from("<QQ", raw, 18)
    assert (n_seq, n_doc_idx) == (2, 3)  # Megatron stores len(document_indices) = docs + 1
    assert struct.unpack_from("<2i", raw, 34) == (3, 2)
    assert struct.unpack_from("<2q", raw, 42) == (0, 12)
    assert struct.unpack_from("<3q", raw, 58) == (0, 1, 2)
    assert len(raw) == 58 + 24
    assert (tmp_path / "ds.bin").read_bytes() == np.array([1, 2, 3, 4, 5], dtype="<i4").tobytes()


def test_reads_hand_built_megatron_file(tmp_path):
    # Two documents, the first made of two sequences, as Megatron's sentence-split preprocessing writes them.
    prefix = tmp_path / "mega"
    tokens = np.array([10, 11, 12, 13, 14, 15], dtype="<u2")
    (tmp_path / "mega.bin").write_bytes(tokens.tobytes())
    _write_raw_idx(tmp_path / "mega.idx", 8, [2, 3, 1], [0, 4, 10], [0, 2, 3])
    ds = IndexedDataset(prefix)
    assert len(ds) == 2
    assert ds.dtype == np.uint16
    assert ds[0].tolist() == [10, 11, 12, 13, 14]
    assert ds[1].tolist() == [15]
    assert ds.doc_lengths.tolist() == [5, 1]


def _good_pair(tmp_path):
    prefix = tmp_path / "ds"
    write_indexed(prefix, [np.array([1, 2, 3]), np.array([4, 5])], dtype=np.uint16)
    return prefix


@pytest.mark.parametrize(
    "damage, file, words",
    [
        (
            lambda p: _write_raw_idx(p.with_suffix(".idx"), 8, [3, 2], [0, 6], [0, 1, 2], header=b"MMIDIDX\x00\x01"),
            ".idx",
            "not an MMIDIDX",
        ),
        (lambda p: _write_raw_idx(p.with_suffix(".idx"), 8, [3, 2], [0, 6], [0, 1, 2], version=2), ".idx", "version 2"),
        (lambda p: _write_raw_idx(p.with_suffix(".idx"), 9, [3, 2], [0, 6], [0, 1, 2]), ".idx", "dtype code 9"),
        (lambda p: _write_raw_idx(p.with_suffix(".idx"), 7, [3, 2], [0, 12], [0, 1, 2]), ".idx", "float32"),
        (
            lambda p: _write_raw_idx(p.with_suffix(".idx"), 8, [3, 2], [0, 6], [0, 1, 2], n_doc_field=5),
            ".idx",
            "implies",
        ),
        (lambda p: _write_raw_idx(p.with_suffix(".idx"), 8, [3, 2], [0, 8], [0, 1, 2]), ".idx", "back to back"),
        (lambda p: _write_raw_idx(p.with_suffix(".idx"), 8, [3, 2], [0, 6], [0, 2, 1]), ".idx", "document indices"),
        (lambda p: p.with_suffix(".idx").write_bytes(b"MMIDIDX"), ".idx", "truncated index"),
        (lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-1]), ".bin", "truncated"),
        (lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes() + b"\0\0"), ".bin", "expects"),
        (lambda p: p.with_suffix(".bin").unlink(), ".bin", "no such file"),
        (lambda p: p.with_suffix(".idx").unlink(), ".idx", "no such file"),
    ],
)
def test_damage_raises_dataerror_naming_file(tmp_path, damage, file, words):
    prefix = _good_pair(tmp_path)
    IndexedDataset(prefix)  # intact first
    damage(prefix)
    with pytest.raises(DataError) as exc:
        IndexedDataset(prefix)
    msg = str(exc.value)
    assert msg.startswith(f"{prefix}{file}: "), msg
    assert words in msg
    assert "\n" not in msg


def test_dataerror_is_one_line_valueerror():
    e = DataError("a.bin: first\nsecond")
    assert isinstance(e, ValueError)
    assert str(e) == "a.bin: first second"


def test_writer_is_atomic_and_replaces(tmp_path):
    prefix = tmp_path / "ds"
    write_indexed(prefix, [np.array([1, 2])], dtype=np.uint16)
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_document(np.array([7, 8, 9]))
    # Mid-write the old pair is untouched.
    assert IndexedDataset(prefix).tokens.tolist() == [1, 2]
    w.finalize()
    assert IndexedDataset(prefix).tokens.tolist() == [7, 8, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]


def test_writer_aborts_on_error(tmp_path):
    prefix = tmp_path / "ds"
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document(np.array([1, 2, 3]))
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_ids_outside_dtype(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "ds", np.uint16)
    with pytest.raises(DataError, match="70000"):
        w.add_document(np.array([1, 70000]))
    with pytest.raises(DataError, match="-1"):
        w.add_document(np.array([-1, 3]))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_empty_dataset_opens(tmp_path):
    write_indexed(tmp_path / "e", [], dtype=np.uint16)
    ds = IndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.tokens.size == 0
