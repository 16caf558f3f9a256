"""MoE pricing from first principles: the routed experts' grouped GEMMs on the roofline at their real rows per
expert (sim/compute.py `grouped_gemm_time`), and the all-to-all on the links its EP group's placement reaches
(sim/step.py `_a2a_comm`, sim/comm.py `Cluster.all_to_all`)."""

from __future__ import annotations

import dataclasses

import pytest

from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.comm import Cluster
from scaletrain.sim.compute import grouped_gemm_time, layer_times, moe_share
from scaletrain.sim.workload import ClusterLayout, load_workload

# DeepSeek-V3's routed expert fc1: [7168, 2 x 2048] (gate and up).
N, K = 4096, 7168
FP8_BYTES = 1 + 1 / 32  # MXFP8: one 8-bit scale per 32 elements


@pytest.fixture(scope="module")
def h100():
    return load_catalog().gpu("h100")


def _weights_stream(gpu, experts: float, rows: float, n=N, k=K) -> float:
    """Seconds to move `experts` FP8 fprop operands (weight, rows x k FP8 in, rows x n bf16 out) at HBM copy rate."""
    return experts * (FP8_BYTES * (n * k + rows * k) + 2 * rows * n) / (gpu.hbm_copy_tbps * 1e12)


def test_grouped_gemm_is_memory_bound_below_the_crossover_and_compute_bound_above(h100):
    """Below the roofline crossover the eight experts' weights stream from HBM whatever their rows (time nearly flat
    in M, not stepping with the 128-row tile); far above it the time is the FLOPs at the ceiling."""
    e, launch = 8, h100.kernel_us * 1e-6
    ceiling = h100.matmul_fp8_tflops * 1e12
    crossover = FP8_BYTES * ceiling / (2 * h100.hbm_copy_tbps * 1e12)
    assert 200 < crossover < 300  # ~244 rows on H100 FP8
    small = {r: grouped_gemm_time(h100, e * r, N, K, e, True, 1.0) for r in (16, 64, 128, 192)}
    for r, t in small.items():
        assert t == pytest.approx(_weights_stream(h100, e, r) + launch, rel=1e-6)
    # 192 rows pad to two tiles: a FLOP price doubles from 128 to 192 rows; the weight stream grows by the rows' bytes.
    assert small[192] / small[128] < 1.1 and small[64] / small[16] < 1.05
    rows = 16384
    big = grouped_gemm_time(h100, e * rows, N, K, e, True, 0.9)
    assert big == pytest.approx(e * 2.0 * rows * N * K / (ceiling * 0.9) + launch, rel=1e-9)
    assert _weights_stream(h100, e, rows) < 0.2 * big


def test_experts_that_get_no_rows_read_no_weights(h100):
    """64 rows routed over 256 experts reach E(1 - (1 - 1/E)^64) = 56.7 of them; only those read their weights."""
    t = grouped_gemm_time(h100, 64, N, K, 256, True, 1.0) - h100.kernel_us * 1e-6
    touched = 256 * (1 - (1 - 1 / 256) ** 64)
    assert touched == pytest.approx(56.7, abs=0.1)
    assert t == pytest.approx(_weights_stream(h100, touched, 64 / touched), rel=1e-9)


def test_weight_gradient_accumulates_into_the_main_gradient(h100):
    """The wgrad pass writes dW into the fp32 main gradient (read and write, Megatron's gradient-accumulation fusion):
    it stays memory-bound to ~1,900 rows per expert, where fprop and dgrad turned compute-bound at ~240."""
    e, rows = 8, 512
    hbm = h100.hbm_copy_tbps * 1e12
    f = grouped_gemm_time(h100, e * rows, N, K, e, True, 1.0, kind="fprop")
    d = grouped_gemm_time(h100, e * rows, N, K, e, True, 1.0, kind="dgrad")
    w32 = grouped_gemm_time(h100, e * rows, N, K, e, True, 1.0, kind="wgrad")
    w16 = grouped_gemm_time(h100, e * rows, N, K, e, True, 1.0, kind="wgrad", grad_bytes=2.0)
    flop_time = e * 2.0 * rows * N * K / (h100.matmul_fp8_tflops * 1e12)
    launch = h100.kernel_us * 1e-6
    assert f == pytest.approx(flop_time + launch) and d == pytest.approx(flop_time + launch)
    assert w32 == pytest.approx(e * (FP8_BYTES * rows * (N + K) + 8 * N * K) / hbm + launch, rel=1e-9)
    assert w16 == pytest.approx(e * (FP8_BYTES * rows * (N + K) + 4 * N * K) / hbm + launch, rel=1e-9)
    with pytest.raises(ValueError, match="grouped GEMM pass 'bwd'"):
        grouped_gemm_time(h100, 1024, N, K, 8, True, 1.0, kind="bwd")


def test_against_deepgemm_published_h800_grouped_gemms(h100):
    """DeepGEMM's README (Feb 2025, H800: H100's SXM compute and HBM3) reports its masked-layout grouped FP8 GEMMs
    at 4 groups x 256 rows: 932 TFLOP/s for N 4096 K 7168 and 815 for N 7168 K 2048. The roofline at the kernel
    ceiling (efficiency 1) lands within 25% on both; a FLOP-only price is 26-28% fast."""
    for n, k, tflops in ((4096, 7168, 932.0), (7168, 2048, 815.0)):
        measured = 4 * 2.0 * 256 * n * k / (tflops * 1e12)
        model = grouped_gemm_time(h100, 4 * 256, n, k, 4, True, 1.0)
        assert model == pytest.approx(measured, rel=0.25)


