"""The SFT proxy task: "continue the scripture" on the King James Bible, a text domain held out from pretraining.

The proxy base model is pretrained on Shakespeare; fine-tuning it on the KJV with the same tokenizer stands in
for llama2_70b_lora's GovReport fine-tuning. Each example is one verse with its reference as the input and the
verse that follows it (same book) as the output; loss only on the output. Whole books are held out for
evaluation (VALID_BOOKS: narrative and epistle, 508 pairs, 206 packed sequences of 256 tokens; GovReport has 173
evaluation samples), so evaluating the whole set stays quick on a CPU.

Source: Debian's bible-kjv (the `bible` program, GPL-2+) and bible-kjv-text (its compressed text, public
domain), fetched with `apt-get download` (apt checks them against the signed archive index) and printed with
`bible -f Gen1:1-Rev22:21`: one verse per line, "Ge1:1 In the beginning ...". The printed text is pinned by
sha256, so a changed upstream is an error rather than a silently different benchmark.

Layout of DATA_DIR/kjv:

    kjv.txt                        the verified text (kept: a rebuild needs no network)
    pairs/{train,valid}.jsonl      {"input": "<ref> <verse>", "output": "<next verse>"}, in Bible order
    {train,valid}.bin/.idx/.meta.json   SFT datasets (see sft.py), Shakespeare tokenizer
    kjv.json                       stamp written last: recipe, counts
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from .corpus import as_data_errors, build_lock, default_paths, fetch_default, prepare_excerpt
from .indexed import DataError
from .sft import SFTData, SFTValid, prepare_sft
from .sft_paths import KJVCorpus, kjv_paths
from .tokenizer import Tokenizer

PIPELINE_VERSION = 1
DEB_PACKAGES = ("bible-kjv", "bible-kjv-text")  # Debian 12 (bookworm): 4.38
TEXT_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"  # 4,404,412 bytes, 31,102 verses
VALID_BOOKS = ("Ruth", "Est", "Jonah", "Jas", "1Pet")  # book names as `bible -f` prints them
# Whole books Mark, Galatians, Philippians (train) and Ruth, Jonah (valid), lines copied from kjv.txt.
EXCERPT = "kjv_excerpt.txt"
EXCERPT_SHA256 = "cf54c061a664ac285c8b9abb8cea4c4d04b5fcc1a4629b3dd169521efc45b861"
PROXY_SEQ_LEN = 256

Log = Callable[[str], None]
_VERSE = re.compile(r"(\d?[A-Za-z]+)(\d+):(\d+) (\S.*)")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_verses(text: str, name: str = "kjv.txt") -> list[tuple[str, str]]:
    """[(book, line)] for text in `bible -f` form; any other line is a DataError naming it."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _VERSE.fullmatch(line)
        if not m:
            raise DataError(f"{name}:{lineno}: not a verse line (expected e.g. 'Ge1:1 In the beginning ...')")
        out.append((m.group(1), line))
    return out


def make_pairs(text: str, valid_books=VALID_BOOKS, name: str = "kjv.txt") -> dict[str, list[dict]]:
    """{"train": [...], "valid": [...]} of {"input": verse with reference, "output": next verse's text}.

    Pairs never cross a book boundary; a book's pairs go to "valid" when it is in valid_books.
    """
    verses = parse_verses(text, name)
    split: dict[str, list[dict]] = {"train": [], "valid": []}
    for (book, line), (nbook, nline) in zip(verses, verses[1:]):
        if book == nbook:
            split["valid" if book in valid_books else "train"].append({"input": line, "output": nline.split(" ", 1)[1]})
    return split


def excerpt_text() -> str:
    """The packaged excerpt (whole books, `bible -f` form), checked against its pinned sha256."""
    data = resources.files(__package__).joinpath(f"excerpt/{EXCERPT}").read_bytes()
    if _sha256(data) != EXCERPT_SHA256:
        raise DataError(f"excerpt/{EXCERPT}: sha256 differs from the pin in kjv.py; damaged install?")
    return data.decode("ascii")


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> bytes:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DataError(f"{cwd}: `{' '.join(cmd[:2])}` failed: {exc}") from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.decode(errors="replace").splitlines() if ln.strip()]
        err = next((ln for ln in lines if ln.startswith("E:")), lines[-1] if lines else "no output")
        hint = " (run `apt-get update` first?)" if "Unable to locate" in err else ""
        raise DataError(f"{cwd}: `{' '.join(cmd[:2])}` exited {proc.returncode}: {err[:300]}{hint}")
    return proc.stdout


