"""The simulator's side of every run's performance test: the CPU device built from measured figures, pricing a run,
the breakdown mapping, result.json's predicted_vs_measured block, and `scaletrain report`'s perf.png and table."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scaletrain.cli.main import main
from scaletrain.sim.comm import Cluster, ring_all_reduce
from scaletrain.sim.host_device import CPU_EFFICIENCY, GLOO_ALPHA_US, GLOO_BUSBW_GBPS, cpu_system
from scaletrain.sim.run_prediction import MEASURED_KEYS, compare, map_breakdown, price_run
from scaletrain.sim.workload import ClusterLayout, load_workload

DEVICE = {
    "kind": "cpu",
    "name": "test CPU",
    "peak_flops": 1e11,
    "mem_bw_bytes_s": 2e10,
    "kernel_s": 5e-6,
    "memory_bytes": 16e9,
}


def test_cpu_device_from_measured_figures():
    gpu, node, fabric = cpu_system(DEVICE)
    assert gpu.bf16_tflops == gpu.matmul_bf16_tflops == gpu.attn_tflops == pytest.approx(0.1)
    assert gpu.hbm_copy_tbps == pytest.approx(0.02) and gpu.kernel_us == pytest.approx(5.0)
    assert gpu.fp8_tflops == 0 and gpu.hbm_gb == pytest.approx(16)
    # No NVLink: every rank is its own domain, so a collective crosses the gloo ring.
    assert node.nvlink_domain == node.gpus_per_node == 1 and not fabric.sharp
    cl = Cluster(gpu, node, fabric, 4)
    size = 64e6
    assert cl.collective("all_reduce", 4, size) == pytest.approx(
        ring_all_reduce(4, size, GLOO_BUSBW_GBPS, GLOO_ALPHA_US)
    )
    assert cl.collective("all_to_all", 4, size) > 0 and cl.p2p(size, same_domain=False) > size / (GLOO_BUSBW_GBPS * 1e9)
    for bad in ({"peak_flops": 0}, {"mem_bw_bytes_s": None}, {"kernel_s": "fast"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            cpu_system({**DEVICE, **bad})


def test_ranks_sharing_a_host_are_priced_at_their_share():
    from scaletrain.sim.host_device import core_share, rank_share

    # Two one-thread ranks; the host's GEMM rate on two threads equals one thread's (two vCPUs that are one core's
    # hyperthreads): each rank gets half of it. Its copy bandwidth doubles on two threads: each keeps all of its own.
    two = {**DEVICE, "threads": 1, "cores": 2, "local_ranks": 2, "host_peak_flops": 1e11, "host_mem_bw_bytes_s": 4e10}
    assert rank_share(two, "peak_flops") == pytest.approx(0.5) and rank_share(two, "mem_bw_bytes_s") == 1.0
    gpu, node, fabric = cpu_system(two)
    assert gpu.bf16_tflops == pytest.approx(0.05) and gpu.hbm_copy_tbps == pytest.approx(0.02)
    assert fabric.busbw_gbps == pytest.approx(GLOO_BUSBW_GBPS)  # 2 threads on 2 cores: the ring keeps its cores
    # Four one-thread ranks on two cores: half a core each, for the gloo ring too.
    four = {**two, "local_ranks": 4, "host_peak_flops": 2e11}
    assert core_share(four) == 0.5 and rank_share(four, "peak_flops") == pytest.approx(0.5)
    assert cpu_system(four)[2].busbw_gbps == pytest.approx(GLOO_BUSBW_GBPS / 2)
    # A block without host figures (an older run) falls back on the core count; without that, no sharing.
    assert rank_share({**four, "host_peak_flops": None}, "peak_flops") == 0.5 and core_share(DEVICE) == 1.0


def _tiny():
    w = load_workload(
        "gpt3-proxy",
        ("model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=64", "model.vocab_size=1024"),
    )
    return w, ClusterLayout(gpus=1, mbs=8, gbs=16, zero=0)


def test_price_run_on_the_cpu_device_scales_with_the_measured_peak():
    w, layout = _tiny()
    slow = price_run(w, layout, *cpu_system(DEVICE), CPU_EFFICIENCY)
    fast = price_run(w, layout, *cpu_system({**DEVICE, "peak_flops": 4e11}), CPU_EFFICIENCY)
    assert fast["breakdown"]["fwd_bwd_s"] < slow["breakdown"]["fwd_bwd_s"]
    for p in (slow, fast):
        assert sum(p["breakdown"][k] for k in MEASURED_KEYS if k != "comm_exposed_s") == pytest.approx(p["step_time_s"])
        assert p["tokens_per_s"] == pytest.approx(16 * 64 / p["step_time_s"])
        assert 0 < p["mfu"] < 1 and p["memory_per_rank_gib"] > 0
    # Two DDP ranks: the gradient all-reduce over gloo appears as exposed communication.
    two = price_run(w, replace(layout, gpus=2), *cpu_system(DEVICE), CPU_EFFICIENCY)
    assert two["breakdown"]["comm_exposed_s"] > 0
    with pytest.raises(ValueError, match="gbs=15"):
        price_run(w, replace(layout, gbs=15), *cpu_system(DEVICE), CPU_EFFICIENCY)


def test_breakdown_mapping_keeps_the_total_and_nests_communication():
    sim = {
        "compute": 1.0,
        "dp_exposed": 0.25,
        "tp_exposed": 0.125,
        "optimizer": 0.5,
        "overhead": 0.0625,
        "sync": 0.0,
        "straggler": 0.03125,
        "pp_bubble": 0.25,
        "new_term": 0.5,
    }
    out = map_breakdown(sim)
    assert out == {
        "data_s": 0.0,
        "fwd_bwd_s": 1.65625,
        "optimizer_s": 0.5,
        "comm_exposed_s": 0.65625,
        "other_s": 0.5625,
    }
    assert out["data_s"] + out["fwd_bwd_s"] + out["optimizer_s"] + out["other_s"] == pytest.approx(sum(sim.values()))


def test_predicted_vs_measured_block():
    pred = {"step_time_s": 0.5, "tokens_per_s": 2048.0, "memory_per_rank_gib": 2.0}
    block = compare(pred, [9.0, 9.0, 1.0, 1.0, 1.0, 3.0], 1024, 3.0)
    assert block["step_time_s"] == {"predicted": 0.5, "measured": 1.0, "ratio": 2.0}  # median past the first third
    assert block["tokens_per_s"] == {"predicted": 2048.0, "measured": 1024.0, "ratio": 0.5}
    assert block["memory_peak_gib"] == {"predicted": 2.0, "measured": 3.0, "ratio": 1.5}
    failed = compare({**pred, "error": "ValueError: no"}, [1.0], 1024, 3.0)
    assert all(v["predicted"] is None and v["ratio"] is None and v["measured"] for v in failed.values())
    assert compare(pred, [], 1024, None)["step_time_s"] == {"predicted": 0.5, "measured": None, "ratio": None}


def _fake_run(path, step_s, prediction):
    path.mkdir()
    lines = []
    for step in range(1, 7):
        data, fwd, opt = 0.01, 0.8 * step_s, 0.1 * step_s
        lines.append(
            {
                "step": step,
                "loss": 7.0 - step / 10,
                "lr": 1e-3,
                "tokens": step * 1024,
                "step_time_s": step_s,
                "data_s": data,
                "fwd_bwd_s": fwd,
                "optimizer_s": opt,
                "comm_exposed_s": 0.1 * step_s,
                "other_s": step_s - data - fwd - opt,
            }
        )
    lines.append({"step": 6, "eval_loss": 6.5, "tokens": 6 * 1024, "eval_s": 0.3})
    lines.append({"step": 6, "checkpoint_s": 0.2})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "prediction.json").write_text(json.dumps(prediction))


def test_report_draws_perf_png_for_one_and_for_several_runs(tmp_path, capsys):
    breakdown = {"data_s": 0.0, "fwd_bwd_s": 0.4, "optimizer_s": 0.05, "comm_exposed_s": 0.1, "other_s": 0.05}
    _fake_run(tmp_path / "a", 1.0, {"schema": 1, "step_time_s": 0.5, "breakdown": breakdown})
    _fake_run(tmp_path / "b", 2.0, {"schema": 1, "error": "ValueError: cannot price it"})
    assert main(["report", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "a" / "perf.png").stat().st_size > 10_000 and (tmp_path / "a" / "loss.png").is_file()
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out.splitlines() if line.startswith("a ")}
    assert rows[("a", "measured")][:2] == ["1.0000", "2.00"]  # median step, measured/predicted
    assert rows[("a", "predicted")][0] == "0.5000" and rows[("a", "predicted")][3] == "0.1000"  # comm_exposed_s
    both = tmp_path / "both.png"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(both)]) == 0
    out = capsys.readouterr().out
    assert both.stat().st_size > 10_000 and (tmp_path / "b" / "loss.png").is_file()
    assert "prediction failed: ValueError: cannot price it" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("b ")] == ["measured", "predicted"]


def test_comm_wait_hook_is_shared_between_trainers_and_restored():
    from torch._C._distributed_c10d import Work

    from scaletrain.train.perf import _CLOCK, CommWaits

    # A trainer of an earlier test in this process may still hold the hook: count relative to where we start.
    start = _CLOCK.users
    original = _CLOCK.original if start else Work.wait
    a, b = CommWaits(), CommWaits()
    a.install()
    b.install()
    a.install()  # idempotent per user
    assert Work.wait != original and CommWaits.seconds() >= 0 and _CLOCK.users == start + 2
    a.uninstall()
    assert Work.wait != original  # b still times its waits
    b.uninstall()
    b.uninstall()
    assert _CLOCK.users == start and (Work.wait == original) == (start == 0)


def test_perf_and_loss_plots_name_their_curves_as_metrics_jsonl_does(tmp_path):
    import matplotlib.pyplot as plt

    from scaletrain.train.perf_report import RunPerf, perf_figure
    from scaletrain.train.report import loss_figure, read_loss

    breakdown = {"data_s": 0.0, "fwd_bwd_s": 0.4, "optimizer_s": 0.05, "comm_exposed_s": 0.1, "other_s": 0.05}
    _fake_run(tmp_path / "a", 1.0, {"schema": 1, "step_time_s": 0.5, "breakdown": breakdown})
    _fake_run(tmp_path / "b", 1.0, {"schema": 1, "step_time_s": 0.5, "breakdown": breakdown})

    def legends(fig):
        try:
            return [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes]
        finally:
            plt.close(fig)

    steps, bars = legends(perf_figure([RunPerf(tmp_path / "a")]))
    assert bars == ["data_s", "fwd_bwd_s", "comm_exposed_s (in fwd_bwd_s)", "optimizer_s", "other_s"]
    assert steps == ["a", "a predicted"]
    (one,) = legends(loss_figure(tmp_path / "a", read_loss([tmp_path / "a"])))
    assert one == ["loss", "eval_loss"]  # was "train loss" / "train eval"
    (two,) = legends(loss_figure(tmp_path, read_loss([tmp_path / "a", tmp_path / "b"])))
    assert two == ["a loss", "a eval_loss", "b loss", "b eval_loss"]
