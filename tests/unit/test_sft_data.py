"""SFT data: pair reading, packing and label masking, sampling interface, corrupt files, the KJV proxy set."""

from __future__ import annotations

import json
import os
import stat
import sys

import numpy as np
import pytest
import torch

from scaletrain.data import kjv
from scaletrain.data.indexed import DataError, write_indexed
from scaletrain.data.sft import SFTData, SFTSamples, SFTValid, prepare_sft, prepared_sha256, read_pairs
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.model.loss import IGNORE_INDEX

WORDS = "lord king sword crown night day river stone heart blood fire gold".split()


@pytest.fixture(scope="module")
def tok(excerpt_corpus):
    return Tokenizer(excerpt_corpus.tokenizer)


def _pairs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(rng.choice(WORDS, size=k))  # noqa: E731
    return [{"input": words(int(rng.integers(1, 12))), "output": words(int(rng.integers(1, 8)))} for _ in range(n)]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def sft(tmp_path, tok):
    """(SFTData, the pairs) of 40 random short pairs."""
    pairs = _pairs(40)
    prepare_sft([_jsonl(tmp_path / "p.jsonl", pairs)], tmp_path / "d", tok)
    return SFTData(tmp_path / "d", tok, tok.vocab_size), pairs


def _expected_row(data, tok, pairs, keep_in, keep_out, ks, S):
    """Independent reconstruction of one packed row: tokens, and which positions' targets are output tokens."""
    toks, is_out = [], []
    for k in ks:
        a, b = tok.encode(pairs[k]["input"]), tok.encode(pairs[k]["output"])
        piece = a[: keep_in[k]] + [tok.eos_id] + b[: keep_out[k]] + [tok.eos_id]
        toks += piece
        is_out += [False] * (keep_in[k] + 1) + [True] * (keep_out[k] + 1)
    labels = [toks[p + 1] if p + 1 < len(toks) and is_out[p + 1] else IGNORE_INDEX for p in range(S)]
    return toks + [0] * (S - len(toks)), labels


@pytest.mark.parametrize("S", [16, 24, 64])
def test_packing_masks_exactly_the_input_targets(sft, tok, S):
    data, pairs = sft
    keep_in, keep_out, bounds = data.pack(S)
    v = SFTValid(data, S)
    x, y = v.batch(0, v.num_sequences)
    assert x.shape == y.shape == (v.num_sequences, S) and x.dtype == y.dtype == torch.long
    for j in range(v.num_sequences):
        ks = range(int(bounds[j]), int(bounds[j + 1]))
        assert len(ks) >= 1
        want_x, want_y = _expected_row(data, tok, pairs, keep_in, keep_out, ks, S)
        assert x[j].tolist() == want_x and y[j].tolist() == want_y
    if S == 64:
        assert (np.diff(bounds) > 1).any()  # several examples really share sequences


def test_every_output_token_trained_once_per_epoch(sft, tok):
    data, pairs = sft
    ts = SFTSamples(data, 32, seed=5)
    n = ts.num_samples
    ids = ts.sample_ids(0, n)
    assert sorted(ids.tolist()) == list(range(n))
    _, y = ts.batch(0, n)
    seen = []
    for row, j in zip(y, ids):
        got = row[row != IGNORE_INDEX].tolist()
        want = sum((tok.encode(pairs[k]["output"]) + [tok.eos_id] for k in range(ts.bounds[j], ts.bounds[j + 1])), [])
        assert got == want
        seen += list(range(ts.bounds[j], ts.bounds[j + 1]))
    assert sorted(seen) == list(range(len(pairs)))
    assert int((y != IGNORE_INDEX).sum()) == sum(len(tok.encode(p["output"])) + 1 for p in pairs)


def test_truncation_drops_the_input_end_then_the_output(tmp_path, tok):
    long_in, short_out = " ".join(WORDS * 3), "gold"
    prepare_sft(
        [
            _jsonl(
                tmp_path / "p.jsonl",
                [{"input": long_in, "output": short_out}, {"input": "lord", "output": " ".join(WORDS * 3)}],
            )
        ],
        tmp_path / "d",
        tok,
    )
    d = SFTData(tmp_path / "d", tok)
    S = 16
    x, y = SFTValid(d, S).batch(0, 2)
    a, b = tok.encode(long_in), tok.encode(short_out)
    keep = S - 2 - len(b)
    assert x[0].tolist() == a[:keep] + [tok.eos_id] + b + [tok.eos_id]  # the input's start is kept
    assert y[0].tolist() == [IGNORE_INDEX] * (keep - 1) + [IGNORE_INDEX] + b + [tok.eos_id] + [IGNORE_INDEX]
    out = tok.encode(" ".join(WORDS * 3))
    assert x[1].tolist() == [tok.eos_id] + out[: S - 2] + [tok.eos_id]  # input gone, output cut, EOS kept
    assert int((y[1] != IGNORE_INDEX).sum()) == S - 1


