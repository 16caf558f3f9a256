"""The Llama model trains exactly like one process under FSDP, TP+SP, 1F1B PP, CP (2 gloo ranks) and PPxCP (4), fp32.

Same harness as test_layouts.py, on a tiny GQA Llama 3.1 (2 layers, d 64, 4 heads, 2 KV heads; rotary base
500,000 with the "llama3" frequency scaling from an original context of 8 tokens, so at 32 tokens every band of
the scaling is in play) for 10 steps: each layout exercises one Llama-specific seam (untied head on FSDP's root,
KV-group qkv and interleaved SwiGLU rows under TP, RMSNorm under SP, an untied last stage, scaled rotary
positions from the context-parallel core). Llama 2 differs only in its rotary frequencies, which the unit and
Hugging Face tests cover (tests/unit/test_llama.py), so its layouts are not run twice.
"""

from __future__ import annotations

import pytest
from launch import run_ranks

STEPS = 10
TOL = 1e-5


def _overrides(corpus_paths, extra):
    train, valid, tok = corpus_paths
    return [
        f"data.train_prefix={train}",
        f"data.valid_prefix={valid}",
        f"data.tokenizer={tok}",
        "model.arch=llama31",
        "model.rope_original_seq_len=8",
        "model.vocab_size=1024",
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.d_ff=128",
        "model.seq_len=32",
        "train.global_batch_size=16",
        "train.micro_batch_size=4",
        "train.dtype=fp32",
        "train.threads=1",
        "optim.lr=2e-3",
        "optim.warmup_samples=64",
        "optim.decay_samples=3200",
        "train.progress=false",
        "optim.grad_clip=0.05",
        *extra,
    ]


def train_losses(rank, world_size, corpus_paths, extra, run_dir, steps=STEPS):
    """Run `steps` steps (+ one evaluation) of the tiny Llama under the layout in `extra`."""
    from scaletrain.config import resolve
    from scaletrain.train.engine import Trainer

    cfg = resolve("llama-proxy", overrides=_overrides(corpus_paths, extra) + [f"train.run_dir={run_dir}"])
    trainer = Trainer(cfg, run_dir)
    trainer.init()
    out = [trainer.train_step() for _ in range(steps)]
    eval_loss = trainer.evaluate()
    trainer.finish({})
    return {
        "losses": [r["loss"] for r in out],
        "grad_norms": [r["grad_norm"] for r in out],
        "eval": eval_loss,
        "layout": trainer.layout.describe(),
    }


@pytest.fixture(scope="module")
def corpus_paths(excerpt_corpus):
    return (str(excerpt_corpus.train_prefix), str(excerpt_corpus.valid_prefix), str(excerpt_corpus.tokenizer))


@pytest.fixture(scope="module")
def reference(corpus_paths, tmp_path_factory):
    return train_losses(0, 1, corpus_paths, [], str(tmp_path_factory.mktemp("ref")))


LAYOUTS = {
    "fsdp": ["parallel.dp_shard=2"],
    "tp_sp": ["parallel.tp=2"],
    "pp_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "cp": ["parallel.cp=2"],
}
# The one 4-rank layout: the second pipeline stage has no embedding, so its rotary positions come only from the
# context-parallel attention core (the zigzag ones); per-chunk arange positions there change the loss by ~6e-5
# at init (measured on this config), well above TOL.
LAYOUTS_4 = {"pp_cp": ["parallel.pp=2", "parallel.cp=2"]}


@pytest.mark.parametrize("name", list(LAYOUTS) + list(LAYOUTS_4))
def test_llama_layout_matches_single_process(name, corpus_paths, reference, tmp_path):
    assert reference["losses"][-1] < reference["losses"][0]  # it trains at all
    world, extra = (2, LAYOUTS[name]) if name in LAYOUTS else (4, LAYOUTS_4[name])
    for got in run_ranks(train_losses, world, corpus_paths, extra, str(tmp_path), timeout=240):
        diffs = [abs(a - b) for a, b in zip(reference["losses"], got["losses"])]
        assert max(diffs) < TOL, f"{name} ({got['layout']}): losses {got['losses']} vs {reference['losses']}"
        norms = [abs(a - b) / max(1.0, a) for a, b in zip(reference["grad_norms"], got["grad_norms"])]
        assert max(norms) < TOL, f"{name}: grad norms {got['grad_norms']} vs {reference['grad_norms']}"
        assert abs(reference["eval"] - got["eval"]) < TOL, f"{name}: eval {got['eval']} vs {reference['eval']}"


def test_uneven_interleaved_pipeline_matches_single_process(corpus_paths, tmp_path):
    # 6 blocks in pp2 x vp2 = 4 stages do not split evenly; Megatron's embedding/loss accounting (as NVIDIA's
    # llama31_405b layout, 126 blocks in 64 stages) gives the stages 1, 2, 2 and 1 blocks.
    six = ["model.n_layers=6"]
    reference = train_losses(0, 1, corpus_paths, six, str(tmp_path / "ref"))
    layout = [*six, "parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=interleaved_1f1b"]
    for got in run_ranks(train_losses, 2, corpus_paths, layout, str(tmp_path / "pp"), timeout=240):
        diffs = [abs(a - b) for a, b in zip(reference["losses"], got["losses"])]
        assert max(diffs) < TOL, f"uneven pp ({got['layout']}): losses {got['losses']} vs {reference['losses']}"
        assert abs(reference["eval"] - got["eval"]) < TOL


def test_qwen3_tensor_parallel_matches_single_process(corpus_paths, tmp_path):
    # Qwen3's QK-norm under TP+SP: each rank normalises its own heads with the one replicated weight, whose
    # gradient must be summed over the ranks (a head size of its own, so attention is wider than d_model).
    qwen3 = ["model.arch=qwen3", "model.head_dim=32"]
    ref = train_losses(0, 1, corpus_paths, qwen3, str(tmp_path / "ref"))
    for got in run_ranks(train_losses, 2, corpus_paths, qwen3 + ["parallel.tp=2"], str(tmp_path), timeout=240):
        diffs = [abs(a - b) for a, b in zip(ref["losses"], got["losses"])]
        assert max(diffs) < TOL, f"qwen3 tp ({got['layout']}): losses {got['losses']} vs {ref['losses']}"
        norms = [abs(a - b) / max(1.0, a) for a, b in zip(ref["grad_norms"], got["grad_norms"])]
        assert max(norms) < TOL, f"qwen3 tp: grad norms {got['grad_norms']} vs {ref['grad_norms']}"
