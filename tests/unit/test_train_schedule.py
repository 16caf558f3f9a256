"""The loop's schedule: evaluation cadence (with llama2_70b_lora's skipped first evaluations) and the step budget."""

from __future__ import annotations

import pytest

from scaletrain.bench.scripted import lora_reference_config
from scaletrain.config import resolve
from scaletrain.sim.mlperf import eval_interval_steps, skipped_evals
from scaletrain.train.schedule import EvalSchedule, eval_every_steps, eval_skip, max_benchmark_steps, next_eval_step


def gpt3(*overrides):
    return resolve("gpt3-175b", overrides=["train.global_batch_size=2048", *overrides])


def test_eval_cadence_and_step_budget():
    assert eval_every_steps(gpt3()) == 12
    assert eval_every_steps(gpt3("train.global_batch_size=1536")) == 16
    assert eval_every_steps(gpt3("train.global_batch_size=2560")) == 10  # ceil(9.6)
    assert max_benchmark_steps(gpt3()) == 81450 - 3000  # the checkpoint's steps are already spent
    assert max_benchmark_steps(gpt3("train.max_steps=5")) == 5


@pytest.mark.parametrize(
    "gbs, skip, every, first_eval_samples", [(8, 3, 48, 1536), (16, 4, 24, 1920), (40, 7, 10, 3200)]
)
def test_skip_count_and_cadence(gbs, skip, every, first_eval_samples):
    cfg = lora_reference_config(f"train.global_batch_size={gbs}")
    assert eval_skip(cfg) == skip == skipped_evals("llama2_70b_lora", gbs)  # floor(0.125*GBS + 2)
    assert eval_every_steps(cfg) == every == eval_interval_steps("llama2_70b_lora", gbs)  # ceil(384/GBS)
    first = next_eval_step(cfg, 0)
    assert first == (skip + 1) * every and first * gbs == first_eval_samples
    assert [next_eval_step(cfg, s) for s in (first - 1, first, first + 1)] == [first, first + every, first + every]
    gpt3 = lora_reference_config(f"train.global_batch_size={gbs}", "bench.benchmark=gpt3")
    assert eval_skip(gpt3) == 0 and next_eval_step(gpt3, 0) == every  # the skip is lora's alone
    proxy = lora_reference_config(f"train.global_batch_size={gbs}", "bench.benchmark=llama2_70b_lora-proxy")
    assert eval_skip(proxy) == skip  # a proxy keeps its benchmark's cadence


def test_blocks_end_at_evaluations_or_the_budget():
    plan = EvalSchedule(gpt3("train.max_steps=30"))
    assert (plan.limit, plan.skip, plan.tps) == (30, 0, 2048 * 2048)
    assert [plan.next_stop(s) for s in (0, 11, 12, 24, 29)] == [12, 12, 24, 30, 30]
