"""Every parallel layout trains exactly like one process: first 20 losses within 1e-5 in fp32 on gloo ranks.

Same seed, same global batch, same sample order; the init is layout-independent, so any difference is a bug
in how a layout splits the work or combines the gradients. FSDP x TP x PP needs 8 ranks (4 processes per core).
"""

from __future__ import annotations

import pytest
from launch import run_ranks

# 10 steps cover the warm-up (4) and decay; a layout that diverges does so within them (every step compared).
STEPS = 10
TOL = 1e-5


def _overrides(corpus_paths, extra):
    train, valid, tok = corpus_paths
    return [
        f"data.train_prefix={train}",
        f"data.valid_prefix={valid}",
        f"data.tokenizer={tok}",
        "model.vocab_size=1024",
        "model.n_layers=4",
        "model.d_model=64",
        "model.n_heads=4",
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
    """Run `steps` steps (+ one evaluation) of the tiny model under the layout in `extra`; losses per step."""
    from scaletrain.config import resolve
    from scaletrain.train.engine import Trainer

    cfg = resolve("gpt3-proxy", overrides=_overrides(corpus_paths, extra) + [f"train.run_dir={run_dir}"])
    trainer = Trainer(cfg, run_dir)
    with trainer.running():  # times the collective waits (comm_exposed_s), as run_loop does
        trainer.init()
        out = [trainer.train_step() for _ in range(steps)]
        eval_loss = trainer.evaluate()
        trainer.finish({})
    losses = [r["loss"] for r in out]
    norms = [r["grad_norm"] for r in out]
    comm = [r["comm_exposed_s"] for r in out]
    return {
        "losses": losses,
        "grad_norms": norms,
        "eval": eval_loss,
        "layout": trainer.layout.describe(),
        "comm_exposed_s": comm,
        # Block indices of each stage this rank holds, in its stage order (the pipeline split).
        "blocks": [[int(b) for b in part.blocks] for part in trainer.pm.parts],
    }


@pytest.fixture(scope="module")
def corpus_paths(excerpt_corpus):
    return (str(excerpt_corpus.train_prefix), str(excerpt_corpus.valid_prefix), str(excerpt_corpus.tokenizer))


@pytest.fixture(scope="module")
def reference(corpus_paths, tmp_path_factory):
    return train_losses(0, 1, corpus_paths, [], str(tmp_path_factory.mktemp("ref")))


def _compare(ref, got, what):
    bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(ref["losses"], got["losses"])) if abs(a - b) > TOL]
    assert not bad, f"{what} ({got['layout']}): loss differs at (step, single, layout) {bad[:5]}"
    bad = [
        (i + 1, a, b)
        for i, (a, b) in enumerate(zip(ref["grad_norms"], got["grad_norms"]))
        if abs(a - b) > 1e-4 * max(1.0, a)
    ]
    assert not bad, f"{what} ({got['layout']}): grad norm differs at (step, single, layout) {bad[:5]}"
    assert abs(ref["eval"] - got["eval"]) < TOL, f"{what}: eval loss {got['eval']} vs {ref['eval']}"


LAYOUTS_2 = {
    "ddp": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "fsdp": ["parallel.dp_shard=2"],
    # TP without sequence parallelism runs in test_lora_layouts.py (tp_no_sp) and full activation checkpointing in
    # test_fp8_layouts.py (tp2_cp2_full_ac) and tests/e2e/test_activation_checkpoint.py.
    "tp_sp": ["parallel.tp=2"],
    "pp_gpipe": ["parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "pp_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp_interleaved": ["parallel.pp=2", "parallel.pp_virtual=2", "parallel.pp_schedule=interleaved_1f1b"],
    "cp": ["parallel.cp=2"],
}
LAYOUTS_4 = {
    "fsdp_tp": ["parallel.dp_shard=2", "parallel.tp=2"],
    "tp_pp": ["parallel.tp=2", "parallel.pp=2"],
    "hsdp_selective_ac": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.activation_checkpoint=selective"],
    "fsdp_pp_interleaved": [
        "parallel.dp_shard=2",
        "parallel.pp=2",
        "parallel.pp_virtual=2",
        "parallel.pp_schedule=interleaved_1f1b",
    ],
    "cp_tp": ["parallel.cp=2", "parallel.tp=2"],
}


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_rank_layout_matches_single_process(name, corpus_paths, reference, tmp_path):
    results = run_ranks(train_losses, 2, corpus_paths, LAYOUTS_2[name], str(tmp_path), timeout=300)
    for r in results:
        _compare(reference, r, name)
    # Every layout's collectives are timed where they wait, DTensor's functional ones (tp_sp, cp) included; only
    # DDP's gradient all-reduce is waited for inside C++, but its loss all-reduce is seen.
    for rank, r in enumerate(results):
        assert all(c > 0 for c in r["comm_exposed_s"]), (name, rank, r["comm_exposed_s"])


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_four_rank_layout_matches_single_process(name, corpus_paths, reference, tmp_path):
    results = run_ranks(train_losses, 4, corpus_paths, LAYOUTS_4[name], str(tmp_path), timeout=400)
    for r in results:
        _compare(reference, r, name)


# Uneven stages (Megatron's --decoder-first/last-pipeline-num-layers): the 4 blocks as 1 + 3, and interleaved with
# both end stages empty (stage 0 only the embedding, stage 3 only the final norm and the output layer). Rank r holds
# stages r, r + pp (loop placement), so the expected blocks per rank, in stage order, are listed with each case.
LAYOUTS_UNEVEN = {
    "pp_first1": (["parallel.pp=2", "parallel.pp_first_layers=1"], [[[0]], [[1, 2, 3]]]),
    "pp_interleaved_empty_ends": (
        [
            "parallel.pp=2",
            "parallel.pp_virtual=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.pp_stage_layers=[0,2,2,0]",
        ],
        [[[], [2, 3]], [[0, 1], []]],
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS_UNEVEN))
def test_uneven_pipeline_stages_match_single_process(name, corpus_paths, reference, tmp_path):
    extra, blocks = LAYOUTS_UNEVEN[name]
    results = run_ranks(train_losses, 2, corpus_paths, extra, str(tmp_path), timeout=300)
    assert [r["blocks"] for r in results] == blocks
    for r in results:
        _compare(reference, r, name)


def test_eight_rank_fsdp_tp_interleaved_pp_matches_single_process(corpus_paths, reference, tmp_path):
    layout = [
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.pp_virtual=2",
        "parallel.pp_schedule=interleaved_1f1b",
    ]
    for r in run_ranks(train_losses, 8, corpus_paths, layout, str(tmp_path), timeout=600):
        _compare(reference, r, "fsdp_tp_pp")
