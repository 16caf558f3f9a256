"""Expert parallelism trains exactly like one process (fp32, gloo): EP2, EP4, EP x FSDP, EP x PP, EP x HSDP, EP x TP
(sequence-parallel routing, with and without FSDP), EP under full activation checkpointing (all-to-alls recomputed in backward) and EP resumed from a checkpoint, on a
tiny DeepSeek-V3 (MLA, group-limited sigmoid routing, a shared expert, a dense first layer, aux loss and bias updates)
and a tiny GPT-OSS (softmax routing, expert biases, clamped SwiGLU), including a router forced onto few experts
(every token on one EP rank, the other ranks' experts empty).

Launches are shared: one 2-rank and one 4-rank process group each run several layouts in turn (the trainer
reuses an initialised process group), against one-process references computed in the test process.
"""

from __future__ import annotations

import pytest
from launch import run_ranks

STEPS = 5
TOL = 1e-5

MODELS = {
    "deepseek_v3": (
        "deepseek-v3-671b",
        [
            "model.n_layers=3",
            "model.d_model=32",
            "model.n_heads=4",
            "model.d_ff=48",
            "model.moe.n_experts=8",
            "model.moe.n_groups=4",
            "model.moe.topk_groups=2",
            "model.moe.top_k=2",
            "model.moe.d_ff_expert=16",
            "model.moe.first_dense=1",
            "model.mla.q_lora_rank=24",
            "model.mla.kv_lora_rank=16",
            "model.mla.qk_nope_head_dim=8",
            "model.mla.qk_rope_head_dim=4",
            "model.mla.v_head_dim=8",
            "model.moe.aux_loss_coef=0.01",
            "model.moe.bias_update_rate=0.01",
        ],
    ),
    "gpt_oss": (
        "gpt-oss-20b",
        [
            "model.n_layers=2",
            "model.d_model=32",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.head_dim=12",
            "model.moe.n_experts=4",
            "model.moe.top_k=2",
            "model.moe.d_ff_expert=16",
            "model.sliding_window=4",
            "model.moe.aux_loss_coef=0.01",
        ],
    ),
}
# Forced routing: expert_bias +1e3 on these experts after init (selection only), so every token picks them.
FORCED = {"deepseek_v3": [0, 1], "gpt_oss": [0]}  # DeepSeek-V3: experts 0, 1 are both on EP rank 0


def _overrides(corpus_paths, model, forced, extra):
    train, valid, tok = corpus_paths
    _, arch = MODELS[model]
    top_k = ["model.moe.top_k=1", "model.moe.bias_update_rate=0"] if forced and model == "gpt_oss" else []
    fixed = ["model.moe.bias_update_rate=0"] if forced else []
    return [
        f"data.train_prefix={train}",
        f"data.valid_prefix={valid}",
        f"data.tokenizer={tok}",
        *arch,
        "model.vocab_size=1024",
        "model.seq_len=16",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
        "train.dtype=fp32",
        "train.threads=1",
        "optim.lr=2e-3",
        "optim.warmup_samples=32",
        "optim.decay_samples=3200",
        "train.progress=false",
        "optim.grad_clip=1.0",
        *top_k,
        *fixed,
        *extra,
    ]


def train(rank, world_size, corpus_paths, run_dir, model, forced, extra, resume_at=0):
    """STEPS steps of a tiny MoE model under the layout in `extra`; the per-step records and expert biases.

    `resume_at` > 0: save a checkpoint after that many steps and finish the run in a new trainer resumed from it.
    """
    from scaletrain.config import resolve
    from scaletrain.model.moe import moe_layers
    from scaletrain.train.engine import Trainer

    preset = MODELS[model][0]
    overrides = _overrides(corpus_paths, model, forced, extra) + [f"train.run_dir={run_dir}"]
    trainer = Trainer(resolve(preset, overrides=overrides), run_dir)
    trainer.init()
    if forced:
        for part in trainer.pm.parts:
            for moe in moe_layers(part):
                moe.router.expert_bias[FORCED[model]] = 1e3
    out = [trainer.train_step() for _ in range(resume_at or STEPS)]
    if resume_at:
        path = trainer.save_checkpoint({})
        trainer.finish({})
        trainer = Trainer(resolve(preset, overrides=[*overrides, f"checkpoint.resume={path}"]), f"{run_dir}/b")
        trainer.init()
        out += [trainer.train_step() for _ in range(STEPS - resume_at)]
    trainer.finish({})
    bias = {i: m.router.expert_bias.tolist() for i, m in trainer.moe.layers}  # this rank's layers (a PP stage's)
    return {"records": out, "layout": trainer.layout.describe(), "bias": bias}


