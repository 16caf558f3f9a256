"""The tokenizer files of a Hugging Face export: `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`.

A run's tokenizer is a SentencePiece `.model` or a Hugging Face `tokenizer.json` (scaletrain.data.tokenizer). A
tokenizer.json is shipped as the very bytes the run used. A SentencePiece BPE model is converted with the
`tokenizers` library the way transformers' `convert_slow_tokenizer` (SpmConverter) does, so that
`AutoTokenizer.from_pretrained` gives the ids the model was trained on:

* model: BPE over the same vocabulary (ids unchanged), merges from the normal pieces ranked by score, byte fallback;
* normalizer: SentencePiece's own order -- its precompiled character map (nmt_nfkc), then extra spaces removed
  (leading, trailing, runs), spaces escaped to "▁", the dummy "▁" prefix. User-defined pieces (scaletrain's "\\n")
  are matched in the raw text before SentencePiece normalizes anything, so they are swapped for Unicode
  noncharacters around the character map (which would turn "\\n" into a space), then restored and isolated;
* decoder: "▁" back to spaces, byte pieces back to UTF-8, the dummy prefix's space dropped.

The .model file is protobuf; the few fields needed are read here from the wire format, so export needs neither
protobuf nor transformers. Control pieces (pad, eos) become special added tokens: as in every converted Hugging Face
tokenizer, their literal text ("</s>") in an input encodes as that token, where SentencePiece spells it out.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from typing import Any

__all__ = ["sentencepiece_to_hf", "tokenizer_files", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
"""What an export with a tokenizer holds besides the weights and config.json."""

# Piece types of sentencepiece_model.proto (SentencePiece.Type); NORMAL is the default when the field is absent.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BPE = 2  # TrainerSpec.ModelType
# Unicode noncharacters ("never for interchange"): stand-ins for user-defined pieces while the character map runs.
_STAND_INS = [chr(c) for c in range(0xFDD0, 0xFDF0)]


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def _fields(buf: memoryview) -> Iterator[tuple[int, Any]]:
    """(field number, value) of one protobuf message: an int (varint), bytes (length-delimited) or raw 4/8 bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = bytes(buf[i : i + n]), i + n
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"wire type {wire} of field {number} is not used by SentencePiece")
        if i > len(buf):
            raise ValueError(f"field {number} runs past the end")
        yield number, value


def _read_model(data: bytes) -> dict:
    """The parts of a SentencePiece ModelProto a conversion needs (field numbers of sentencepiece_model.proto)."""
    pieces: list[tuple[str, float, int]] = []
    trainer: dict[int, Any] = {}
    normalizer: dict[int, Any] = {}
    denormalizer: dict[int, Any] = {}
    for number, value in _fields(memoryview(data)):
        if number == 1:
            piece, score, kind = "", 0.0, _NORMAL
            for n, v in _fields(value):
                if n == 1:
                    piece = bytes(v).decode("utf-8")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    kind = v
            pieces.append((piece, score, kind))
        elif number in (2, 3, 5):
            table = {2: trainer, 3: normalizer, 5: denormalizer}[number]
            table.update((n, v) for n, v in _fields(value))
    return {"pieces": pieces, "trainer": trainer, "normalizer": normalizer, "denormalizer": denormalizer}


