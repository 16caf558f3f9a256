"""Supervised fine-tuning data: (input, output) pairs, packed, loss only on the output (MLPerf llama2_70b_lora).

MLPerf's LoRA benchmark fine-tunes on SCROLLS GovReport (report -> summary), packs examples to the sequence
length and trains only on summary tokens. This module does the same for any JSONL or parquet file of pairs.

Prepared form (PREFIX.bin/.idx/.meta.json): a plain Megatron MMIDIDX dataset, one document per example,

    input ids, EOS, output ids, EOS

The tokenizer never emits EOS for text, so the first EOS marks where the output starts: no second array is
needed, Megatron's tools can read the file, and load_dataset's checks (sidecar, tokenizer sha256, id range)
apply as to pretraining data. The sidecar adds "format": "sft" and "eos_id".

Packing happens when the data is opened, for the model's seq_len, so one prepared set serves any length:
next-fit in stored order (an example that does not fit closes the sequence; the rest is padding). In-order
packing means an earlier example in a sequence never holds a later example's answer. Attention is NOT reset
between packed examples (NeMo's default for this benchmark): later examples see earlier ones as context.
An example longer than seq_len is truncated from the input side: the input's end is dropped (NeMo's default
truncation_method="right"); only when the output alone does not fit is the output cut too, keeping its EOS.

Labels are next tokens where the next token is an output token or the final EOS; every other position
(targets in the input or the separator, padding, the next example's input) is IGNORE_INDEX.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from scaletrain.model.loss import IGNORE_INDEX

from .documents import json_lines
from .indexed import DataError, IndexedDatasetWriter, best_dtype
from .prepare import load_dataset, meta_path, read_meta
from .samples import PAD_TOKEN, TrainSamples, ValidSamples
from .sft_paths import resolve_paths
from .tokenizer import Tokenizer

# Field names tried in order when none is given: the generic pair, then GovReport's own (SCROLLS uses input/output).
INPUT_FIELDS = ("input", "report")
OUTPUT_FIELDS = ("output", "summary")
ENCODE_CHUNK = 1024


def _pick(obj: dict, given: str | None, aliases: Sequence[str]) -> str | None:
    if given:
        return given if given in obj else None
    return next((a for a in aliases if a in obj), None)


def _pair(where: str, obj, fin: str | None, fout: str | None) -> tuple[str, str]:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object")
    a, b = _pick(obj, fin, INPUT_FIELDS), _pick(obj, fout, OUTPUT_FIELDS)
    if a is None or b is None or not isinstance(obj[a], str) or not isinstance(obj[b], str):
        want = f"{fin or '/'.join(INPUT_FIELDS)!r} and {fout or '/'.join(OUTPUT_FIELDS)!r}"
        raise DataError(f"{where}: expected string fields {want}")
    return obj[a], obj[b]


def _parquet_pairs(path: Path, fin: str | None, fout: str | None) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow; `pip install pyarrow` or convert to JSONL") from None
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        cols = [_pick(dict.fromkeys(names), f, al) for f, al in ((fin, INPUT_FIELDS), (fout, OUTPUT_FIELDS))]
        if None in cols:
            raise DataError(f"{path}: no input/output columns among {names[:8]}")
        row = 0
        for batch in pf.iter_batches(columns=cols, batch_size=ENCODE_CHUNK):
            for obj in batch.to_pylist():
                yield _pair(f"{path}: row {row}", obj, cols[0], cols[1])
                row += 1
    except DataError:
        raise
    except (OSError, ValueError, TypeError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: cannot read parquet: {exc}") from None


def read_pairs(
    paths: Iterable[str | Path], input_field: str | None = None, output_field: str | None = None
) -> Iterator[tuple[str, str]]:
    """(input, output) strings from JSONL (.jsonl/.json/.ndjson, optionally .gz) or .parquet files, in order.

    Without explicit field names each record uses "input"/"output", else "report"/"summary".
    """
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        if path.name.lower().endswith(".parquet"):
            yield from _parquet_pairs(path, input_field, output_field)
            continue
        opener = gzip.open if path.name.lower().endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                for lineno, obj in json_lines(path, f):
                    yield _pair(f"{path}:{lineno}", obj, input_field, output_field)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: cannot read: {exc}") from None


def prepare_sft(
    inputs: Sequence[str | Path],
    out_prefix: str | Path,
    tokenizer: Tokenizer | str | Path,
    input_field: str | None = None,
    output_field: str | None = None,
) -> dict:
    """Tokenize pairs from `inputs` into OUT_PREFIX.bin/.idx (layout in the module docstring) plus its sidecar."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    eos = tok.eos_id
    if eos < 0:
        raise DataError(f"{tok.path}: tokenizer has no end-of-sequence id, which SFT examples need")
    mfile = meta_path(out_prefix)
    if mfile.exists():  # a sidecar from an earlier build must not vouch for the files about to be replaced
        mfile.unlink()
    counts = {"input_tokens": 0, "output_tokens": 0}
    chunk: list[tuple[str, str]] = []

    def flush(w: IndexedDatasetWriter) -> None:
        ins = tok.encode_batch([a for a, _ in chunk])
        outs = tok.encode_batch([b for _, b in chunk])
        for a, b in zip(ins, outs):
            if eos in a or eos in b:  # would make the input/output boundary ambiguous
                raise DataError(f"{out_prefix}: example {w.num_documents} encodes to the EOS id {eos}")
            w.add_document(np.asarray(a + [eos] + b + [eos], dtype=np.int64))
            counts["input_tokens"] += len(a)
            counts["output_tokens"] += len(b)
        chunk.clear()

    with IndexedDatasetWriter(out_prefix, best_dtype(tok.vocab_size)) as w:
        for pair in read_pairs(inputs, input_field, output_field):
            chunk.append(pair)
            if len(chunk) >= ENCODE_CHUNK:
                flush(w)
        if chunk:
            flush(w)
        if w.num_documents == 0:
            raise DataError(f"{inputs[0] if inputs else out_prefix}: no examples found")
        n = w.num_documents
    meta = {
        "format": "sft",
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "eos_id": eos,
        "num_documents": n,
        "num_tokens": counts["input_tokens"] + counts["output_tokens"] + 2 * n,
        **counts,
        "sources": [str(p) for p in inputs],
    }
    tmp = mfile.with_name(f".{mfile.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, mfile)
    return meta


class SFTData:
    """An opened, checked SFT dataset: per-example input/output lengths, and their packing for a seq_len."""

    def __init__(self, prefix: str | Path, tokenizer: Tokenizer | None = None, vocab_size: int | None = None):
        self.ds = load_dataset(prefix, tokenizer, vocab_size)
        self.name = str(self.ds.bin_file)
        meta = read_meta(prefix)
        if meta is None or meta.get("format") != "sft" or not isinstance(meta.get("eos_id"), int):
            raise DataError(
                f'{meta_path(prefix)}: not an SFT dataset (no sidecar with "format": "sft"); '
                f"prepare it with scaletrain.data.sft.prepare_sft"
            )
        self.eos = meta["eos_id"]
        if len(self.ds) == 0:
            raise DataError(f"{self.ds.bin_file}: no examples")
        if tokenizer is not None and tokenizer.eos_id != self.eos:
            raise DataError(f"{meta_path(prefix)}: eos_id {self.eos} != tokenizer's {tokenizer.eos_id}")
        starts, ends = self.ds.doc_offsets[:-1], self.ds.doc_offsets[1:]
        pos = np.flatnonzero(np.asarray(self.ds.tokens) == self.eos)
        per_doc = np.diff(np.searchsorted(pos, self.ds.doc_offsets))
        ok = per_doc == 2
        if ok.all():
            seps, last = pos[0::2], pos[1::2]
            ok = last == ends - 1
        if not ok.all():
            k = int(np.argmin(ok))
            raise DataError(
                f"{self.ds.bin_file}: document {k} is not an SFT example "
                f"(expected input, EOS, output, EOS; found {int(per_doc[k])} EOS)"
            )
        self.starts = starts.astype(np.int64)
        self.input_len = (seps - starts).astype(np.int64)
        self.output_len = (ends - seps - 2).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts.size)

    def pack(self, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keep_in, keep_out, bounds): tokens kept per example and sequence j = examples [bounds[j], bounds[j+1])."""
        if seq_len < 4:
            raise ValueError(f"seq_len={seq_len}: SFT packing needs >= 4 (an input, EOS, an output, EOS)")
        keep_in = np.minimum(self.input_len, np.maximum(0, seq_len - 2 - self.output_len))
        keep_out = np.minimum(self.output_len, seq_len - 2 - keep_in)
        bounds, fill = [0], 0
        for k, n in enumerate((keep_in + keep_out + 2).tolist()):
            if fill + n > seq_len:
                bounds.append(k)
                fill = 0
            fill += n
        bounds.append(len(self))
        return keep_in, keep_out, np.asarray(bounds, dtype=np.int64)


class _Packed:
    """Builds packed rows of an SFTData on demand (no [n, seq_len] copy of the set is held)."""

    def _setup(self, data, seq_len: int) -> None:
        self.data = data if isinstance(data, SFTData) else SFTData(data)
        self.name, self.seq_len = self.data.name, int(seq_len)
        self.keep_in, self.keep_out, self.bounds = self.data.pack(self.seq_len)
        self.num_packed = int(self.bounds.size - 1)
        self.num_label_tokens = int((self.keep_out + 1).sum())
        self.num_tokens = int((self.keep_in + self.keep_out + 2).sum())
        self.num_examples = len(self.data)

    def rows(self, seq_ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), int64 [len(seq_ids), seq_len], of packed sequences seq_ids."""
        seq_ids = [int(j) for j in seq_ids]
        S, d, eos = self.seq_len, self.data, self.data.eos
        inputs = np.full((len(seq_ids), S), PAD_TOKEN, dtype=np.int64)
        labels = np.full((len(seq_ids), S), IGNORE_INDEX, dtype=np.int64)
        tokens = d.ds.tokens
        for r, j in enumerate(seq_ids):
            p = 0
            for k in range(int(self.bounds[j]), int(self.bounds[j + 1])):
                s, ki, ko = int(d.starts[k]), int(self.keep_in[k]), int(self.keep_out[k])
                sep = s + int(d.input_len[k])
                inputs[r, p : p + ki] = tokens[s : s + ki]
                inputs[r, p + ki] = eos
                inputs[r, p + ki + 1 : p + ki + 1 + ko] = tokens[sep + 1 : sep + 1 + ko]
                inputs[r, p + ki + 1 + ko] = eos
                # Positions from the separator to the last output token predict output tokens and the final EOS.
                labels[r, p + ki : p + ki + ko + 1] = inputs[r, p + ki + 1 : p + ki + ko + 2]
                p += ki + ko + 2
        return torch.from_numpy(inputs), torch.from_numpy(labels)