def test_dp_rank_slices_partition_the_global_batch(sft):
    data, _ = sft
    ts = SFTSamples(data, 16, seed=3)
    G = 8
    full_x, full_y = ts.batch(ts.num_samples - 3, G)  # crosses an epoch boundary
    for dp, mbs in ((1, 8), (2, 2), (4, 1), (8, 1)):
        parts = [ts.rank_batch(ts.num_samples - 3, G, r, dp, mbs, i) for r in range(dp) for i in range(G // dp // mbs)]
        assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
        assert torch.equal(torch.cat([p[1] for p in parts]), full_y)
    again = SFTSamples(SFTData(data.ds.prefix), 16, seed=3)  # a resumed run: same samples at the same offset
    assert torch.equal(again.batch(ts.num_samples - 3, G)[0], full_x)
    assert not np.array_equal(SFTSamples(data, 16, seed=4).sample_ids(0, 8), ts.sample_ids(0, 8))


def test_eval_loss_counts_only_output_tokens(sft):
    data, pairs = sft
    v = SFTValid(data, 32)
    assert v.num_label_tokens == int((data.output_len + 1).sum())
    batches = list(v.batches(micro_batch=3, dp_rank=0, dp_size=1))
    assert sum(int((y != IGNORE_INDEX).sum()) for _, y in batches) == v.num_label_tokens
    V = 1024
    gen = torch.Generator().manual_seed(0)

    def loss(input_logit_scale: float) -> float:
        total = 0.0
        for _, y in batches:
            logits = torch.randn(*y.shape, V, generator=gen) * input_logit_scale
            trained = y != IGNORE_INDEX
            logits[trained] = -30.0
            logits[trained, y[trained]] = 30.0  # perfect on every output token
            total += float(torch.nn.functional.cross_entropy(logits.view(-1, V), y.view(-1), reduction="sum"))
        return total / v.num_label_tokens

    assert loss(1.0) < 1e-6 and loss(100.0) < 1e-6  # whatever happens on input positions does not count
    lo_hi = [v.rank_range(r, 3) for r in range(3)]
    assert lo_hi[0][0] == 0 and lo_hi[-1][1] == v.num_sequences and all(a[1] == b[0] for a, b in zip(lo_hi, lo_hi[1:]))


def test_jsonl_fields_aliases_and_gzip(tmp_path):
    import gzip

    p = _jsonl(tmp_path / "a.jsonl", [{"input": "i1", "output": "o1"}, {"report": "r", "summary": "s", "id": 3}])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"q": "x", "a": "y"}) + "\n\n")
    assert list(read_pairs([p])) == [("i1", "o1"), ("r", "s")]
    assert list(read_pairs([tmp_path / "b.jsonl.gz"], "q", "a")) == [("x", "y")]
    with pytest.raises(DataError, match=r"b\.jsonl\.gz:1: expected string fields 'input/report'"):
        list(read_pairs([tmp_path / "b.jsonl.gz"]))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"report": ["r1", "r2"], "summary": ["s1", "s2"], "n": [1, 2]}), tmp_path / "g.parquet")
    assert list(read_pairs([tmp_path / "g.parquet"])) == [("r1", "s1"), ("r2", "s2")]
    with pytest.raises(DataError, match="no input/output columns"):
        list(read_pairs([tmp_path / "g.parquet"], "text", "summary"))


