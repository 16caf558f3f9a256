"""Training tokens/s of scaletrain's GPT vs Hugging Face `transformers` GPT-2 of identical shape, on CPU.

Same batch, optimizer (AdamW, gpt3 constants), threads, dtype and loss code for both; the two models are timed
in alternating rounds in one process so machine noise hits both alike. Also reports the data loader's
tokens/s alone (batches of the same shape from the default corpus, or the packaged excerpt).

    python benchmarks/cpu_throughput.py [--preset gpt3-proxy] [--steps 12] [--rounds 3] [--threads 2]

Prints a table and writes benchmarks/results/cpu_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from scaletrain.config import resolve
from scaletrain.model.gpt import GPT
from scaletrain.model.loss import loss_sum
from scaletrain.train.cpu_bf16 import bf16_gemm_context, gemm_mode
from scaletrain.train.host import setup_cpu
from scaletrain.train.optim import build_optimizer


def hf_gpt2(cfg):
    """transformers GPT2LMHeadModel with the gpt3 architecture at cfg's shape (tied head, gelu_new, no dropout)."""
    from scaletrain.model.fp8 import _quiet_import

    with _quiet_import():  # transformers imports torchao, whose CPU-build log lines say nothing to act on
        from transformers import GPT2Config, GPT2LMHeadModel
    hf_cfg = GPT2Config(vocab_size=cfg.padded_vocab, n_positions=cfg.seq_len, n_embd=cfg.d_model,
                        n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.ffn_size,
                        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        layer_norm_epsilon=cfg.ln_eps, initializer_range=cfg.init_std, tie_word_embeddings=True,
                        use_cache=False, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    hf_cfg._attn_implementation = "sdpa"  # the fast path transformers picks on GPU too
    return GPT2LMHeadModel(hf_cfg).to(torch.float32)


def time_steps(model, forward, optim_cfg, x, y, dtype: str, steps: int) -> float:
    """Median seconds per optimizer step (forward, fp32 loss, backward, AdamW) after 2 warm-up steps."""
    opt = build_optimizer(model.parameters(), optim_cfg, "cpu")
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        # Both models get what a scaletrain run gets on this CPU: bf16 GEMMs as fp32 arithmetic where it has none.
        with bf16_gemm_context(torch.device("cpu"), dtype):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                logits = forward(model, x)
            loss = loss_sum(logits, y) / y.numel()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loader_tokens_per_s(cfg, batch: int) -> tuple[float, str]:
    """Tokens/s of fetching training batches alone, from the default corpus or the packaged excerpt."""
    from scaletrain.config import default_data_dir
    from scaletrain.data.corpus import default_paths, prepare_excerpt
    from scaletrain.data.prepare import load_dataset
    from scaletrain.data.samples import TrainSamples, measure_loader_tokens_per_s
    corpus = default_paths(default_data_dir(cfg.data))
    source = "default corpus"
    if not corpus.exists():
        corpus = prepare_excerpt(Path(tempfile.mkdtemp()) / "excerpt", 1024)
        source = "packaged excerpt"
    samples = TrainSamples(load_dataset(str(corpus.train_prefix), None, None), cfg.model.seq_len, 1234)
    return measure_loader_tokens_per_s(samples, batch, 2.0), source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt3-proxy")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round and model")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (median over rounds)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_throughput.json"))
    args = ap.parse_args()

    setup_cpu(args.threads)  # process-wide, so both models get the same threads, flush-to-zero and allocator
    cfg = resolve(args.preset)
    m, b = cfg.model, cfg.train.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, m.vocab_size, (b, m.seq_len), generator=gen)
    y = torch.randint(0, m.vocab_size, (b, m.seq_len), generator=gen)
    tokens = b * m.seq_len
    rows = []
    for dtype in args.dtypes.split(","):
        torch.manual_seed(0)
        ours, theirs = GPT(m), hf_gpt2(m)
        t_ours, t_hf = [], []
        for _ in range(args.rounds):
            t_ours.append(time_steps(ours, lambda mod, inp: mod(inp), cfg.optim, x, y, dtype, args.steps))
            t_hf.append(time_steps(theirs, lambda mod, inp: mod(input_ids=inp).logits, cfg.optim, x, y, dtype,
                                   args.steps))
        ours_tps, hf_tps = tokens / statistics.median(t_ours), tokens / statistics.median(t_hf)
        rows.append({"dtype": dtype, "scaletrain_tokens_per_s": ours_tps, "hf_gpt2_tokens_per_s": hf_tps,
                     "ratio": ours_tps / hf_tps})
    loader_tps, source = loader_tokens_per_s(cfg, b)

    shape = f"{m.n_layers}L d{m.d_model} {m.n_heads}h seq{m.seq_len} vocab{m.padded_vocab} batch {b}"
    print(f"CPU training throughput, {args.preset} ({shape}), {args.threads} threads, AdamW, bf16 GEMMs {gemm_mode()}")
    print(f"{'dtype':6s} {'scaletrain tok/s':>17s} {'HF GPT-2 tok/s':>15s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['dtype']:6s} {r['scaletrain_tokens_per_s']:17,.0f} {r['hf_gpt2_tokens_per_s']:15,.0f} "
              f"{r['ratio']:7.2f}")
    print(f"data loader alone ({source}): {loader_tps:,.0f} tokens/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "shape": shape, "threads": args.threads, "bf16_gemm": gemm_mode(),
                               "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                               "rows": rows, "loader_tokens_per_s": loader_tps, "loader_source": source},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