def fetch_text(root: Path, log: Log) -> str:
    """The whole KJV text: root/kjv.txt when it verifies, else downloaded from Debian and printed by `bible`."""
    kept = root / "kjv.txt"
    if kept.is_file() and _sha256(kept.read_bytes()) == TEXT_SHA256:
        return kept.read_text(encoding="ascii")
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise DataError(
                f"{root}: `{tool}` not found; the KJV comes from Debian packages {DEB_PACKAGES} "
                f"(use --excerpt offline or off Debian)"
            )
    log(f"downloading {' '.join(DEB_PACKAGES)} with apt-get")
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp_name:
        tmp = Path(tmp_name)
        _run(["apt-get", "download", *DEB_PACKAGES], tmp)
        debs = sorted(tmp.glob("*.deb"))
        if len(debs) != len(DEB_PACKAGES):
            raise DataError(f"{tmp}: apt-get download left {len(debs)} .deb files, expected {len(DEB_PACKAGES)}")
        for deb in debs:
            _run(["dpkg-deb", "-x", str(deb), "x"], tmp)
        lib = tmp / "x" / "usr" / "lib"
        # `-p .` with cwd=lib: the data file is found without putting a path (which may hold spaces) in -p.
        data = _run([str(tmp / "x" / "usr" / "bin" / "bible"), "-f", "-p", ".", "Gen1:1-Rev22:21"], lib)
    got = _sha256(data)
    if got != TEXT_SHA256:
        raise DataError(
            f"{root}: the KJV text printed by `bible` has sha256 {got[:16]}… ({len(data)} bytes), "
            f"not the pinned {TEXT_SHA256[:16]}…; has Debian's bible-kjv changed?"
        )
    tmp_file = kept.with_name(f".kjv.txt.tmp{os.getpid()}")
    tmp_file.write_bytes(data)
    os.replace(tmp_file, kept)
    return data.decode("ascii")


def _stats(prefix: Path, tok: Tokenizer) -> dict:
    d = SFTData(prefix, tok, tok.vocab_size)
    v = SFTValid(d, PROXY_SEQ_LEN)
    return {
        "pairs": len(d),
        "input_tokens": int(d.input_len.sum()),
        "output_tokens": int(d.output_len.sum()),
        f"sequences_at_{PROXY_SEQ_LEN}": v.num_sequences,
        "label_tokens": v.num_label_tokens,
        "label_fraction_of_tokens": round(v.num_label_tokens / v.num_tokens, 4),
        "label_fraction_of_positions": round(v.num_label_tokens / (v.num_sequences * PROXY_SEQ_LEN), 4),
    }


def prepare_kjv(root: str | Path, tokenizer: str | Path, text: str, log: Log | None = None) -> KJVCorpus:
    """Build the SFT pairs and datasets of `text` (the whole KJV or the excerpt) under root. Idempotent.

    A directory whose stamp records this text, tokenizer and split, and whose datasets open cleanly, is reused.
    """
    log = log or (lambda msg: None)
    corpus = KJVCorpus.at(Path(root).expanduser())
    tok = Tokenizer(tokenizer)
    recipe = {
        "pipeline": PIPELINE_VERSION,
        "text_sha256": _sha256(text.encode("ascii")),
        "valid_books": list(VALID_BOOKS),
        "tokenizer_sha256": tok.sha256,
    }

    def complete() -> bool:
        try:
            if json.loads(corpus.stamp.read_text()).get("recipe") != recipe:
                return False
            SFTData(corpus.train_prefix, tok, tok.vocab_size)
            SFTData(corpus.valid_prefix, tok, tok.vocab_size)
            return True
        except (OSError, ValueError, KeyError, AttributeError):  # missing, damaged or foreign stamp
            return False

    if complete():
        return corpus
    with as_data_errors(corpus.root), build_lock(corpus.root):
        if complete():
            return corpus
        if corpus.stamp.exists():
            corpus.stamp.unlink()
        pairs = make_pairs(text)
        (corpus.root / "pairs").mkdir(exist_ok=True)
        stamp: dict = {"recipe": recipe, "tokenizer": str(tok.path)}
        for split, prefix in (("train", corpus.train_prefix), ("valid", corpus.valid_prefix)):
            jsonl = corpus.root / "pairs" / f"{split}.jsonl"
            jsonl.write_text("".join(json.dumps(p) + "\n" for p in pairs[split]), encoding="ascii")
            log(f"tokenizing {len(pairs[split])} {split} pairs")
            prepare_sft([jsonl], prefix, tok)
            stamp[split] = _stats(prefix, tok)
        tmp = corpus.stamp.with_name(f".kjv.json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(stamp, indent=2) + "\n")
        os.replace(tmp, corpus.stamp)
    return corpus


def fetch_kjv(data_dir: str | Path, vocab_size: int = 8192, excerpt: bool = False, log: Log | None = None) -> KJVCorpus:
    """Prepare DATA_DIR/kjv with the Shakespeare tokenizer of DATA_DIR/shakespeare (built first if missing).

    excerpt=True builds from the packaged excerpt and the Shakespeare excerpt corpus: no network.
    """
    log = log or (lambda msg: None)
    data_dir = Path(data_dir).expanduser()
    if excerpt:
        shakespeare = prepare_excerpt(default_paths(data_dir).root, vocab_size, log=log)
        text = excerpt_text()
    else:
        shakespeare = fetch_default(data_dir, vocab_size, log=log)
        root = kjv_paths(data_dir).root
        with as_data_errors(root):
            root.mkdir(parents=True, exist_ok=True)
            text = fetch_text(root, log)
    return prepare_kjv(kjv_paths(data_dir).root, shakespeare.tokenizer, text, log)
