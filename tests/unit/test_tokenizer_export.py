"""SentencePiece -> tokenizer.json conversion (checkpoint/hf/tokenizer_export.py): the `tokenizers` tokenizer gives
SentencePiece's ids and decoded text on random mixes of spaces, tabs, line breaks, escaped-space look-alikes and
characters outside the vocabulary; models it cannot reproduce are refused in one line."""

from __future__ import annotations

import random

import pytest

from scaletrain.checkpoint.hf.tokenizer_export import sentencepiece_to_hf
from scaletrain.data.tokenizer import Tokenizer

pytest.importorskip("tokenizers")

# What SentencePiece's normalizer treats specially (spaces and their runs, "\n" as a user-defined piece, other
# whitespace mapped to spaces, "▁" itself, NFKC), letters it merges, and characters only byte fallback encodes.
ALPHABET = [
    " ",
    " ",
    " ",
    "\n",
    "\n",
    "\t",
    "\r",
    "\u00a0",
    "\u3000",
    "▁",
    "e",
    "a",
    "th",
    "O,",
    ".",
    "9",
    "é",
    "ﬁ",
    "Ａ",
    "日",
    "😀",
    "\x00",
]


def test_converted_sentencepiece_encodes_and_decodes_like_sentencepiece(excerpt_corpus):
    ours = Tokenizer(excerpt_corpus.tokenizer)
    hf = sentencepiece_to_hf(ours.path.read_bytes())
    rng = random.Random(0)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 16))) for _ in range(400)]
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ids == ours.encode(text), repr(text)
        assert hf.decode(ids) == ours.decode(ids), repr(text)
    assert hf.get_vocab_size() == ours.vocab_size
    assert hf.token_to_id("</s>") == ours.eos_id and hf.token_to_id("<pad>") == ours.pad_id


@pytest.mark.hostile
def test_models_that_do_not_convert_exactly_are_refused(tmp_path):
    import sentencepiece as spm

    with pytest.raises(ValueError, match=r"^where: not a SentencePiece model \("):
        sentencepiece_to_hf(b"\x0a\xff\xff", "where")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"line {i} of some words here and there" for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "uni"), vocab_size=40, model_type="unigram", minloglevel=2
    )
    with pytest.raises(ValueError, match=r"uni\.model: SentencePiece model_type 1 is not BPE \(2\)"):
        sentencepiece_to_hf((tmp_path / "uni.model").read_bytes(), str(tmp_path / "uni.model"))