def test_imbalance_grows_the_busiest_ranks_rows_not_the_whole_time():
    """moe_imbalance gives the busiest expert rank more rows. Where its experts are memory-bound (DeepSeek-V3 at TP8
    EP4 on H100: 64 rows per expert, 96 on the busiest rank, one tile either way) that costs only the rows' bytes; at
    1,024 rows per expert (EP64) it costs the extra FLOPs."""
    w = load_workload("deepseek-v3-671b")
    gpu = load_catalog().gpu("h100")
    rows = 4096 // 8 * w.shape.top_k  # the TP rank's sequence shard, top-8 copies of each token

    def extra_fwd(ep: int) -> float:
        layout = ClusterLayout(gpus=1024, tp=8, ep=ep, gbs=16384, fp8=True, moe_imbalance=1.5)
        base = layer_times(w, dataclasses.replace(layout, moe_imbalance=1.0), gpu, 0.9)
        return layer_times(w, layout, gpu, 0.9).gemm_fwd - base.gemm_fwd

    for ep, per_expert, lo, hi in ((4, 64, 0.0, 0.05), (64, 1024, 0.45, 0.55)):
        local = w.shape.experts // ep
        assert rows // local == per_expert
        plain = moe_share(w) * sum(
            grouped_gemm_time(gpu, rows, n, k, local, True, 0.9) for n, k in ((4096, 7168), (7168, 2048))
        )
        assert lo * plain <= extra_fwd(ep) <= hi * plain, (ep, extra_fwd(ep) / plain)


# ---------------------------------------------------------------- the all-to-all on the right links
def _cluster(gpus: int, gpu: str) -> Cluster:
    return Cluster(*load_catalog().system(gpu, None, None), gpus)


def _a2a(gpu: str, **layout) -> float:
    from scaletrain.sim.step import _a2a_comm

    w = load_workload("deepseek-v3-671b")
    return _a2a_comm(w, ClusterLayout(gpus=1024, gbs=16384, fp8=True, **layout), _cluster(1024, gpu))


def test_ep_group_folds_over_tp_and_stays_on_nvlink():
    """Megatron's expert rank generator (expert TP 1) and this trainer's expert mesh put an EP group on consecutive
    ranks whatever tp is: TP8 EP8 on an 8-GPU HGX board is all NVLink, not 8 boards over InfiniBand."""
    from scaletrain.sim.step import EP_STRIDE

    cl = _cluster(1024, "h100")
    assert EP_STRIDE == 1 and cl.placement(8, EP_STRIDE) == (8, 1)
    w = load_workload("deepseek-v3-671b")
    tokens = 4096 // 8
    routed = tokens * 8 * w.shape.hidden
    expect = (cl.all_to_all(8, routed) + cl.all_to_all(8, 2 * routed)) * moe_share(w)
    assert expect == pytest.approx(
        moe_share(w) * (2 * 7 * cl.node.nvlink_alpha_us * 1e-6 + 7 / 8 * 3 * routed / (cl.node.nvlink_busbw_gbps * 1e9))
    )
    assert _a2a("h100", tp=8, ep=8) == pytest.approx(expect)


def test_nvl72_keeps_an_ep16_group_inside_its_domain_and_hgx_crosses_ib():
    """EP16 on HGX H100 spans two boards: half of each rank's bytes cross its 400 Gb/s NIC. On a GB200 NVL72 the same
    group sits in one NVLink domain and is several times faster."""
    hgx, nvl = _cluster(1024, "h100"), _cluster(1024, "gb200")
    assert hgx.placement(16, 1) == (8, 2) and nvl.placement(16, 1) == (16, 1)
    size = 64e6
    nic = hgx.fabric.busbw_gbps * hgx.nic_share * 1e9
    assert hgx.all_to_all(16, size) >= 8 / 16 * size / nic
    assert _a2a("gb200", ep=16) * 5 < _a2a("h100", ep=16)


def test_all_to_all_across_nvl72_racks_pays_the_fabric_tiers_of_the_trays_it_spans():
    """EP144 over two NVL72 racks: 72/144 of each rank's bytes through its NIC, at the latency of a fabric reaching
    the 36 trays' NICs (two tiers of radix-64 switches), not of two nodes."""
    cl = _cluster(144, "gb200")
    size = 64e6
    nic = cl.fabric.busbw_gbps * cl.nic_share * 1e9
    assert cl.fabric.tiers(36 * cl.node.nics) == 2 and cl.fabric.tiers(2 * cl.node.nics) == 1
    inter = cl.net_alpha_us(36) * 1e-6 + 72 / 144 * size / nic
    assert cl.all_to_all(144, size) == pytest.approx(inter, rel=1e-9)


def test_a_gpu_without_fp8_moves_bf16_operands():
    """A100 has no FP8 tensor cores: an FP8 layout's expert GEMMs run, and read their weights, in bf16."""
    a100 = load_catalog().gpu("a100")
    assert a100.matmul_fp8_tflops == 0
    for rows in (64, 8192):
        assert grouped_gemm_time(a100, 8 * rows, N, K, 8, True, 1.0) == grouped_gemm_time(
            a100, 8 * rows, N, K, 8, False, 1.0
        )