class SFTSamples(_Packed, TrainSamples):
    """TrainSamples over packed SFT sequences: same seeded per-epoch shuffle, consumed offset and dp slicing.

    `data` is a prefix or an opened SFTData; a sample is one packed sequence.
    """

    def __init__(self, data, seq_len: int, seed: int) -> None:
        if seed < 0:
            raise ValueError(f"seed={seed}: must be >= 0")
        self._setup(data, seq_len)
        self.seed, self.num_samples, self._perms = int(seed), self.num_packed, {}

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of global positions [start, start+count), as TrainSamples.batch."""
        return self.rows(self.sample_ids(start, count))


class SFTValid(_Packed, ValidSamples):
    """ValidSamples over packed SFT sequences: the whole set each time; num_label_tokens counts output tokens only."""

    def __init__(self, data, seq_len: int) -> None:
        self._setup(data, seq_len)
        self.num_sequences = self.num_packed

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of packed sequences [start, start+count), clipped to the set."""
        stop = min(start + count, self.num_sequences)
        if start < 0 or start >= stop:
            raise ValueError(f"start={start}, count={count}: outside [0, {self.num_sequences})")
        return self.rows(range(start, stop))


def prepared_sha256(prefix: str | Path) -> str:
    """sha256 over PREFIX.bin then PREFIX.idx: pins a prepared set (tests, stamps)."""
    h = hashlib.sha256()
    for ext in (".bin", ".idx"):
        h.update(Path(f"{prefix}{ext}").read_bytes())
    return h.hexdigest()


def open_sft_datasets(data_cfg, vocab_size: int, seq_len: int, seed: int) -> tuple[SFTSamples, SFTValid]:
    """Train/valid samples for a config.DataConfig with format="sft"; empty prefixes mean the KJV proxy set."""
    train, valid, tok_path = resolve_paths(data_cfg)
    tok = Tokenizer(tok_path) if tok_path is not None else None
    return (
        SFTSamples(SFTData(train, tok, vocab_size), seq_len, seed),
        SFTValid(SFTData(valid, tok, vocab_size), seq_len),
    )
