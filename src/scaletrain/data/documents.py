"""Documents from the files `data prepare` reads: .txt (a file is one document), JSONL and gzip JSONL ("text" fields).

Apart from prepare.py so that the tokenizer trainers (tokenizer.py, bpe.py), which prepare.py uses, read the same
documents without an import cycle.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from .indexed import DataError

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
GZIP_SUFFIXES = (".json.gz", ".jsonl.gz")


def document_lines(paths: Iterable[str | Path]) -> Iterator[str]:
    """Every non-blank line (without its line break) of the documents in `paths`: what a tokenizer trains on.

    JSONL and .json.gz files give the lines of their "text" fields, not the JSON syntax around them (escapes such as
    "\\n" or "\\u00e9" would otherwise become the vocabulary). Any other file is read as text line by line, as it
    always was (undecodable bytes replaced), so the default corpus's tokenizers stay byte-identical.
    """
    for path in input_files(paths):
        if _kind(path) in ("jsonl", "gz"):
            yield from lines_of(read_documents([path]))
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    yield line.rstrip("\r\n")


def lines_of(documents: Iterable[str]) -> Iterator[str]:
    """The non-blank lines of `documents`, without their line breaks."""
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line.rstrip("\r")


def input_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files `data prepare` reads from `paths`: files as given, directories expanded to their .txt/JSONL/.json.gz
    files (sorted); DataError for a path that does not exist."""
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


def read_documents(paths: Iterable[str | Path]) -> Iterator[str]:
    """Yield document strings from files: .txt (whole file = one document), JSONL and gzip JSONL (C4's .json.gz).

    JSON lines need a string "text" field. Directories are expanded to their supported files, sorted.
    """
    for path in input_files(paths):
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