def test_parquet_without_pyarrow_says_so(tmp_path, monkeypatch):
    (tmp_path / "g.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import now raises ImportError
    with pytest.raises(DataError, match=r"g\.parquet: reading parquet needs pyarrow; `pip install pyarrow`"):
        list(read_pairs([tmp_path / "g.parquet"]))


def test_bad_json_line_names_file_and_line(tmp_path, tok):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input": "a", "output": "b"}\n\n{"input": "a", "output": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: bad JSON") as e:
        prepare_sft([p], tmp_path / "d", tok)
    assert "\n" not in str(e.value)
    p.write_text('{"input": "a", "output": 7}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: expected string fields"):
        prepare_sft([p], tmp_path / "d", tok)


def test_corrupt_and_wrong_datasets_are_one_line_errors(sft, tmp_path, tok):
    data, _ = sft
    prefix = data.ds.prefix
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(os.path.getsize(f"{prefix}.bin") - 2)
    with pytest.raises(DataError, match="truncated"):
        SFTData(prefix, tok)
    write_indexed(tmp_path / "pre", [np.array([5, 6, 7])], vocab_size=1024)  # a pretraining set, no sidecar
    with pytest.raises(DataError, match="not an SFT dataset"):
        SFTData(tmp_path / "pre")
    for bad, found in (([5, 6, 1], 1), ([5, 1, 1, 6], 2)):  # one EOS; two, but not ending the example
        docs = [np.array([5, 1, 6, 1]), np.array(bad)]
        write_indexed(tmp_path / "bad", docs, vocab_size=1024)
        meta = {
            "format": "sft",
            "eos_id": 1,
            "tokenizer_sha256": tok.sha256,
            "vocab_size": 1024,
            "num_documents": 2,
            "num_tokens": 4 + len(bad),
        }
        (tmp_path / "bad.meta.json").write_text(json.dumps(meta))
        with pytest.raises(DataError, match=rf"bad\.bin: document 1 is not an SFT example .*found {found} EOS"):
            SFTData(tmp_path / "bad", tok)


def test_kjv_pairs_stay_in_books_and_hold_out_books():
    text = "Ruth4:22 And Obed begat Jesse.\nMat1:1 The book.\nMat1:2 Abraham begat Isaac.\nMat2:1 Now when.\n"
    p = kjv.make_pairs(text, valid_books=("Ruth",))
    assert p["valid"] == []  # Ruth's last verse has no successor inside Ruth
    assert p["train"] == [
        {"input": "Mat1:1 The book.", "output": "Abraham begat Isaac."},
        {"input": "Mat1:2 Abraham begat Isaac.", "output": "Now when."},
    ]
    with pytest.raises(DataError, match=r"kjv\.txt:2: not a verse line"):
        kjv.parse_verses("Ge1:1 In the beginning.\n\n")


# Pinned for the packaged excerpt: the pairs (tokenizer-independent) and, for the excerpt's 1024-piece Shakespeare
# tokenizer, the prepared arrays. Update them only together with a deliberate change to the pipeline.
PAIRS_SHA256 = {
    "train": "f9d6ac5fb223f31b3283957fb5c74f6a4cf386238d4484c5401c29f640c41e29",
    "valid": "0896cb2158098cb2d4a088fe4f2ad927c8a222d6d57cb5c1865a58765749293a",
}
EXCERPT_TOKENIZER_SHA256 = "f4390c5c0e44042786f20a4cad8e4f43b13472e4f5338b2e8682efa1804a08ad"
PREPARED_SHA256 = {
    "train": "4c6dc26fe3e478e7f4e7adc7ac6e4043378132bdbaef8547508cdf4ece584635",
    "valid": "bae41ebb4eaefd09ed49a2e5c17f078bac8d5dcbb2e13ba90b58c92b9e3b5d1e",
}


def test_kjv_excerpt_build_is_pinned_and_idempotent(excerpt_corpus, tmp_path):
    text = kjv.excerpt_text()
    a = kjv.prepare_kjv(tmp_path / "a", excerpt_corpus.tokenizer, text)
    b = kjv.prepare_kjv(tmp_path / "b" / "elsewhere", excerpt_corpus.tokenizer, text)
    info = a.info()
    assert (info["train"]["pairs"], info["valid"]["pairs"]) == (928, 131)
    for split in ("train", "valid"):
        jsonl = (a.root / "pairs" / f"{split}.jsonl").read_bytes()
        assert kjv._sha256(jsonl) == PAIRS_SHA256[split]
        prefix = getattr(a, f"{split}_prefix")
        assert prepared_sha256(prefix) == prepared_sha256(getattr(b, f"{split}_prefix"))
    mtime = os.path.getmtime(f"{a.train_prefix}.bin")
    assert kjv.prepare_kjv(a.root, excerpt_corpus.tokenizer, text) == a  # reused, not rebuilt
    assert os.path.getmtime(f"{a.train_prefix}.bin") == mtime
    if Tokenizer(excerpt_corpus.tokenizer).sha256 != EXCERPT_TOKENIZER_SHA256:
        pytest.skip("this sentencepiece trains a different excerpt tokenizer; the array pins do not apply")
    assert {s: prepared_sha256(getattr(a, f"{s}_prefix")) for s in ("train", "valid")} == PREPARED_SHA256


def _stub(bindir, name, body):
    path = bindir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_kjv_fetch_checks_tools_and_the_text_pin(tmp_path, monkeypatch):
    monkeypatch.setattr(kjv.shutil, "which", lambda tool: None)
    with pytest.raises(DataError, match="`apt-get` not found"):
        kjv.fetch_text(tmp_path, print)
    monkeypatch.undo()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # Fake Debian: the debs "contain" a `bible` that prints one wrong verse.
    _stub(bindir, "apt-get", "touch bible-kjv_1_all.deb bible-kjv-text_1_all.deb\n")
    _stub(
        bindir,
        "dpkg-deb",
        'mkdir -p "$3/usr/bin" "$3/usr/lib"\n'
        'printf "#!/bin/sh\\necho Ge1:1 Not the text.\\n" > "$3/usr/bin/bible"; chmod +x "$3/usr/bin/bible"\n',
    )
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(DataError, match="not the pinned cd45f0c9cedab8e4"):
        kjv.fetch_text(tmp_path, print)
    assert not (tmp_path / "kjv.txt").exists()
    _stub(bindir, "apt-get", 'echo "E: Unable to locate package bible-kjv" >&2; exit 100\n')
    with pytest.raises(DataError, match="Unable to locate package bible-kjv .*apt-get update"):
        kjv.fetch_text(tmp_path, print)
