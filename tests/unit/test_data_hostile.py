"""Hostile or broken dataset files: one clear DataError line naming the file, never a numpy traceback or bad training.

Every test damages a copy of the session's excerpt corpus (or a tiny hand-made dataset), never the fixture itself.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data.indexed import (
    HEADER_SIZE,
    DataError,
    IndexedDataset,
    _pack_index,
    write_indexed,
)
from scaletrain.data.prepare import load_dataset, meta_path
from scaletrain.data.tokenizer import Tokenizer

pytestmark = pytest.mark.hostile

VOCAB = 1024


# ---------------- helpers
@pytest.fixture()
def corpus(excerpt_corpus, tmp_path) -> Path:
    """A private copy of the excerpt corpus's files (train/valid .bin/.idx/.meta.json, tokenizer.model)."""
    dest = tmp_path / "corpus"
    dest.mkdir()
    for path in excerpt_corpus.root.iterdir():
        if path.is_file() and not path.name.startswith("."):
            shutil.copy(path, dest / path.name)
    return dest


def one_line_naming(exc: BaseException, path: Path) -> str:
    msg = str(exc)
    assert "\n" not in msg and "\r" not in msg, msg
    assert msg.startswith(f"{path}: "), msg
    return msg


def raises_naming(path: Path, fn, *args) -> str:
    with pytest.raises(DataError) as info:
        fn(*args)
    return one_line_naming(info.value, path)


def idx_layout(idx: Path) -> tuple[int, int, int, int, int]:
    """(n_seq, n_doc_idx, offset of sizes, of pointers, of document indices) of an .idx file."""
    n_seq, n_doc = struct.unpack_from("<QQ", idx.read_bytes(), 18)
    return n_seq, n_doc, HEADER_SIZE, HEADER_SIZE + 4 * n_seq, HEADER_SIZE + 12 * n_seq


def patch(path: Path, offset: int, fmt: str, value) -> None:
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    path.write_bytes(bytes(raw))


def read_field(path: Path, offset: int, fmt: str):
    return struct.unpack_from(fmt, path.read_bytes(), offset)[0]