def run_all(rank, world_size, corpus_paths, run_dir, cases):
    return {name: train(rank, world_size, corpus_paths, f"{run_dir}/{name}", *case) for name, case in cases.items()}


@pytest.fixture(scope="module")
def corpus_paths(excerpt_corpus):
    return (str(excerpt_corpus.train_prefix), str(excerpt_corpus.valid_prefix), str(excerpt_corpus.tokenizer))


@pytest.fixture(scope="module")
def references(corpus_paths, tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    return {(m, f): train(0, 1, corpus_paths, str(d / f"{m}{f}"), m, f, []) for m in MODELS for f in (False, True)}


CASES_2 = {
    "dsv3_ep2": ("deepseek_v3", False, ["parallel.ep=2"]),
    "gptoss_ep2_forced": ("gpt_oss", True, ["parallel.ep=2"]),
    "dsv3_ep2_full_ac": ("deepseek_v3", False, ["parallel.ep=2", "parallel.activation_checkpoint=full"]),
    "dsv3_ep2_resumed": ("deepseek_v3", False, ["parallel.ep=2"], 2),  # a distributed checkpoint of EP shards
    "gptoss_tp2_ep2_forced": ("gpt_oss", True, ["parallel.tp=2", "parallel.ep=2"]),  # sinks split by head
}
CASES_4 = {
    "dsv3_ep4": ("deepseek_v3", False, ["parallel.ep=4"]),
    "dsv3_ep4_forced": ("deepseek_v3", True, ["parallel.ep=4"]),
    "gptoss_ep2_fsdp2": ("gpt_oss", False, ["parallel.ep=2"]),
    "gptoss_ep2_pp2": ("gpt_oss", False, ["parallel.ep=2", "parallel.pp=2"]),
    "gptoss_ep2_hsdp": ("gpt_oss", False, ["parallel.ep=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "gptoss_fsdp2_tp2_ep2": ("gpt_oss", False, ["parallel.tp=2", "parallel.ep=2"]),  # experts FSDP over 2 too
}


def _compare(name, ref, got):
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max"):
        a, b = [r[key] for r in ref["records"]], [r[key] for r in got["records"]]
        diffs = [abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b)]
        assert max(diffs) < TOL, f"{name} ({got['layout']}): {key} {b} vs one process {a}"
    assert got["bias"] and set(got["bias"]) <= set(ref["bias"])
    for i, bias in got["bias"].items():
        assert bias == pytest.approx(ref["bias"][i], abs=1e-7), f"{name}: layer {i}'s expert biases differ"


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["2ranks", "4ranks"])
def test_expert_parallel_matches_one_process(world, cases, corpus_paths, references, tmp_path):
    for ref in references.values():
        assert ref["records"][-1]["loss"] < ref["records"][0]["loss"]  # it trains at all
        assert ref["records"][0]["moe_aux_loss"] > 0
    forced = references[("gpt_oss", True)]["records"][0]
    assert forced["moe_tokens_per_expert_min"] == 0  # the forced router really leaves experts empty
    results = run_ranks(run_all, world, corpus_paths, str(tmp_path), cases, timeout=240)
    for rank_result in results:
        for name, (model, forced, *_) in cases.items():
            got = rank_result[name]
            assert f"ep{'4' if 'ep4' in name else '2'}" in got["layout"]
            _compare(name, references[(model, forced)], got)
