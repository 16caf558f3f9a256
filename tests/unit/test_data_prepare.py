"""read_documents: .txt, JSONL, C4-style .json.gz, directories, and the errors for bad input."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from scaletrain.data.indexed import DataError
from scaletrain.data.prepare import read_documents


def test_txt_is_one_document(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"line one\r\nline two\r\n")
    assert list(read_documents([p])) == ["line one\nline two\n"]


def test_jsonl_and_gzip(tmp_path):
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"text": "first", "url": "x"}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    g = tmp_path / "c4-train.00000-of-01024.json.gz"
    with gzip.open(g, "wt", encoding="utf-8") as f:
        for t in ("gz one", "gz two ü"):
            f.write(json.dumps({"text": t, "timestamp": "2019"}) + "\n")
    assert list(read_documents([j, g])) == ["first", "second", "gz one", "gz two ü"]


def test_directory_expands_sorted(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("B")
    (tmp_path / "d" / "a.txt").write_text("A")
    (tmp_path / "d" / "notes.bin").write_bytes(b"\0")  # unsupported files in a directory are skipped
    assert list(read_documents([tmp_path / "d"])) == ["A", "B"]


def test_bad_json_line_names_file_and_line(tmp_path):
    j = tmp_path / "bad.jsonl"
    j.write_text('{"text": "ok"}\n{"text": "ok2"}\n{"text": oops}\n')
    with pytest.raises(DataError) as exc:
        list(read_documents([j]))
    assert str(exc.value).startswith(f"{j}:3: bad JSON")


def test_missing_text_field(tmp_path):
    j = tmp_path / "nofield.jsonl"
    j.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"nofield\.jsonl:1: .*'text'"):
        list(read_documents([j]))


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("corrupt.json.gz", b"not gzip at all", "cannot read"),
        ("latin1.txt", "café".encode("latin-1"), "not UTF-8"),
        ("data.parquet", b"PAR1", "unsupported file type"),
    ],
)
def test_unreadable_files(tmp_path, name, content, words):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(DataError) as exc:
        list(read_documents([p]))
    assert str(exc.value).startswith(f"{p}: ") and words in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list(read_documents([tmp_path / "nope.txt"]))


# ---------------------------------------------------------------- long documents are tokenized in pieces

EXCERPT = __import__("pathlib").Path(__import__("scaletrain").__file__).parent / "data" / "excerpt"


def _tokens(prefix):
    from scaletrain.data.indexed import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_text_pieces_cut_at_single_spaces_else_at_the_limit():
    from scaletrain.data.prepare import text_pieces

    # The seam is a single space between two non-space characters; the space starts the next piece.
    assert list(text_pieces("aaa bbb ccc ddd", 8)) == ["aaa bbb", " ccc ddd"]
    assert list(text_pieces("aaaa  bbbbbbbbbb", 8)) == ["aaaa", "  bbbbbb", "bbbb"]  # a run of spaces too
    # Spaces next to a line break are no seam (the normalizer treats them differently): hard cut.
    assert list(text_pieces("aaaaa \nbbbbbbbb", 8)) == ["aaaaa \nb", "bbbbbbb"]
    assert list(text_pieces("aa\n bbbbbbbbbbb", 8)) == ["aa\n bbbb", "bbbbbbb"]
    assert list(text_pieces("x" * 20, 8)) == ["x" * 8, "x" * 8, "x" * 4]  # no space: hard cut
    assert list(text_pieces("short", 8)) == ["short"]


@pytest.mark.parametrize("piece_chars", [1000, 4096])
def test_streamed_long_documents_store_the_whole_text_tokens(excerpt_corpus, tmp_path, monkeypatch, piece_chars):
    """Documents longer than ENCODE_PIECE_CHARS go through text_pieces; the stored ids equal whole-text encoding."""
    import scaletrain.data.prepare as prep
    from scaletrain.data.tokenizer import Tokenizer

    tok = Tokenizer(excerpt_corpus.tokenizer)
    docs = [p.read_text(encoding="utf-8")[:60000] for p in sorted(EXCERPT.glob("*.txt"))]
    seams = [piece for d in docs for piece in list(prep.text_pieces(d, piece_chars))[1:]]
    assert len(seams) > 60 and all(piece.startswith(" ") for piece in seams)  # all at spaces: no hard cut
    docs.insert(1, "tiny doc")  # short documents around long ones keep their order
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    monkeypatch.setattr(prep, "ENCODE_PIECE_CHARS", piece_chars)
    prep.prepare_dataset([src], tmp_path / "streamed", tok)
    assert _tokens(tmp_path / "streamed") == [tok.encode(d) for d in docs]


def test_small_documents_are_not_streamed_and_unchanged(excerpt_corpus, tmp_path, monkeypatch):
    import scaletrain.data.prepare as prep
    from scaletrain.data.tokenizer import Tokenizer

    tok = Tokenizer(excerpt_corpus.tokenizer)
    docs = [
        line for line in (EXCERPT / "macbeth_acts_1_2.txt").read_text(encoding="utf-8").split("\n\n") if line.strip()
    ][:200]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    monkeypatch.setattr(prep, "text_pieces", lambda *a: pytest.fail("a small document was streamed"))
    prep.prepare_dataset([src], tmp_path / "small", tok)
    assert _tokens(tmp_path / "small") == [tok.encode(d) for d in docs]


# The child's own high-water mark (VmHWM, KiB), not getrusage's ru_maxrss: Linux carries ru_maxrss over exec, so a
# child of a big pytest process would report the parent's size.
_PEAK = """
import sys
from scaletrain.data.prepare import prepare_dataset
from scaletrain.data.tokenizer import Tokenizer
tok = Tokenizer(sys.argv[1])
if sys.argv[2] != "-":
    prepare_dataset([sys.argv[2]], sys.argv[3], tok)
with open("/proc/self/status") as f:
    print(next(line.split()[1] for line in f if line.startswith("VmHWM:")))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc/self/status (VmHWM)")
def test_one_huge_jsonl_line_is_prepared_in_bounded_memory(excerpt_corpus, tmp_path):
    """An 8 MB single-line document: peak RSS above a bare import + tokenizer load stays under 12x the line.

    Measured: whole-text encoding took +410 MB (SentencePiece ~50 B/char plus the id list); streamed in pieces
    +38 MB: the line and the parsed string (json.loads holds both), the reader's buffer, and one piece.
    """
    rng = np.random.default_rng(0)
    words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), k)) for k in rng.integers(1, 9, 4000)])
    text = " ".join(words[rng.integers(0, len(words), 1_800_000)])[:8_000_000]
    src = tmp_path / "huge.jsonl"
    src.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    del text

    def peak_kib(*args):
        out = subprocess.run(
            [sys.executable, "-c", _PEAK, str(excerpt_corpus.tokenizer), *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONMALLOC": ""},
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    base = peak_kib("-")
    huge = peak_kib(str(src), str(tmp_path / "huge"))
    assert len(_tokens(tmp_path / "huge")) == 1
    assert (huge - base) * 1024 < 12 * src.stat().st_size, (base, huge)
