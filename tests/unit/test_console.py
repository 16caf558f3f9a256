"""The live view of a run: plain log lines off a terminal, an honest progress bar on one."""

from __future__ import annotations

import io
import sys

from rich.console import Console

from scaletrain.train.console import LogLines, ProgressBar, live_view

RECORD = {
    "step": 20,
    "loss": 2.718281,
    "lr": 6e-5,
    "grad_norm": 0.31416,
    "tokens_per_s": 1234567.8,
    "mfu": 0.41234,
    "mfu_peak": "h100 dense bf16 989 TFLOP/s",
    "peak_mem_gib": 61.234,
}


def test_training_line_has_every_field_and_the_eta_to_the_bound():
    lines = LogLines(total_steps=100, first_step=10, total_label="decay end", memory_label="max allocated")
    # 10 steps in 50 s since the start at step 10: 80 steps left take 400 s.
    assert lines.format(RECORD, elapsed_s=50.0) == (
        "step: 20/<=100  loss: 2.7183  lr: 6.00e-05  grad_norm: 0.3142  tok/s: 1,234,568  "
        "mfu: 41.23% of h100 dense bf16 989 TFLOP/s  memory: 61.23 GiB max allocated  "
        "eta: <=0:06:40 to step 100 (decay end)"
    )


def test_cpu_line_has_no_mfu_and_the_last_step_no_eta():
    record = {k: v for k, v in RECORD.items() if k not in ("mfu", "mfu_peak")}
    line = LogLines(total_steps=20).format(record, elapsed_s=3.0)
    assert line == (
        "step: 20/<=20  loss: 2.7183  lr: 6.00e-05  grad_norm: 0.3142  tok/s: 1,234,568  memory: 61.23 GiB peak RSS"
    )


def test_evaluation_line_and_printing():
    out = io.StringIO()
    lines = LogLines(total_steps=30, target=2.69, out=out)
    lines.update({"step": 10, "eval_loss": 3.14159, "tokens": 1})
    assert out.getvalue() == "step: 10/<=30  eval_loss: 3.1416  target: 2.69\n"


def test_bar_only_on_a_terminal_and_its_total_is_an_upper_bound(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert isinstance(live_view(30, progress=True), LogLines)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert isinstance(live_view(30, progress=False), LogLines)
    bar = live_view(30, progress=True, first_step=5)
    try:
        assert isinstance(bar, ProgressBar)
        bar.update({"step": 7, "loss": 4.5, "tokens_per_s": 1000.0})
        console = Console(file=io.StringIO(), width=200, color_system=None)
        console.print(bar._progress.get_renderable())
        text = console.file.getvalue()
    finally:
        bar.close()
    assert "step 7/≤30" in text and "ETA ≤" in text and "(target may stop it sooner)" in text
    assert "loss 4.500" in text


def test_eta_to_the_budget_is_a_bound_and_the_eval_trend_gives_the_target_estimate():
    # The bench proxies converge at a fraction of their step budget: an ETA to the budget read as an estimate was
    # 3-5x too long. Budget 320, one step a second, evaluations every 32 steps, target 5.9.
    lines = LogLines(total_steps=320, target=5.9)
    train = {"step": 40, "loss": 6.3, "lr": 1e-3, "tokens_per_s": 1000.0}
    assert lines.format(train, elapsed_s=40.0).endswith("eta: <=0:04:40 to step 320 (step budget)")
    lines.format({"step": 32, "eval_loss": 6.5}, elapsed_s=32.0)
    assert lines.format(train, elapsed_s=40.0).endswith("eta: <=0:04:40 to step 320 (step budget)")  # one point
    lines.format({"step": 64, "eval_loss": 6.2}, elapsed_s=64.0)
    # Falling 0.3 per doubling of the steps: 0.3 more from step 64 is step 128, an evaluation step.
    line = lines.format({**train, "step": 70}, elapsed_s=70.0)
    assert line.endswith("eta: ~0:00:58 to the target (step ~128), <=0:04:10 to step 320 (step budget)"), line


def test_target_eta_rounds_up_to_an_evaluation_and_gives_up_past_the_budget():
    from scaletrain.train.console import target_eta

    assert target_eta([(32, 6.5), (64, 6.2)], 5.9, 64, 320) == 128
    assert target_eta([(32, 6.5), (64, 6.2)], 6.0, 64, 320) == 128  # reached at ~101: checked at 128
    assert target_eta([(32, 6.5), (64, 6.2)], 5.0, 64, 320) is None  # the trend reaches it past the budget
    assert target_eta([(32, 6.2), (64, 6.3)], 5.9, 64, 320) is None  # not falling
    assert target_eta([(32, 6.5), (64, 6.2)], None, 64, 320) is None
    assert target_eta([(64, 6.2)], 5.9, 64, 320) is None