def cut(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


# ---------------- 1. truncated / grown .bin
@pytest.mark.parametrize("keep", ["minus1", "minus2", "minus6", "half", "zero"])
def test_truncated_bin_names_file_and_sizes(corpus, keep):
    prefix = corpus / "train"
    bin_file = corpus / "train.bin"
    want = bin_file.stat().st_size
    size = {"minus1": want - 1, "minus2": want - 2, "minus6": want - 6, "half": want // 2, "zero": 0}[keep]
    cut(bin_file, size)
    for fn in (IndexedDataset, load_dataset):
        msg = raises_naming(bin_file, fn, prefix)
        assert "truncated" in msg and f"{size} bytes" in msg and f"expects {want}" in msg, msg
        assert "train.idx" in msg, msg


def test_grown_bin_names_file_and_sizes(corpus):
    bin_file = corpus / "train.bin"
    want = bin_file.stat().st_size
    bin_file.write_bytes(bin_file.read_bytes() + b"\0\0")
    msg = raises_naming(bin_file, IndexedDataset, corpus / "train")
    assert f"{want + 2} bytes" in msg and f"expects {want}" in msg


# ---------------- 2. truncated / malformed .idx header
@pytest.mark.parametrize("size", [0, 5, 9, 17, 18, 26, HEADER_SIZE - 1])
def test_idx_truncated_inside_header(corpus, size):
    idx = corpus / "train.idx"
    cut(idx, size)
    msg = raises_naming(idx, IndexedDataset, corpus / "train")
    assert "truncated index" in msg and f"{size} bytes" in msg


@pytest.mark.parametrize("where", ["sizes", "pointers", "doc_idx", "last_byte"])
def test_idx_truncated_inside_arrays(corpus, where):
    idx = corpus / "train.idx"
    n_seq, n_doc, o_sizes, o_ptr, o_doc = idx_layout(idx)
    full = idx.stat().st_size
    size = {"sizes": o_sizes + 2, "pointers": o_ptr + 4 * n_seq + 3, "doc_idx": o_doc + 8, "last_byte": full - 1}[where]
    cut(idx, size)
    msg = raises_naming(idx, IndexedDataset, corpus / "train")
    assert f"{size} bytes" in msg and f"implies {full}" in msg and "truncated?" in msg, msg


def test_idx_trailing_garbage(corpus):
    idx = corpus / "train.idx"
    idx.write_bytes(idx.read_bytes() + b"junk")
    assert "implies" in raises_naming(idx, IndexedDataset, corpus / "train")


@pytest.mark.parametrize("magic", [b"MMIDIDX\x00\x01", b"\x00" * 9, b"NOTANIDX!", b"mmididx\x00\x00"])
def test_idx_wrong_magic(corpus, magic):
    idx = corpus / "train.idx"
    raw = bytearray(idx.read_bytes())
    raw[:9] = magic
    idx.write_bytes(bytes(raw))
    assert "not an MMIDIDX index" in raises_naming(idx, IndexedDataset, corpus / "train")


@pytest.mark.parametrize("version", [0, 2, 1 << 8, 1 << 63])
def test_idx_wrong_version(corpus, version):
    idx = corpus / "train.idx"
    patch(idx, 9, "<Q", version)
    assert f"version {version}" in raises_naming(idx, IndexedDataset, corpus / "train")


@pytest.mark.parametrize(
    "code, words", [(0, "dtype code 0"), (9, "dtype code 9"), (255, "dtype code 255"), (6, "float64"), (7, "float32")]
)
def test_idx_unsupported_dtype_code(corpus, code, words):
    idx = corpus / "train.idx"
    patch(idx, 17, "<B", code)
    assert words in raises_naming(idx, IndexedDataset, corpus / "train")


@pytest.mark.parametrize("field, offset", [("sequence count", 18), ("document-index count", 26)])
def test_idx_count_field_flipped(corpus, field, offset):
    idx = corpus / "train.idx"
    orig = idx.read_bytes()
    for bit in (0, 7, 40, 63):
        idx.write_bytes(orig)
        patch(idx, offset, "<Q", read_field(idx, offset, "<Q") ^ (1 << bit))
        assert "implies" in raises_naming(idx, IndexedDataset, corpus / "train"), field


# ---------------- 3. inconsistent sizes / pointers / document indices
def test_pointer_past_end_of_bin(corpus):
    idx = corpus / "train.idx"
    n_seq, _, _, o_ptr, _ = idx_layout(idx)
    total = (corpus / "train.bin").stat().st_size
    patch(idx, o_ptr + 8 * (n_seq - 1), "<q", total + 2)
    msg = raises_naming(idx, IndexedDataset, corpus / "train")
    assert f"sequence {n_seq - 1} byte pointer {total + 2}" in msg and f"outside the {total} bytes" in msg


def test_negative_pointer(corpus):
    idx = corpus / "train.idx"
    _, _, _, o_ptr, _ = idx_layout(idx)
    patch(idx, o_ptr, "<q", -(1 << 62))
    assert "outside" in raises_naming(idx, IndexedDataset, corpus / "train")


def test_non_monotonic_pointers(corpus):
    idx = corpus / "train.idx"
    n_seq, _, _, o_ptr, _ = idx_layout(idx)
    assert n_seq >= 3
    p1, p2 = read_field(idx, o_ptr + 8, "<q"), read_field(idx, o_ptr + 16, "<q")
    patch(idx, o_ptr + 8, "<q", p2)
    patch(idx, o_ptr + 16, "<q", p1)
    msg = raises_naming(idx, IndexedDataset, corpus / "train")
    assert "pointers decrease at sequence 2" in msg and f"({p2} then {p1})" in msg


def test_size_not_matching_pointer_difference(corpus):
    idx = corpus / "train.idx"
    n_seq, _, o_sizes, _, _ = idx_layout(idx)
    patch(idx, o_sizes, "<i", read_field(idx, o_sizes, "<i") + 1)
    msg = raises_naming(idx, IndexedDataset, corpus / "train")
    assert "sequence 1 byte pointer" in msg and "back to back" in msg


def test_last_size_grown_is_a_bin_size_mismatch(corpus):
    # The last size has no pointer after it to contradict; the .bin's length does, and the message says so.
    idx = corpus / "train.idx"
    n_seq, _, o_sizes, _, _ = idx_layout(idx)
    off = o_sizes + 4 * (n_seq - 1)
    patch(idx, off, "<i", read_field(idx, off, "<i") + 1)
    msg = raises_naming(corpus / "train.bin", IndexedDataset, corpus / "train")
    assert "truncated" in msg and "its index train.idx expects" in msg


def test_negative_size(corpus):
    idx = corpus / "train.idx"
    _, _, o_sizes, _, _ = idx_layout(idx)
    patch(idx, o_sizes + 4, "<i", read_field(idx, o_sizes + 4, "<i") | -(1 << 31))
    assert "negative sequence length at sequence 1" in raises_naming(idx, IndexedDataset, corpus / "train")


@pytest.mark.parametrize(
    "which, value, words",
    [
        ("last", None, "(last"),  # doc_idx[-1] != sequence count
        ("last", 1 << 40, "(last"),
        ("first", 1, "(first 1)"),
        ("middle", 1 << 62, "decrease"),  # a huge middle entry: would index past the sizes
        ("middle", -1, "decrease"),
    ],
)
def test_document_indices_inconsistent(corpus, which, value, words):
    idx = corpus / "train.idx"
    n_seq, n_doc, _, _, o_doc = idx_layout(idx)
    assert n_doc >= 3
    pos = {"first": 0, "middle": 1, "last": n_doc - 1}[which]
    patch(idx, o_doc + 8 * pos, "<q", n_seq - 1 if value is None else value)
    msg = raises_naming(idx, IndexedDataset, corpus / "train")
    assert f"sequence count {n_seq}" in msg and words in msg, msg


def test_every_single_bit_flip_in_idx_is_caught_or_harmless(corpus):
    """Flip each bit of train.idx in turn: opening raises one DataError line, or yields the very same token stream.

    The only flips that can pass are ones that move a document boundary inside the document-index array
    (a different but valid grouping of the same sequences); training reads the flat stream, so they are harmless.
    """
    idx, prefix = corpus / "train.idx", corpus / "train"
    tok = Tokenizer(corpus / "tokenizer.model")
    good = IndexedDataset(prefix)
    good_tokens = np.array(good.tokens)
    _, _, _, _, o_doc = idx_layout(idx)
    orig = idx.read_bytes()
    accepted, errors = [], 0
    for bit in range(8 * len(orig)):
        raw = bytearray(orig)
        raw[bit // 8] ^= 1 << (bit % 8)
        idx.write_bytes(bytes(raw))
        try:
            ds = load_dataset(prefix, tok, VOCAB)
        except DataError as exc:
            msg = str(exc)
            assert "\n" not in msg and msg.startswith((f"{idx}: ", f"{corpus / 'train.bin'}: ")), msg
            errors += 1
            continue
        accepted.append(bit // 8)
        assert ds.num_tokens == good.num_tokens and np.array_equal(ds.tokens, good_tokens)
        assert np.array_equal(ds.sequence_lengths, good.sequence_lengths)
        assert np.array_equal(ds.sequence_pointers, good.sequence_pointers)
    assert all(b >= o_doc + 8 for b in accepted), accepted  # never the header, sizes, pointers, or doc_idx[0]
    assert errors > 0.95 * 8 * len(orig)


# ---------------- 4. token ids outside the vocabulary
def flip_token(bin_file: Path, pos: int, bit: int) -> int:
    tokens = np.fromfile(bin_file, dtype="<u2")
    tokens[pos] ^= 1 << bit
    tokens.tofile(bin_file)
    return int(tokens[pos])


@pytest.mark.parametrize("bit", [10, 12, 15])
def test_bit_flipped_bin_token_beyond_vocab_despite_sidecar(corpus, bit):
    # The sidecar records max_token_id 1023 for the file as written; the scan must not trust it.
    prefix, bin_file = corpus / "train", corpus / "train.bin"
    assert json.loads(meta_path(prefix).read_text())["max_token_id"] < VOCAB
    ds = IndexedDataset(prefix)
    pos = int(ds.doc_offsets[1]) + 17  # second document, offset 17
    value = flip_token(bin_file, pos, bit)
    assert value >= VOCAB
    msg = raises_naming(bin_file, load_dataset, prefix, Tokenizer(corpus / "tokenizer.model"), VOCAB)
    assert f"token id {value} outside the vocabulary [0, {VOCAB})" in msg
    assert f"at token {pos} (document 1, offset 17)" in msg and "sidecar records max id" in msg


def test_reports_first_offending_position(corpus):
    prefix, bin_file = corpus / "valid", corpus / "valid.bin"
    n = IndexedDataset(prefix).num_tokens
    later = flip_token(bin_file, n - 1, 15)
    first = flip_token(bin_file, 5, 11)
    msg = raises_naming(bin_file, load_dataset, prefix, None, VOCAB)
    assert f"token id {first} " in msg and "at token 5 (document 0, offset 5)" in msg and str(later) not in msg


def test_scan_finds_first_position_across_chunks(tmp_path):
    tokens = np.arange(1000, dtype=np.int64) % 50
    tokens[[333, 700]] = [60, 99]
    write_indexed(tmp_path / "d", [tokens[:300], tokens[300:301], tokens[301:]], dtype=np.uint16)
    ds = IndexedDataset(tmp_path / "d")
    for chunk in (1, 7, 64, 333, 334, 1000, 1 << 25):
        assert ds.find_token_outside(50, chunk=chunk) == (333, 60)
        assert ds.find_token_outside(61, chunk=chunk) == (700, 99)
        assert ds.find_token_outside(100, chunk=chunk) is None
    assert ds.locate(333) == (2, 32) and ds.locate(300) == (1, 0) and ds.locate(0) == (0, 0)


def test_negative_id_in_signed_dataset(tmp_path):
    prefix = tmp_path / "s"
    write_indexed(prefix, [np.array([1, 2, 3]), np.array([4, -7, 5])], dtype=np.int32)
    msg = raises_naming(tmp_path / "s.bin", load_dataset, prefix, None, VOCAB)
    assert "token id -7" in msg and "at token 4 (document 1, offset 1)" in msg


def test_id_check_through_open_data(corpus):
    from scaletrain.config import DataConfig
    from scaletrain.data.corpus import open_data

    cfg = DataConfig(
        train_prefix=str(corpus / "train"),
        valid_prefix=str(corpus / "valid"),
        tokenizer=str(corpus / "tokenizer.model"),
    )
    train, valid, _ = open_data(cfg, VOCAB)  # intact copy opens
    assert train.num_tokens and valid.num_tokens
    value = flip_token(corpus / "valid.bin", 100, 14)
    msg = raises_naming(corpus / "valid.bin", open_data, cfg, VOCAB)
    assert f"token id {value}" in msg and "at token 100" in msg


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\xff\xfe garbage", "not valid JSON"),
        (b'{"vocab_size": 1024', "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (None, "field 'tokenizer_sha256' must be a string"),
        ("num_tokens", "field 'num_tokens' must be an integer"),
        ("vocab_size", "field 'vocab_size' must be an integer"),
    ],
)
def test_hostile_sidecar(corpus, content, words):
    prefix, mfile = corpus / "train", meta_path(corpus / "train")
    if content is None:
        meta = json.loads(mfile.read_text())
        meta["tokenizer_sha256"] = 12345
        mfile.write_text(json.dumps(meta))
    elif isinstance(content, str):
        meta = json.loads(mfile.read_text())
        meta[content] = True if content == "vocab_size" else "many"
        mfile.write_text(json.dumps(meta))
    else:
        mfile.write_bytes(content)
    msg = raises_naming(mfile, load_dataset, prefix, Tokenizer(corpus / "tokenizer.model"), VOCAB)
    assert words in msg


# ---------------- 5. missing or odd files
@pytest.mark.parametrize("name", ["train.bin", "train.idx"])
def test_missing_file_names_it(corpus, name):
    (corpus / name).unlink()
    msg = raises_naming(corpus / name, load_dataset, corpus / "train", None, VOCAB)
    assert "no such file" in msg


@pytest.mark.parametrize("name", ["train.bin", "train.idx"])
def test_directory_or_fifo_instead_of_file(corpus, name):
    path = corpus / name
    path.unlink()
    path.mkdir()
    assert "not a regular file" in raises_naming(path, IndexedDataset, corpus / "train")
    path.rmdir()
    os.mkfifo(path)  # reading it would block forever: must be refused before any read
    assert "not a regular file" in raises_naming(path, IndexedDataset, corpus / "train")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of their mode")
def test_unreadable_idx(corpus):
    idx = corpus / "train.idx"
    idx.chmod(0)
    try:
        assert "cannot read" in raises_naming(idx, IndexedDataset, corpus / "train")
    finally:
        idx.chmod(0o644)


# ---------------- 6. end to end through the CLI
SMALL = [
    "model.vocab_size=1024",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=2",
    "model.seq_len=64",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
    "train.dtype=fp32",
    "train.threads=1",
    "train.max_steps=1",
    "train.progress=false",
]


def _damage(root: Path, kind: str) -> Path:
    """Damage one file of the corpus copy at `root`; return the path the error must name."""
    if kind == "bin_minus2":
        cut(root / "train.bin", (root / "train.bin").stat().st_size - 2)
        return root / "train.bin"
    if kind == "bin_zero":
        cut(root / "valid.bin", 0)
        return root / "valid.bin"
    if kind == "idx_magic":
        patch(root / "train.idx", 0, "<9s", b"GARBAGE!!")
        return root / "train.idx"
    if kind == "idx_cut_pointers":
        _, _, _, o_ptr, _ = idx_layout(root / "train.idx")
        cut(root / "train.idx", o_ptr + 5)
        return root / "train.idx"
    if kind == "idx_pointer_past_end":
        _, _, _, o_ptr, _ = idx_layout(root / "valid.idx")
        patch(root / "valid.idx", o_ptr, "<q", 1 << 40)
        return root / "valid.idx"
    if kind == "idx_doc_end":
        n_seq, n_doc, _, _, o_doc = idx_layout(root / "train.idx")
        patch(root / "train.idx", o_doc + 8 * (n_doc - 1), "<q", n_seq + 1)
        return root / "train.idx"
    if kind == "bin_token_flip":
        flip_token(root / "train.bin", 1234, 13)
        return root / "train.bin"
    if kind == "valid_token_flip":
        flip_token(root / "valid.bin", 0, 15)
        return root / "valid.bin"
    if kind == "missing_idx":
        (root / "train.idx").unlink()
        return root / "train.idx"
    if kind == "missing_valid_bin":
        (root / "valid.bin").unlink()
        return root / "valid.bin"
    if kind == "sidecar_garbage":
        meta_path(root / "train").write_text("{not json")
        return meta_path(root / "train")
    if kind == "missing_tokenizer":
        (root / "tokenizer.model").unlink()
        return root / "tokenizer.model"
    raise AssertionError(kind)


def _cli_train(root: Path, run_dir: Path) -> list[str]:
    args = [
        "train",
        "--set",
        f"data.train_prefix={root / 'train'}",
        "--set",
        f"data.valid_prefix={root / 'valid'}",
        "--set",
        f"data.tokenizer={root / 'tokenizer.model'}",
        "--set",
        f"train.run_dir={run_dir}",
    ]
    for kv in SMALL:
        args += ["--set", kv]
    return args


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "kind",
    [
        "bin_minus2",
        "bin_zero",
        "idx_magic",
        "idx_cut_pointers",
        "idx_pointer_past_end",
        "idx_doc_end",
        "bin_token_flip",
        "valid_token_flip",
        "missing_idx",
        "missing_valid_bin",
        "sidecar_garbage",
        "missing_tokenizer",
    ],
)
def test_cli_train_on_damaged_data(corpus, tmp_path, capsys, kind):
    from scaletrain.cli.main import main

    named = _damage(corpus, kind)
    before = _snapshot(corpus)
    run = tmp_path / "run"
    code = main(_cli_train(corpus, run))
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("scaletrain: error: ") and str(named) in lines[0], lines[0]
    assert not run.exists()  # nothing created for a run that never started
    assert _snapshot(corpus) == before  # and the data directory is left as it was


def test_cli_damaged_data_leaves_existing_run_dir_untouched(corpus, tmp_path, capsys):
    from scaletrain.cli.main import main

    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "result.json").write_text('{"status": "success"}')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 7.0}\n')
    before = _snapshot(run)
    named = _damage(corpus, "bin_token_flip")
    assert main(_cli_train(corpus, run)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scaletrain: error: ") and str(named) in err
    assert _snapshot(run) == before and sorted(p.name for p in run.iterdir()) == [
        "metrics.jsonl",
        "result.json",
        "tensorboard",
    ]


# ---------------- cost of the checks
def test_open_cost_stays_milliseconds_per_million_sequences(tmp_path):
    """Validation is vectorised: opening a 1M-sequence index (20 MB .idx) takes well under a second."""
    n = 1_000_000
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=n).astype(np.int64)
    prefix = tmp_path / "big"
    (tmp_path / "big.idx").write_bytes(_pack_index(lengths, np.dtype(np.uint16)))
    with open(tmp_path / "big.bin", "wb") as f:  # sparse: only the size matters for opening
        f.truncate(int(lengths.sum()) * 2)
    IndexedDataset(prefix)  # warm the page cache
    t0 = time.perf_counter()
    ds = IndexedDataset(prefix)
    elapsed = time.perf_counter() - t0
    assert len(ds) == n and ds.num_tokens == int(lengths.sum())
    assert elapsed < 1.0, f"opening 1M sequences took {elapsed * 1e3:.0f} ms"
