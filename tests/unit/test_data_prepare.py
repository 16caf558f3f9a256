"""read_documents: .txt, JSONL, C4-style .json.gz, directories, and the errors for bad input."""

from __future__ import annotations

import gzip
import json

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


@pytest.mark.parametrize("name, content, words", [
    ("corrupt.json.gz", b"not gzip at all", "cannot read"),
    ("latin1.txt", "café".encode("latin-1"), "not UTF-8"),
    ("data.parquet", b"PAR1", "unsupported file type"),
])
def test_unreadable_files(tmp_path, name, content, words):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(DataError) as exc:
        list(read_documents([p]))
    assert str(exc.value).startswith(f"{p}: ") and words in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list(read_documents([tmp_path / "nope.txt"]))