def sentencepiece_to_hf(data: bytes, where: str = "tokenizer") -> Any:
    """A `tokenizers.Tokenizer` that encodes and decodes like the SentencePiece BPE model `data` (.model bytes).

    ValueError naming `where` for a model this conversion does not reproduce exactly (a unigram model, whitespace
    as suffix, a denormalizer, more than 32 user-defined pieces) or bytes that are not a SentencePiece model.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    try:
        model = _read_model(data)
    except (ValueError, UnicodeDecodeError, struct.error) as exc:
        raise ValueError(f"{where}: not a SentencePiece model ({exc})") from None
    trainer, norm = model["trainer"], model["normalizer"]
    pieces: list[tuple[str, float, int]] = model["pieces"]
    model_type = trainer.get(3, 1)  # UNIGRAM is the proto default
    if model_type != _BPE:
        raise ValueError(f"{where}: SentencePiece model_type {model_type} is not BPE (2); only BPE models convert")
    if trainer.get(24):
        raise ValueError(f"{where}: treat_whitespace_as_suffix is set; only prefix whitespace converts")
    if model["denormalizer"].get(2):
        raise ValueError(f"{where}: has a denormalizer character map, which tokenizer.json cannot express")
    if not pieces:
        raise ValueError(f"{where}: SentencePiece model has no pieces")
    user_defined = [p for p, _, kind in pieces if kind == _USER_DEFINED]
    if len(user_defined) > len(_STAND_INS):
        raise ValueError(f"{where}: {len(user_defined)} user-defined pieces; at most {len(_STAND_INS)} convert")
    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    # SentencePiece merges the adjacent pair whose joined piece scores highest (ties: leftmost); a merge list ranked
    # by the joined piece's score, then id, applies them in that order. Only normal pieces are ever merged.
    normal = {p: (score, i) for i, (p, score, kind) in enumerate(pieces) if kind == _NORMAL}
    ranked = sorted(
        (-score, i, p[:k], p[k:])
        for p, (score, i) in normal.items()
        for k in range(1, len(p))
        if p[:k] in normal and p[k:] in normal
    )
    unk = next((p for p, _, kind in pieces if kind == _UNKNOWN), None)
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=[(left, right) for _, _, left, right in ranked],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=bool(trainer.get(35, 0)),
        )
    )

    add_dummy_prefix, remove_extra, escape = (bool(norm.get(n, 1)) for n in (3, 4, 5))
    charsmap = bytes(norm.get(2, b""))
    # Longest first: SentencePiece's prefix matcher takes the longest user-defined piece at each position.
    swaps = list(zip(sorted(user_defined, key=len, reverse=True), _STAND_INS))
    steps: list = [normalizers.Replace(piece, stand_in) for piece, stand_in in swaps]
    if charsmap:
        steps.append(normalizers.Precompiled(charsmap))
    if remove_extra:
        # Only spaces count: a user-defined "\n" is no whitespace to SentencePiece, so spaces around it stay.
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    space = "▁" if escape else " "
    if escape:
        steps.append(normalizers.Replace(" ", "▁"))
    if add_dummy_prefix:
        steps.append(normalizers.Prepend(space))  # not on an empty text: SentencePiece gives no ids for one
    steps += [normalizers.Replace(stand_in, piece) for piece, stand_in in swaps]
    tok.normalizer = normalizers.Sequence(steps)
    if user_defined:
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")

    steps = [decoders.Replace("▁", " ")] if escape else []
    steps += [decoders.ByteFallback(), decoders.Fuse()]
    if add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(
        [AddedToken(p, special=True, normalized=False) for p, _, kind in pieces if kind in (_CONTROL, _UNKNOWN)]
    )
    return tok


def _special(tokenizer, role: str) -> tuple[str | None, int | None]:
    """(piece, id) of the tokenizer's bos/eos/pad/unk, (None, None) when it has none."""
    i = getattr(tokenizer, f"{role}_id")
    return (tokenizer.id_to_piece(i), i) if 0 <= i < tokenizer.vocab_size else (None, None)


def tokenizer_files(tokenizer, model_max_length: int) -> dict[str, bytes]:
    """The export's tokenizer files (file name -> bytes) for a loaded scaletrain.data.tokenizer.Tokenizer.

    `model_max_length`: the model's context (model.seq_len), the longest input `generate` may reach.
    ValueError (one line naming the tokenizer file) when a SentencePiece model does not convert.
    """
    data = tokenizer.path.read_bytes()
    if tokenizer.kind == "json":
        tok_json = data
    else:
        tok_json = (sentencepiece_to_hf(data, str(tokenizer.path)).to_str() + "\n").encode()
    roles = {role: _special(tokenizer, role) for role in ("bos", "eos", "pad", "unk")}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        # Decoding must give back the text, not "cleaned" spacing around punctuation (transformers 4.x's default).
        "clean_up_tokenization_spaces": False,
        # Training samples start wherever the token stream is cut, with no bos: neither is added to inputs.
        "add_bos_token": False,
        "add_eos_token": False,
    }
    config.update({f"{role}_token": piece for role, (piece, _) in roles.items() if piece is not None})
    # No max_length: transformers warns on every generate(max_new_tokens=...) when one is set, and the context is
    # already config.json's (n_positions / max_position_embeddings) and model_max_length above.
    generation: dict[str, Any] = {}
    generation.update({f"{role}_token_id": i for role, (_, i) in roles.items() if i is not None and role != "unk"})
    if "pad_token_id" not in generation and "eos_token_id" in generation:
        generation["pad_token_id"] = generation["eos_token_id"]  # what generate() would pick, without its warning
    return {
        "tokenizer.json": tok_json,
        "tokenizer_config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
        "generation_config.json": (json.dumps(generation, indent=2, sort_keys=True) + "\n").encode(),
    }
